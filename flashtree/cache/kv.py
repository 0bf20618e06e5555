"""Engine-owned KV cache: preallocated slots, a window appended per forward, compaction on commit.

One slot per running request. A forward writes its whole window (all tree nodes) right after
the slot's committed prefix; `commit` then moves the accepted nodes to the front of the window
and advances the committed length. Nothing past the committed length is ever read unmasked,
so rejected nodes need no clearing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flashtree.errors import FlashtreeError

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext


class KVCache:
    """K/V for every attention layer: [layers, slots, max_len, kv_heads, head_dim].

    Committed lengths live on the host and have one owner: `commit` (and `set_length`, which
    the runner calls to start a slot afresh). Models never touch them, and since they are host
    ints, building masks and contexts never waits on the device.
    """

    path_taps = 0  # per-node ancestor taps the layers need (a hybrid cache's conv kernel)

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
        self.layer_index = torch.arange(num_layers, device=device)
        self.lengths = [0] * num_slots
        self.max_len = max_len
        self.device = torch.device(device)
        self.dtype = dtype

    def write(self, layer: int, ctx: ForwardContext, k: Tensor, v: Tensor) -> None:
        """Store the window's k/v [R, N, Hkv, D] at rows ctx.rows [R, N] of ctx's slots."""
        index = (self.layer_index[layer], ctx.slots[:, None], ctx.rows)
        # index_put_ on the whole buffer, not on a k[layer] view: compiled, a write through a view
        # of the cache becomes a copy of all of it.
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)

    def read(self, layer: int, ctx: ForwardContext, rows: int | None = None) -> tuple[Tensor, Tensor]:
        """K/V of the first `rows` rows of each slot (default ctx.key_len), as [R, Hkv, rows, D]; a
        tree's prefix part reads only the committed rows."""
        k, v = self.k[layer], self.v[layer]
        n = ctx.key_len if rows is None else rows
        first = ctx.batch.first
        if first is not None:  # consecutive slots: a view, read in place
            r = ctx.batch.size
            k, v = k[first : first + r, :n], v[first : first + r, :n]
        else:
            k, v = k[ctx.slots, :n], v[ctx.slots, :n]
        return k.transpose(1, 2), v.transpose(1, 2)

    def commit(self, ctx: ForwardContext, counts: list[int], path: Tensor | None = None,
               num_nodes: Tensor | None = None) -> None:
        """Keep counts[r] nodes of ctx's window per slot and advance its length to start + count.

        path [R, A] (the accept walk's, root first, -1 past the count) names the kept nodes of a
        tree window; without it, or for a chain, the kept nodes are the window's first counts[r],
        already in place. num_nodes is counts on the device (a hybrid cache needs it). Rows past
        len(counts) (padding of a batch bucket) are dropped.
        """
        self.compact(ctx, path, num_nodes, len(counts))
        self.advance(ctx.batch, counts)

    def compact(self, ctx: ForwardContext, path: Tensor | None, num_nodes: Tensor | None, rows: int | None = None
                ) -> None:
        """commit's device half, no host read: move the kept nodes of the first `rows` rows (None:
        all of them, as a captured round does; its padding rows sit on a dummy slot)."""
        if path is None or ctx.is_chain:
            return
        starts, slots, path = ctx.starts[:rows, None], ctx.slots[:rows, None], path[:rows]
        steps = torch.arange(path.shape[1], device=path.device)
        src = torch.where(path >= 0, path, steps) + starts
        dst = steps + starts
        slots = slots.expand_as(src)
        # Gather first (a copy), then scatter: safe because path[j] >= j.
        self.k[:, slots, dst] = self.k[:, slots, src]
        self.v[:, slots, dst] = self.v[:, slots, src]

    def advance(self, batch, counts: list[int]) -> None:
        """commit's host half: each slot's committed length becomes its start + count."""
        for slot, start, n in zip(batch.slot_list, batch.start_list, counts):
            self.lengths[slot] = start + n

    def set_length(self, slot: int, length: int) -> None:
        """Declare a slot's committed length: 0 starts it afresh; benchmarks fake a context."""
        self.lengths[slot] = length

    # ---- sharing a prefix between slots (prefix reuse, n > 1 samples of one prompt) ----------

    shares_prefixes = True  # any committed prefix of a slot can seed another (copy_prefix)
    recurrent = False  # True: a prefix shorter than the slot also needs a saved recurrent state

    def copy_prefix(self, src: int, dst: int, length: int, state=None) -> None:
        """Make dst hold src's first `length` committed rows, committed: a prompt prefix computed
        once. Rows < length of a slot never change while it lives (commits write past its
        length), so they stay valid until the slot is given to another request. src == dst
        just truncates. `state` is for caches with recurrent layers (see HybridCache)."""
        if length > self.lengths[src]:
            raise FlashtreeError(f"slot {src} holds {self.lengths[src]} rows, not {length}")
        if src != dst:
            self.k[:, dst, :length] = self.k[:, src, :length]
            self.v[:, dst, :length] = self.v[:, src, :length]
        self.lengths[dst] = length
