"""Linear layers on the CPU through oneDNN with prepacked weights.

A verify window multiplies 16 to a few hundred rows by every weight. PyTorch's CPU `F.linear` runs
float32 through MKL, whose GEMM on some CPUs (AMD EPYC with AVX-512, measured) reaches under half of
what oneDNN does with its weights reordered once into its blocked layout, which is what vLLM's CPU
runner uses (docs/performance.md); bfloat16 gains 1.1-1.7x. A float32 product of one row reads the
weight once and MKL's is the faster, so it keeps `F.linear`; every other product goes through the
packed copy. The copy lives on the weight tensor itself, so each model, and each engine sharing a
compiled graph, multiplies by its own weights.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.errors import FlashtreeError
from flashtree.models.ops import opaque

_PACKS = "_flashtree_packs"  # the weight tensor's attribute: (start, stop) -> (weight version, packed rows)


def available() -> bool:
    """Whether this PyTorch build can pack linear weights for oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_rows(weight: Tensor, start: int, stop: int) -> Tensor:
    """Rows start..stop of `weight` in oneDNN's layout, packed once and kept on the weight (again
    only if the weight was written since)."""
    packs = weight.__dict__.setdefault(_PACKS, {})
    version = -1 if weight.is_inference() else weight._version  # inference tensors keep no version
    held = packs.get((start, stop))
    if held is None or held[0] != version:
        rows = weight.detach()[start:stop].contiguous()
        held = packs[start, stop] = (version, torch.ops.mkldnn._reorder_linear_weight(rows))
    return held[1]


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, start: int, stop: int) -> Tensor:
    """x @ weight[start:stop].T (+ bias) through the packed rows (`linear` keeps float32 one-row products)."""
    b = None if bias is None else bias[start:stop].contiguous()
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_rows(weight, start, stop), b, "none", [], "")


# What a compiled graph calls: opaque to inductor, which would otherwise lower it to MKL's mm.
_packed_linear = opaque("packed_linear(Tensor x, Tensor weight, Tensor? bias, int start, int stop) -> Tensor",
                        packed_linear, lambda x, weight, bias, start, stop: x.new_empty(*x.shape[:-1], stop - start))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool, rows: slice | None = None) -> Tensor:
    """x @ weight[rows].T + bias[rows]: through the packed copy where `packed` (the module was marked
    by `pack_linears`), else F.linear."""
    # float32, one row (a size dynamo specialised, never a symbolic one, so no guard is added): F.linear.
    if packed and (weight.dtype != torch.float32 or not all(type(n) is int and n == 1 for n in x.shape[:-1])):
        start, stop = (0, weight.shape[0]) if rows is None else (rows.start, rows.stop)
        op = _packed_linear if torch.compiler.is_compiling() else packed_linear
        return op(x, weight, bias, start, stop)
    if rows is not None:
        weight, bias = weight[rows], None if bias is None else bias[rows]
    return F.linear(x, weight, bias)


def packable(model: nn.Module) -> list[nn.Module]:
    """The model's linear modules (those with a `packed` flag) whose weight is a float32 or bfloat16 CPU matrix."""
    return [m for m in model.modules() if hasattr(m, "packed") and m.weight.device.type == "cpu"
            and m.weight.dtype in (torch.float32, torch.bfloat16) and m.weight.dim() == 2]


def free_memory() -> int:
    """Bytes of free physical memory; where the platform cannot say, 2 GiB (so only small models pack)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 2 << 30


def pack_linears(models: list[nn.Module], wanted: bool | None) -> bool:
    """Mark every packable linear of `models` and pack its weight now, so no request packs one.
    wanted None: when oneDNN is there and the copies fit in half the free memory (they double the
    linear weights' memory); True insists (an error without oneDNN); False packs nothing."""
    modules = [m for model in models if model is not None for m in packable(model)]
    decided = {m.__dict__["packed"] for m in modules if "packed" in m.__dict__}
    if decided:  # modules shared with an engine that decided already (share_weights): one decision for all
        chosen = decided.pop()
        if wanted is not None and wanted != chosen:
            raise FlashtreeError(f"pack_weights={wanted} on weights shared with an engine that "
                                 f"{'packed' if chosen else 'did not pack'} them (share_weights); give both "
                                 "engines the same pack_weights")
    else:
        chosen = bool(modules) and wanted is not False and _fits(modules, wanted)
    for m in modules:
        m.packed = chosen
        if chosen:
            packed_rows(m.weight, 0, m.weight.shape[0])
    return chosen


def _fits(modules: list[nn.Module], wanted: bool | None) -> bool:
    """Whether oneDNN is there and (unless `wanted` insists) the packed copies fit."""
    if not available():
        if wanted:
            raise FlashtreeError("pack_weights=True needs PyTorch's oneDNN (torch.backends.mkldnn), which this "
                                 "build lacks; leave pack_weights unset")
        return False
    need = sum({id(m.weight): m.weight.numel() * m.weight.element_size() for m in modules}.values())
    free = free_memory()
    if wanted is None and need > free / 2:
        print(f"flashtree: linear weights not packed for oneDNN: their copies need {need / 2**30:.1f} GiB, "
              f"{free / 2**30:.1f} GiB is free (pack_weights=True insists)", file=sys.stderr, flush=True)
        return False
    return True
