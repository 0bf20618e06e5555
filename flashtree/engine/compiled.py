"""torch.compile for the round's pieces, with the time spent compiling measured and reported.

On the CPU this is inductor (C++ codegen); on CUDA it is mode="reduce-overhead", which captures
a CUDA graph per shape bucket. Compilation happens lazily, the first time a bucket is seen, and
costs once per process; `seconds` adds up those first calls, so stage timings can leave them out.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import Tensor

RECOMPILE_LIMIT = 256  # variants per compiled function, over all engines of a process (default 8)


class Compiler:
    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.mode = "reduce-overhead" if device.type == "cuda" else None
        # One graph with symbolic sizes serves every bucket, which keeps compile time (minutes on a
        # loaded CPU) to a graph or two per function; on CUDA, reduce-overhead then records one
        # CUDA graph per bucket it meets. Buffers of fixed shape (caches) are marked static by `keep`.
        self.cuda = device.type == "cuda"
        self.seconds = 0.0  # spent in calls that compiled a new bucket
        if enabled:
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)

    def keep(self, buffers: list[Tensor]) -> None:
        """Tensors that live across calls with a fixed shape and address (the caches): static dims
        for symbolic-shape graphs; on CUDA also static addresses, so CUDA graphs may write them."""
        if not self.enabled:
            return
        for t in buffers:
            torch._dynamo.mark_static(t)
            if self.cuda:
                torch._dynamo.mark_static_address(t)

    def __call__(self, fn: Callable) -> Callable:
        """fn compiled (or fn itself when disabled), timing its first call per input signature."""
        if not self.enabled:
            return fn
        compiled = torch.compile(fn, mode=self.mode, dynamic=True)
        seen: set = set()

        def run(*args, **kwargs):
            key = signature((args, kwargs))
            if key in seen:
                return compiled(*args, **kwargs)
            t0 = time.perf_counter()
            out = compiled(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            seen.add(key)
            return out

        return run


def signature(x: Any):
    """What compiled code specialises on: tensor shapes and dtypes, plain values, lengths of lists."""
    if isinstance(x, Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (tuple, list)):
        if x and all(isinstance(v, int) for v in x):
            return ("L", len(x))  # host lists (slots, starts) are bookkeeping, not compiled inputs
        return tuple(signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, signature(v)) for k, v in x.items())
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(signature(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return (type(x).__name__, id(x))
