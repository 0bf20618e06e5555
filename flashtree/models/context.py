"""What every layer of one forward shares, built once per forward by its caller (the runner).

A `SlotBatch` names the cache slots a round covers and their committed lengths, on the host
(for bookkeeping) and on the device (for kernels). A `ForwardContext` adds one forward's window:
where its K/V go, the tokens' positions, the attention mask, the tree (parents, depths, and the
ancestor table and mask, each built once here however many layers read them), and `windows`,
where recurrent layers leave what `commit` needs. Models only read a context (and fill
`windows`); they never change cache lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flashtree.models.mask import (additive, causal_window_mask, lower_right_causal, path_taps, tree_ancestor_mask,
                                   tree_window_mask)
from flashtree.models.tree_attention import TreeParts, lse_path, tree_parts
from flashtree.tree import TreeSpec, ancestor_table

if TYPE_CHECKING:
    from flashtree.cache import KVCache


@dataclass
class SlotBatch:
    """The slots one round covers, with each slot's committed length when the round began."""

    slot_list: list[int]
    start_list: list[int]
    slots: Tensor  # [R] int64 on the cache's device
    starts: Tensor  # [R] int64: committed length = the row (and position) the window starts at
    first: int | None = field(init=False)  # slots are first..first+R-1: cache reads slice in place
    uniform: bool = field(init=False)  # every slot starts at the same length

    def __post_init__(self) -> None:
        # Plain values, not properties over the lists: compiled code guards on them, not on the lists.
        s = self.slot_list
        self.first = s[0] if s and s == list(range(s[0], s[0] + len(s))) else None
        self.uniform = len(set(self.start_list)) <= 1

    @classmethod
    def captured(cls, slots: Tensor, starts: Tensor) -> SlotBatch:
        """A batch held in a captured round's static buffers: its kernels see only the tensors, so
        no host fact (consecutive slots, equal starts) may choose a code path."""
        batch = cls([], [], slots, starts)
        batch.first, batch.uniform = None, False
        return batch

    @classmethod
    def of(cls, cache: KVCache, slots: list[int]) -> SlotBatch:
        """From the cache's current lengths, uploaded with plain copies. Off the round's hot path
        (prefill, tests, benchmarks, training); the runner stages its rounds' copies itself."""
        starts = [cache.lengths[s] for s in slots]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=cache.device)  # noqa: E731
        return cls(list(slots), starts, as_tensor(slots), as_tensor(starts))

    @property
    def size(self) -> int:
        return self.slots.shape[0]

    @property
    def max_start(self) -> int:
        return max(self.start_list)


def _batch(cache: KVCache, batch: SlotBatch | list[int]) -> SlotBatch:
    return batch if isinstance(batch, SlotBatch) else SlotBatch.of(cache, batch)


