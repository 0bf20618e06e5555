"""The cache of a hybrid (Gated DeltaNet + attention) target: attention K/V plus, per GDN layer and
slot, the recurrent state and the conv window.

A forward never changes these: each GDN layer leaves a record in its ForwardContext (see
flashtree.models.gated_deltanet) and `commit` moves every layer at once to the state after each
slot's last kept node. The delta-rule math lives model-side (flashtree.models.delta_rule); this
cache imports it, and nothing here knows a module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flashtree.cache.kv import KVCache
from flashtree.errors import FlashtreeError
from flashtree.models.delta_rule import DeltaWindow, WindowEnd, advance_state

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext


@dataclass
class RecurrentState:
    """Every GDN layer's state and conv window after a slot's first `length` tokens."""

    length: int
    state: Tensor  # [G, H, dk, dv]
    conv: Tensor  # [G, K-1, C]


class HybridCache(KVCache):
    """K/V for the attention layers (the parent KVCache); per GDN layer and slot the recurrent
    state [H, dk, dv] (at least float32, whatever the model dtype) and the conv window [K-1, C]."""

    def __init__(self, attention_layers: int, gdn_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, conv: tuple[int, int], state: tuple[int, int, int], dtype: torch.dtype,
                 device) -> None:
        super().__init__(attention_layers, num_slots, max_len, num_kv_heads, head_dim, dtype, device)
        self.conv = torch.zeros(gdn_layers, num_slots, *conv, dtype=dtype, device=device)
        self.state = torch.zeros(gdn_layers, num_slots, *state, dtype=torch.promote_types(dtype, torch.float32),
                                 device=device)
        self.path_taps = conv[0] + 1  # a tree node's conv reads the K inputs on its path

    def set_length(self, slot: int, length: int) -> None:
        """0 starts the slot afresh. A recurrence cannot be rewound, so a shorter length than the
        state holds is refused; a longer one (a benchmark that fakes a context's K/V) is taken as is."""
        if length == 0:
            self.conv[:, slot] = 0
            self.state[:, slot] = 0
        elif length < self.lengths[slot]:
            raise FlashtreeError(
                f"cannot set slot {slot} of a hybrid cache to length {length}: its recurrent state holds "
                f"{self.lengths[slot]} tokens, and a recurrence cannot be rewound"
            )
        super().set_length(slot, length)

    recurrent = True  # a prefix shorter than the slot also needs the recurrent state at its end

    def recurrent_state(self, layer: int, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """GDN layer `layer`'s committed conv window [R, K-1, C] and state [R, H, dk, dv] for ctx's
        slots: views when the slots are consecutive, else gathered."""
        first = ctx.batch.first
        if first is not None:
            rows = slice(first, first + ctx.batch.size)
            return self.conv[layer, rows], self.state[layer, rows]
        return self.conv[layer, ctx.slots], self.state[layer, ctx.slots]

    def save_state(self, slot: int) -> RecurrentState:
        """A copy of the slot's recurrent state and conv windows, at its committed length."""
        return RecurrentState(self.lengths[slot], self.state[:, slot].clone(), self.conv[:, slot].clone())

    def copy_prefix(self, src: int, dst: int, length: int, state: RecurrentState | None = None) -> None:
        """The attention K/V of src's first `length` rows, and the recurrent layers at `length`:
        src's own state when it holds exactly `length` tokens, else `state` saved at that length."""
        if state is None and length != self.lengths[src]:
            raise FlashtreeError(f"slot {src} holds {self.lengths[src]} tokens: its recurrent state is not the one "
                                 f"after {length}; pass the state saved there")
        if state is not None and state.length != length:
            raise FlashtreeError(f"a recurrent state saved after {state.length} tokens cannot start a slot at {length}")
        super().copy_prefix(src, dst, length)
        if state is not None:
            self.state[:, dst], self.conv[:, dst] = state.state, state.conv
        elif src != dst:
            self.state[:, dst], self.conv[:, dst] = self.state[:, src], self.conv[:, src]

    def commit(self, ctx: ForwardContext, counts: list[int], path: Tensor | None = None,
               num_nodes: Tensor | None = None) -> None:
        if path is None and not ctx.keep_all:  # a chain kept by counts alone (off the hot path: host counts)
            num_nodes = torch.tensor(counts, device=ctx.slots.device)
            path = torch.arange(ctx.num_nodes, device=ctx.slots.device).expand(len(counts), -1)
            path = path.masked_fill(path >= num_nodes[:, None], -1)
        super().commit(ctx, counts, path, num_nodes)

    def compact(self, ctx: ForwardContext, path: Tensor | None, num_nodes: Tensor | None, rows: int | None = None
                ) -> None:
        """Keep the accepted path's K/V, and move every GDN layer's state and conv window to the
        path's last node: one gather and one advance over all layers stacked.

        path [R, A] holds window node indices, root first, -1 past num_nodes [R] (both on the
        device, from the accept walk): exactly the nodes on the last node's path, so no ancestor
        lookups. A kept window (prefill) just takes each layer's WindowEnd. Rows past `rows` pad a
        batch bucket: their state stays out of the cache (None: every row, as a captured round
        does; its padding rows sit on a dummy slot).
        """
        super().compact(ctx, path, num_nodes, rows)
        records = [ctx.windows[i] for i in range(self.state.shape[0])]
        r = rows if rows is not None else ctx.batch.size
        slots = ctx.slots[:r]
        if ctx.keep_all:
            if not all(isinstance(w, WindowEnd) for w in records):
                raise FlashtreeError("commit of a kept window got records of a verify window")
            self.state[:, slots] = torch.stack([w.state[:r] for w in records])
            self.conv[:, slots] = torch.stack([w.conv[:r] for w in records])
            return
        if not all(isinstance(w, DeltaWindow) for w in records):
            raise FlashtreeError("commit of a verify window got records of a kept window")
        node, num_nodes = path[:r].clamp(min=0), num_nodes[:r]  # [R, A], [R]
        a = node.shape[1]
        keys = torch.stack([w.keys[:r] for w in records])  # [G, R, H, N, dk]
        deltas = torch.stack([w.deltas[:r] for w in records])  # [G, R, H, N, dv]
        decay = torch.stack([w.decay[:r] for w in records])  # [G, R, H, N]
        inputs = torch.stack([w.inputs[:r] for w in records])  # [G, R, N, C]
        g, r, h = decay.shape[:3]
        idx = node[None, :, None, :].expand(g, r, h, a)
        path_decay = decay.gather(3, idx)  # [G, R, H, A]
        last = path_decay.gather(3, (num_nodes - 1).view(1, r, 1, 1).expand(g, r, h, 1))[..., 0]
        on_path = (torch.arange(a, device=node.device) < num_nodes[:, None]).to(decay.dtype)[:, None]  # [R, 1, A]
        self.state[:, slots] = advance_state(
            self.state[:, slots], keys.gather(3, idx[..., None].expand(-1, -1, -1, -1, keys.shape[-1])),
            deltas.gather(3, idx[..., None].expand(-1, -1, -1, -1, deltas.shape[-1])), path_decay, last, on_path)
        # Conv window after the last node: the last K-1 inputs of [old window ++ path inputs].
        k1 = self.conv.shape[2]
        seq = torch.cat([self.conv[:, slots], inputs.gather(2, node[None, :, :, None].expand(g, -1, -1, inputs.shape[-1]))],
                        dim=2)  # [G, R, K-1+A, C]
        take = num_nodes[:, None] + torch.arange(k1, device=node.device)  # [R, K-1]
        self.conv[:, slots] = seq.gather(2, take[None, :, :, None].expand(g, -1, -1, seq.shape[-1]))
