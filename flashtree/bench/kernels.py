"""Kernel ops a forward dispatches, counted per module as a GPU would launch them.

Views launch nothing, so they are left out. `F.rms_norm` is one fused kernel on CUDA while the
CPU decomposes it into 6-8 ops, so a function mode counts each call as one and hides what it
dispatches. The count is what the per-layer op budget (tests/test_kernel_budget.py) holds.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FUSED = {F.rms_norm: "rms_norm"}  # one kernel on CUDA, decomposed on the CPU
FREE = {"aten::promote_types", "aten::lift_fresh", "aten::size", "aten::sym_size"}  # no kernel launch


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "KernelCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        owner = self.owner
        out = func(*args, **(kwargs or {}))
        if owner.label is not None and not owner.fused_depth:
            name = func._schema.name
            # An op that returns an alias of its input (a view, a reshape or `to` that did not copy)
            # launches nothing; an in-place op does.
            if name not in FREE and (func._schema.is_mutable or not _aliases(out, args)):
                owner.ops[owner.label][name.removeprefix("aten::")] += 1
        return out


def _aliases(out, args) -> bool:
    """out (or its first tensor) shares storage with a tensor argument."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(first, torch.Tensor):
        return True
    ptr = first.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


class _Fused(TorchFunctionMode):
    def __init__(self, owner: "KernelCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = FUSED.get(func)
        if name is None:
            return func(*args, **(kwargs or {}))
        owner = self.owner
        if owner.label is not None and not owner.fused_depth:
            owner.ops[owner.label][name] += 1
        owner.fused_depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            owner.fused_depth -= 1


class KernelCounter:
    """Counts kernel ops inside each watched module's forward, by op name, under `label`."""

    def __init__(self) -> None:
        self.ops: dict[str, Counter] = {}
        self.label: str | None = None
        self.fused_depth = 0

    @contextmanager
    def watch(self, modules: dict[str, nn.Module]):
        """Count while the model runs; each module's forward is counted under its label."""
        handles = []
        for label, module in modules.items():
            self.ops.setdefault(label, Counter())
            handles.append(module.register_forward_pre_hook(lambda m, a, label=label: self._enter(label)))
            handles.append(module.register_forward_hook(lambda m, a, o: self._exit()))
        try:
            with _Fused(self), _Dispatch(self):
                yield self
        finally:
            for h in handles:
                h.remove()

    def _enter(self, label: str) -> None:
        self.label = label

    def _exit(self) -> None:
        self.label = None

    def total(self, label: str) -> int:
        return sum(self.ops[label].values())


def count_layer_ops(run, modules: dict[str, nn.Module]) -> dict[str, Counter]:
    """Kernel ops per module label while `run()` executes (one forward, say)."""
    counter = KernelCounter()
    with torch.inference_mode(), counter.watch(modules):
        run()
    return counter.ops
