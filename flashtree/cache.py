"""Engine-owned KV cache: preallocated slots, a window appended per round, compaction on commit.

One slot per running request. A round writes its whole window (all tree nodes) right after
the slot's committed prefix; `commit` then moves the accepted nodes to the front of the window
and advances the committed length. Nothing past the committed length is ever read unmasked,
so rejected nodes need no clearing.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """K/V for every attention layer: [layers, slots, max_len, kv_heads, head_dim].

    Committed lengths live on the host: the engine learns them from its one sync per round,
    and keeping them there means building masks and views never waits on the device.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_slots
        self.max_len = max_len
        self.device = torch.device(device)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def view(self, slots: list[int]) -> CacheView:
        return CacheView(self, slots, [self.lengths[s] for s in slots])

    def write(self, layer: int, view: CacheView, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k/v [R, N, Hkv, D] at cache rows `positions` [R, N] of the view's slots."""
        rows = view.slots[:, None].expand_as(positions)
        self.k[layer, rows, positions] = k
        self.v[layer, rows, positions] = v

    def read(self, layer: int, view: CacheView, length: int) -> tuple[Tensor, Tensor]:
        """K/V of the first `length` rows of each slot, as [R, Hkv, length, D]."""
        k, v = self.k[layer], self.v[layer]
        if view.contiguous:
            n = view.size
            k, v = k[:n, :length], v[:n, :length]
        else:
            k, v = k[view.slots, :length], v[view.slots, :length]
        return k.transpose(1, 2), v.transpose(1, 2)

    def commit(self, view: CacheView, path: Tensor, num_nodes: list[int], chain: bool = False) -> None:
        """Keep the accepted nodes of the view's last window and advance each slot's length.

        path [R, A] holds window-relative node indices of the accepted path (root first,
        -1 past num_nodes). In a chain the accepted path is already a prefix of the window,
        so only the lengths move.
        """
        if not chain:
            steps = torch.arange(path.shape[1], device=path.device)
            src = torch.where(path >= 0, path, steps) + view.starts[:, None]
            dst = steps + view.starts[:, None]
            rows = view.slots[:, None].expand_as(src)
            # Gather first (a copy), then scatter: safe because path[j] >= j.
            self.k[:, rows, dst] = self.k[:, rows, src]
            self.v[:, rows, dst] = self.v[:, rows, src]
        for slot, start, n in zip(view.slot_list, view.start_list, num_nodes):
            self.lengths[slot] = start + n

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length


class CacheView:
    """The slots one forward pass covers, with their committed lengths at that moment."""

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int]) -> None:
        self.cache = cache
        self.slot_list = list(slots)
        self.start_list = list(starts)
        self.slots = torch.tensor(slots, dtype=torch.long, device=cache.device)
        self.starts = torch.tensor(starts, dtype=torch.long, device=cache.device)
        self.contiguous = self.slot_list == list(range(len(slots)))

    @property
    def size(self) -> int:
        return len(self.slot_list)

    @property
    def max_start(self) -> int:
        return max(self.start_list)