@dataclass
class ForwardContext:
    """One forward's window of N nodes per slot, written after each slot's committed prefix."""

    cache: KVCache
    batch: SlotBatch
    positions: Tensor  # [R, N] token positions: start + depth
    rows: Tensor  # [R, N] cache rows the window's K/V go to: start + node index
    parents: Tensor  # [R, N] window node index of each node's parent (-1 for the first)
    depths: Tensor  # [R, N] depth in the window (0 for the first node)
    key_len: int  # cache rows every query spans (committed prefix + window, padded)
    attn_bias: Tensor | None  # [R, 1, N, key_len] additive (0 visible, -inf not), a CausalBias, or None: all visible
    is_chain: bool  # a causal chain: node i's parent is i - 1 (prefill, AR, DFlash, drafter blocks)
    keep_all: bool = False  # prefill: commit keeps the whole window
    causal: bool = False  # with attn_bias None: a causal window over exactly its keys from position 0 (is_causal)
    ancestors: Tensor | None = None  # [R, N, D+1] ancestor table of a tree (flashtree.tree.ancestor_table)
    tree_mask: Tensor | None = None  # [R, 1, N, N] ancestor-or-self of a tree
    taps: Tensor | None = None  # [R, N, cache.path_taps] rows of [committed taps ++ window] on each node's path
    tree_parts: TreeParts | None = None  # a tree attended as prefix + tree merged by LSE (then attn_bias is None)
    windows: dict[int, Any] = field(default_factory=dict)  # recurrent layer index -> its record for commit

    @property
    def slots(self) -> Tensor:
        return self.batch.slots

    @property
    def starts(self) -> Tensor:
        return self.batch.starts

    @property
    def num_nodes(self) -> int:
        return self.rows.shape[1]

    @classmethod
    def prefill(cls, cache: KVCache, batch: SlotBatch | list[int], n: int, key_len: int | None = None
                ) -> ForwardContext:
        """A causal window of n tokens that commit keeps whole (a prompt, or a chunk of one).

        key_len: keys to attend, at least max start + n (a bucket); None = exactly that.
        """
        batch = _batch(cache, batch)
        return cls._chain(cache, batch, n, key_len or batch.max_start + n, keep_all=True)

    @classmethod
    def verify(cls, cache: KVCache, batch: SlotBatch | list[int], tree: TreeSpec, key_len: int | None = None
               ) -> ForwardContext:
        """A draft tree (or chain) to verify: each node sees the prefix, its ancestors and itself."""
        batch = _batch(cache, batch)
        n = tree.num_nodes
        key_len = key_len or batch.max_start + n
        if tree.is_chain:
            return cls._chain(cache, batch, n, key_len)
        table = ancestor_table(tree)
        anc = tree_ancestor_mask(table, tree.depths)
        taps = path_taps(table, tree.depths, cache.path_taps) if cache.path_taps else None
        rows = batch.starts[:, None] + torch.arange(n, device=batch.starts.device)
        # A captured round knows only its key bucket on the host: its prefix part spans key_len - n rows.
        prefix = batch.max_start if batch.start_list else key_len - n
        parts, bias = None, None
        if lse_path(batch.starts.device, prefix, cache.dtype):
            parts = tree_parts(batch.starts, batch.start_list, anc, key_len, cache.dtype)
        else:
            bias = additive(tree_window_mask(batch.starts, anc, key_len), cache.dtype)
        return cls(cache, batch, positions=batch.starts[:, None] + tree.depths, rows=rows, parents=tree.parents,
                   depths=tree.depths, key_len=key_len, attn_bias=bias, is_chain=False, ancestors=table,
                   tree_mask=anc[:, None], taps=taps, tree_parts=parts)

    @classmethod
    def block(cls, cache: KVCache, batch: SlotBatch | list[int], n: int, key_len: int | None = None
              ) -> ForwardContext:
        """n drafter rows after each slot's context: a block to draft (it attends the context's
        first key_len rows, default max start, and masks itself) or new features to append."""
        batch = _batch(cache, batch)
        return cls._chain(cache, batch, n, key_len or batch.max_start, with_mask=False)

    @classmethod
    def _chain(cls, cache: KVCache, batch: SlotBatch, n: int, key_len: int, keep_all: bool = False,
               with_mask: bool = True) -> ForwardContext:
        idx = torch.arange(n, device=batch.starts.device)
        rows = batch.starts[:, None] + idx
        r = batch.size
        bias, causal = None, False
        exact = batch.uniform and key_len == batch.max_start + n  # every row's keys are its prefix + window
        if with_mask and exact and n > 1 and key_len == n:
            causal = True  # SDPA's own causal mask: the flash kernel, on every device
        elif with_mask and not (exact and n == 1):  # a one-token window over exactly its keys sees them all
            bias = lower_right_causal(n, key_len, batch.starts.device) if exact else None
            if bias is None:
                bias = additive(causal_window_mask(batch.starts, n, key_len), cache.dtype)
        return cls(cache, batch, positions=rows, rows=rows, parents=(idx - 1).expand(r, n), depths=idx.expand(r, n),
                   key_len=key_len, attn_bias=bias, causal=causal, is_chain=True, keep_all=keep_all)
