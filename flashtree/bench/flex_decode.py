"""Decode attention whose graph does not depend on the key length: FlexAttention over a layer's whole
cache against the captured rounds' path today (each row's keys gathered up to its key bucket, one
SDPA under an additive mask).

The cache is one layer of flashtree's KVCache, [slots, max_len, kv_heads, dim]. Flex reads it as one
key sequence of slots x max_len keys (key batch 1, broadcast over the rows) through a BlockMask built
from tensors alone: row r reads the key blocks of its own slot up to its start plus the window, and
its mask sees the committed prefix and, inside the window, its ancestors. A captured graph can then
serve every length. The function here times both and returns their outputs' difference; whether the
engine takes Flex is for a GPU to decide (benchmarks/gpu_check.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flashtree.bench.tree_attention import median_ms, random_ancestors
from flashtree.engine.shapes import key_bucket

BLOCK = 128  # FlexAttention's key block: a slot's length is a multiple of it


def flex_block_mask(slots: Tensor, starts: Tensor, seen: Tensor, max_len: int, num_slots: int):
    """The BlockMask of rows on `slots` [R] with `starts` [R] committed keys and a window whose node
    i sees node j where seen [R, n, n] (ancestor-or-self): row r reads only its own slot's blocks, the
    ones wholly inside its prefix as full blocks (no mask), the one to three around its window under
    the mask, which also bounds the row to its slot."""
    from torch.nn.attention.flex_attention import BlockMask

    R, n = seen.shape[:2]
    per, blocks = max_len // BLOCK, num_slots * (max_len // BLOCK)
    step = torch.arange(blocks, device=slots.device)
    base = (slots * per)[:, None]
    full = starts // BLOCK  # blocks every query sees whole
    partial = (starts + n - 1) // BLOCK - full + 1

    def table(count: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
        index = torch.where(step < count[:, None], base + first[:, None] + step, 0)
        return count.to(torch.int32).view(R, 1, 1), index.to(torch.int32).view(R, 1, 1, blocks)

    def mask_mod(b, h, q, kv):
        pos = kv - slots[b] * max_len
        node = pos - starts[b]
        window = (node >= 0) & (node < n) & seen[b, q, node.clamp(0, n - 1)]
        return ((pos >= 0) & (pos < starts[b])) | window

    kv_num, kv_index = table(partial, full)
    full_num, full_index = table(full, torch.zeros_like(full))
    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, num_slots * max_len))


def flex_decode(flex: Callable, q: Tensor, cache_k: Tensor, cache_v: Tensor, block_mask, scale: float) -> Tensor:
    """q [R, H, n, D] over the whole cache layer [S, L, Hkv, D] (no gather), as [R, H, n, D]."""
    S, L, Hkv, D = cache_k.shape
    k = cache_k.view(1, S * L, Hkv, D).transpose(1, 2)
    v = cache_v.view(1, S * L, Hkv, D).transpose(1, 2)
    return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != Hkv)


def gathered_decode(q: Tensor, cache_k: Tensor, cache_v: Tensor, slots: Tensor, starts: Tensor, seen: Tensor,
                    key_len: int, scale: float) -> Tensor:
    """Today's captured path: each row's first key_len keys gathered, one SDPA under an additive mask."""
    n = seen.shape[1]
    k, v = cache_k[slots, :key_len].transpose(1, 2), cache_v[slots, :key_len].transpose(1, 2)
    pos = torch.arange(key_len, device=q.device)
    node = pos - starts[:, None]  # [R, key_len]
    inside = node[:, None, :].clamp(0, n - 1).expand(-1, n, -1)
    window = (node >= 0)[:, None, :] & (node < n)[:, None, :] & seen.gather(2, inside)
    visible = (pos < starts[:, None])[:, None, :] | window  # [R, n, key_len]
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@torch.inference_mode()
def time_flex_decode(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                     lengths: list[int], nodes: int, max_len: int, compiled: bool = True, repeats: int = 20) -> dict:
    """One layer: rows at `lengths` committed keys on scattered slots of a cache of 2 x rows slots,
    each verifying a random tree of `nodes` (nodes = 1: an AR step). Milliseconds of the gathered
    SDPA at the key bucket and of Flex over the whole cache, and their outputs' max difference."""
    if max_len % BLOCK:
        raise ValueError(f"max_len {max_len} is not a multiple of Flex's key block {BLOCK}")
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    R, slots_n = len(lengths), 2 * len(lengths)
    shape = (slots_n, max_len, kv_heads, head_dim)
    cache_k = torch.randn(shape, generator=gen).to(device, dtype)
    cache_v = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(R, heads, nodes, head_dim, generator=gen).to(device, dtype)
    slots = torch.randperm(slots_n, generator=gen)[:R].to(device)
    starts = torch.tensor(lengths, device=device)
    seen = random_ancestors(R, nodes, device, gen) if nodes > 1 else torch.ones(R, 1, 1, dtype=torch.bool,
                                                                                  device=device)
    scale = head_dim ** -0.5
    key_len = key_bucket(max(lengths) + nodes, max_len)
    mask = flex_block_mask(slots, starts, seen, max_len, slots_n)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention  # one kernel per shape
    old = lambda: gathered_decode(q, cache_k, cache_v, slots, starts, seen, key_len, scale)  # noqa: E731
    new = lambda: flex_decode(flex, q, cache_k, cache_v, mask, scale)  # noqa: E731
    diff = float((old().float() - new().float()).abs().max())
    old_ms, new_ms = median_ms([old, new], device, repeats)
    return {"lengths": list(lengths), "nodes": nodes, "key_len": key_len, "gathered_ms": old_ms, "flex_ms": new_ms,
            "max_abs_diff": diff}
