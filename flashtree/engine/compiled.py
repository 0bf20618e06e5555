"""torch.compile for the round's pieces, with the time spent compiling measured and reported.

On the CPU this is inductor (C++ codegen); on CUDA it is mode="reduce-overhead", which captures
a CUDA graph per shape bucket. Compilation happens lazily, the first time a bucket needs a graph,
and costs once per process; `seconds` adds up the calls that compiled, so stage timings can
leave them out.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor
from torch._dynamo.utils import counters

RECOMPILE_LIMIT = 256  # variants per compiled function, over all engines of a process (default 8)


class Compiler:
    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.mode = "reduce-overhead" if self.cuda else None
        self.seconds = 0.0  # spent in calls that compiled a graph
        if enabled:
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)

    def keep(self, buffers: list[Tensor]) -> None:
        """Tensors that live across calls with a fixed shape and address (the caches): static dims
        in the symbolic-shape graphs; on CUDA also static addresses, so CUDA graphs may write them."""
        if not self.enabled:
            return
        for t in buffers:
            torch._dynamo.mark_static(t)
            if self.cuda:
                torch._dynamo.mark_static_address(t)

    def __call__(self, fn: Callable) -> Callable:
        """fn compiled (or fn itself when disabled); calls that compiled a graph are timed.

        Sizes are symbolic (dynamic=True), so one graph serves every bucket; that keeps compile
        time, minutes on a loaded CPU, to a graph or two per function. On CUDA, reduce-overhead
        records one CUDA graph per bucket it meets."""
        if not self.enabled:
            return fn
        compiled = torch.compile(fn, mode=self.mode, dynamic=True)

        def run(*args, **kwargs):
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            out = compiled(*args, **kwargs)
            if counters["stats"]["unique_graphs"] != graphs:
                self.seconds += time.perf_counter() - t0
            return out

        return run
