"""The drafter's context cache when some of its layers attend a sliding window: those layers keep a
ring of window + block entries, so their memory does not grow with the context."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flashtree.cache.kv import KVCache
from flashtree.errors import FlashtreeError

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext


class SlidingDraftCache(KVCache):
    """Drafter context cache whose sliding-window layers keep only a ring of the last `ring_len`
    (= window + block) entries; full-attention layers keep every position in the parent KVCache.

    Row p % ring_len holds position p. A round appends at most a block of entries (accepted ones
    first, then padding past the count), so the window - 1 positions the next block can see are
    never overwritten, and rows holding anything else fall outside the window mask.
    """

    def __init__(self, windows: list[int | None], num_slots: int, max_len: int, ring_len: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype, device) -> None:
        """windows[layer]: that layer's sliding window, or None for full attention."""
        self.ring_layers = [i for i, w in enumerate(windows) if w is not None]
        self.full_layers = [i for i, w in enumerate(windows) if w is None]
        full_len = max_len if self.full_layers else 0  # all layers sliding: nothing grows with context
        super().__init__(len(self.full_layers), num_slots, full_len, num_kv_heads, head_dim, dtype, device)
        self.max_len = max_len
        self.ring_len = ring_len
        self.block_size = block_size
        shape = (len(self.ring_layers), num_slots, ring_len, num_kv_heads, head_dim)
        self.ring_k = torch.zeros(shape, dtype=dtype, device=device)
        self.ring_v = torch.zeros(shape, dtype=dtype, device=device)

    def in_ring(self, layer: int) -> bool:
        return layer in self.ring_layers

    def write(self, layer: int, ctx: ForwardContext, k: Tensor, v: Tensor) -> None:
        if not self.in_ring(layer):
            return super().write(self.full_layers.index(layer), ctx, k, v)
        positions = ctx.rows
        if positions.shape[1] > self.ring_len:  # a long prefill: only its last ring_len entries matter
            positions, k, v = positions[:, -self.ring_len:], k[:, -self.ring_len:], v[:, -self.ring_len:]
        j = self.ring_layers.index(layer)
        rows = ctx.slots[:, None].expand_as(positions)
        self.ring_k[j, rows, positions % self.ring_len] = k
        self.ring_v[j, rows, positions % self.ring_len] = v

    def read(self, layer: int, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """Full layers: the first ctx.key_len rows. Ring layers: the whole ring (see ring_positions)."""
        if not self.in_ring(layer):
            return super().read(self.full_layers.index(layer), ctx)
        j = self.ring_layers.index(layer)
        k, v = self.ring_k[j, ctx.slots], self.ring_v[j, ctx.slots]
        return k.transpose(1, 2), v.transpose(1, 2)

    def ring_positions(self, ctx: ForwardContext) -> Tensor:
        """[R, ring_len]: the latest committed position each ring row holds (negative = none yet)."""
        t = torch.arange(self.ring_len, device=ctx.starts.device)
        last = ctx.starts[:, None] - 1
        return t + self.ring_len * torch.div(last - t, self.ring_len, rounding_mode="floor")

    shares_prefixes = False  # the ring of a longer slot no longer holds the positions before a prefix's end

    def copy_prefix(self, src: int, dst: int, length: int, state=None) -> None:
        """Only a slot's whole context (n > 1 samples right after their shared prefill): the
        ring then holds exactly what the next block may see."""
        if length != self.lengths[src]:
            raise FlashtreeError(f"sliding drafter cache: can copy slot {src}'s whole context ({self.lengths[src]} "
                                 f"rows), not a prefix of {length}")
        super().copy_prefix(src, dst, length)
        if src != dst:
            self.ring_k[:, dst], self.ring_v[:, dst] = self.ring_k[:, src], self.ring_v[:, src]

    def commit(self, ctx: ForwardContext, counts: list[int], path: Tensor | None = None,
               num_nodes: Tensor | None = None) -> None:
        """Refuses an append whose padding could overwrite positions the next block still sees."""
        n = ctx.num_nodes
        if n - min(counts) > self.block_size or (n > self.ring_len and min(counts) < n):
            raise FlashtreeError(f"sliding drafter cache: cannot append {n} entries of which only {min(counts)} "
                                 f"are kept (ring of {self.ring_len})")
        super().commit(ctx, counts, path, num_nodes)
