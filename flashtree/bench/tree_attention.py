"""Timing one verify layer's attention: the one-bias SDPA against the prefix + tree LSE path.

Both read K/V laid out as the cache holds them ([R, S, Hkv, D] viewed as [R, Hkv, S, D]) and the
window's keys at rows start..start+n-1. Per-forward work (the masks, built once for all layers)
is timed apart from the per-layer attention, since a forward pays it once.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from flashtree.models.mask import additive, tree_ancestor_mask, tree_window_mask
from flashtree.models.tree_attention import tree_attention, tree_parts
from flashtree.tree import TreeSpec, ancestor_table


def random_ancestors(rows: int, n: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[R, n, n] ancestor-or-self masks of random trees (each node's parent drawn among earlier nodes)."""
    parents = torch.full((rows, n), -1, dtype=torch.long)
    depths = torch.zeros(rows, n, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = (torch.rand(rows, generator=gen) * i).long()
        depths[:, i] = depths.gather(1, parents[:, i : i + 1])[:, 0] + 1
    spec = TreeSpec(torch.zeros(rows, n, dtype=torch.long), parents, depths, torch.full((rows,), n))
    return tree_ancestor_mask(ancestor_table(spec), depths).to(device)


def median_ms(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Median milliseconds of each fn after two warm-ups, the fns called in turn at every repeat so
    that a shared machine's drift hits them alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns * 2:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
    return [1000 * sorted(ts)[len(ts) // 2] for ts in times]


@torch.inference_mode()
def time_tree_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                        context: int, nodes: int, rows: int = 1, uneven: bool = False, repeats: int = 20) -> dict:
    """One layer's tree attention at `context` committed keys and a tree of `nodes`, old and new.

    uneven: rows start at context, context - 1, ... (a batch whose slots differ in length), so the
    new path takes its key padding mask. Returns milliseconds and the two outputs' max difference.
    """
    gen = torch.Generator().manual_seed(0)
    starts_list = [max(context - i, 0) if uneven else context for i in range(rows)]
    starts = torch.tensor(starts_list, device=device)
    key_len = max(starts_list) + nodes
    cache = lambda: torch.randn(rows, key_len, kv_heads, head_dim, generator=gen).to(device, dtype)  # noqa: E731
    k_cache, v_cache = cache(), cache()
    keys, values = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    window = starts[:, None] + torch.arange(nodes, device=device)
    pick = lambda x: x[torch.arange(rows, device=device)[:, None], window].transpose(1, 2)  # noqa: E731
    k_win, v_win = pick(k_cache), pick(v_cache)
    q = torch.randn(rows, nodes, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    anc = random_ancestors(rows, nodes, device, gen)
    scale = head_dim**-0.5

    def old_mask():
        return additive(tree_window_mask(starts, anc, key_len), dtype)

    def new_mask():
        parts = tree_parts(starts, starts_list, anc, key_len, dtype)
        parts.folded_tree_bias(heads // kv_heads)
        return parts

    bias, parts = old_mask(), new_mask()
    p = parts.prefix_len

    def old():
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale,
                                              enable_gqa=heads != kv_heads)

    def new():
        return tree_attention(q, k_win, v_win, keys[:, :, :p], values[:, :, :p], parts, scale)

    diff = (old().float() - new().float()).abs().max().item()
    old_ms, new_ms = median_ms([old, new], device, repeats)
    old_mask_ms, new_mask_ms = median_ms([old_mask, new_mask], device, repeats)
    return {"context": context, "nodes": nodes, "rows": rows, "uneven": uneven, "old_layer_ms": old_ms,
            "new_layer_ms": new_ms, "old_mask_ms": old_mask_ms, "new_mask_ms": new_mask_ms, "max_abs_diff": diff}
