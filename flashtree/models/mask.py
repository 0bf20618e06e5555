"""Attention masks, and the per-node tree lookups built from the ancestor table.

A window of n nodes sits at cache rows start .. start+n-1 of each slot; keys are the slot's
first key_len rows, so a mask row sees every committed key (< start) plus the window keys its
tree (or causality) allows. Keys past a slot's window are never visible, which is what lets
key_len be padded to a bucket.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_window_mask(starts: Tensor, n: int, key_len: int) -> Tensor:
    """[R, 1, n, key_len]: committed keys, then the window causally (prefill, AR, DFlash)."""
    rel = _relative_keys(starts, key_len)
    window = (rel >= 0) & (rel <= torch.arange(n, device=starts.device)[None, :, None])
    return ((rel < 0) | window)[:, None]


def tree_window_mask(starts: Tensor, ancestors: Tensor, key_len: int) -> Tensor:
    """[R, 1, n, key_len]: committed keys, then the node's ancestors and itself (ancestors [R, n, n])."""
    n = ancestors.shape[1]
    rel = _relative_keys(starts, key_len)
    inside = (rel >= 0) & (rel < n)
    picked = ancestors.gather(2, rel.clamp(0, n - 1).expand(-1, n, -1))
    return ((rel < 0) | (picked & inside))[:, None]


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = visible) as SDPA's additive bias in the compute dtype: built once per
    forward, so no layer's SDPA converts it again."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), float("-inf"), dtype=dtype, device=mask.device))


def lower_right_causal(n: int, key_len: int, device: torch.device) -> Tensor | None:
    """A causal window of n queries after a prefix, over exactly its key_len keys, as SDPA's
    lower-right CausalBias: flash-eligible on CUDA, so no mask tensor. On the CPU SDPA would build
    the mask in every layer, so the caller keeps its one additive bias (None here)."""
    if not lower_right_flash(device):
        return None
    from torch.nn.attention.bias import causal_lower_right  # imports dynamo (~70 MB): only where it is used

    return causal_lower_right(n, key_len)


def lower_right_flash(device: torch.device) -> bool:
    return device.type == "cuda"


def _relative_keys(starts: Tensor, key_len: int) -> Tensor:
    """[R, 1, key_len]: each key row's offset from its slot's window start."""
    return torch.arange(key_len, device=starts.device)[None, None, :] - starts[:, None, None]


def tree_ancestor_mask(table: Tensor, depths: Tensor) -> Tensor:
    """m[r, i, j]: j is an ancestor of i or i itself, from an ancestor table [R, N, D+1].

    j is an ancestor-or-self of i iff i's ancestor at depth[j] is j (flashtree.tree.ancestor_mask
    computes the same; taking the table lets one table serve every lookup of a forward).
    """
    r, n = depths.shape
    at_depth_j = table.gather(2, depths[:, None, :].expand(r, n, n))
    return at_depth_j == torch.arange(n, device=depths.device)


def path_taps(table: Tensor, depths: Tensor, taps: int) -> Tensor:
    """idx[r, i, t]: the t-th of the `taps` path entries ending at node i, as a row of
    [committed entries (taps - 1) ++ window nodes (N)].

    Tap t is the node's ancestor at depth d_i - (taps-1) + t; depths before the window's first
    node fall back to the slot's committed entries (a GDN layer's conv window).
    """
    e = depths[..., None] - (taps - 1) + torch.arange(taps, device=table.device)
    node = table.gather(2, e.clamp(0, table.shape[2] - 1))
    return torch.where(e >= 0, taps - 1 + node, taps - 1 + e)


def block_mask(keys: Tensor, starts: Tensor, positions: Tensor, window: int | None) -> Tensor:
    """The drafter's [R, 1, L, S + L]: context keys before the block's start (within a sliding
    window), then all of the block (a DFlash block attends itself bidirectionally).

    keys [S] (or [R, S] for a ring) are the context positions the cache rows hold; negative = empty.
    """
    keys = keys if keys.dim() == 2 else keys[None]
    visible = (keys[:, None, :] < starts[:, None, None]) & (keys[:, None, :] >= 0)
    if window is not None:
        visible = visible & (positions[:, :, None] - keys[:, None, :] < window)
    else:
        visible = visible.expand(-1, positions.shape[1], -1)
    block = torch.ones(positions.shape[0], positions.shape[1], positions.shape[1], dtype=torch.bool, device=keys.device)
    return torch.cat([visible, block], dim=2)[:, None]
