"""Attention masks for a window written after each slot's committed prefix."""

from __future__ import annotations

import torch
from torch import Tensor

from flashtree.cache import CacheView
from flashtree.tree import TreeSpec, ancestor_mask


def window_mask(view: CacheView, tree: TreeSpec | None, n: int) -> Tensor:
    """Boolean mask [R, 1, n, max_start + n]: committed keys plus the node's ancestors and itself.

    `tree=None` means a causal chain (prefill, AR, DFlash); the window occupies cache rows
    start .. start+n-1 of each slot.
    """
    device = view.starts.device
    keys = torch.arange(view.max_start + n, device=device)
    rel = keys[None, None, :] - view.starts[:, None, None]  # [R, 1, S]
    if tree is None or tree.is_chain:
        window = (rel >= 0) & (rel <= torch.arange(n, device=device)[None, :, None])
        return ((rel < 0) | window)[:, None]
    anc = ancestor_mask(tree)  # [R, n, n]
    inside = (rel >= 0) & (rel < n)
    picked = anc.gather(2, rel.clamp(0, n - 1).expand(-1, n, -1))
    return ((rel < 0) | (picked & inside))[:, None]
