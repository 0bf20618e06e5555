"""Rank 0's runner under tensor parallelism: the engine's runner, with every method call sent to
the workers first, so all ranks run the same round on their slices of the target.

The engine talks to its runner only through method calls (prefill, step, ...), whatever they
are: any bound method is mirrored by name, and plain attributes read through unchanged.
"""

from __future__ import annotations

import inspect

from flashtree.errors import FlashtreeError
from flashtree.parallel.workers import EngineLink, digest


class MirroredRunner:
    def __init__(self, runner, link: EngineLink) -> None:
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "link", link)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"cannot set runner.{name} under tensor parallelism: the workers would not see it; "
                             "change the runner through a method call, which they mirror")

    def __getattr__(self, name: str):
        value = getattr(self.runner, name)
        if name.startswith("_") or not inspect.ismethod(value):
            return value
        return lambda *args, **kwargs: self._call(name, args, kwargs)

    def _call(self, name: str, args: tuple, kwargs: dict):
        cluster = self.link.cluster
        cluster.send(("call", self.link.engine_id, name, args, kwargs))
        try:
            result = getattr(self.runner, name)(*args, **kwargs)
        except FlashtreeError:
            raise  # every worker met it too, at the same point
        except Exception:
            cluster.check(grace=5.0)  # a collective failed: a dead worker is the reason to report
            raise
        if cluster.check_results:
            mine = digest(result, self.runner)
            for rank in range(1, cluster.world):
                (theirs,) = cluster.receive(rank, "digest")
                if theirs != mine:
                    raise FlashtreeError(f"tensor-parallel rank {rank} disagrees with rank 0 after {name}(); "
                                         "the ranks no longer commit the same tokens")
        return result
