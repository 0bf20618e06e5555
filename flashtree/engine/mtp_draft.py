"""MTP drafting: the head applied recursively k times a round, over its own small K/V cache.

Entry i of a slot's head cache is the head's K/V for (h_i, x_{i+1}): the target's normed final
hidden state at position i and the token after it. While the target has n tokens committed, the
head has c <= n entries: the hidden states and tokens of positions c..n-1 wait in per-slot row
stores until the token after each is known. A round's first step computes those pending entries
in one causal window, the last one paired with the round's root (the bonus token), and its output
there drafts d_1. Step j >= 2 feeds the previous step's own output and draft at the next position
and drafts d_j (the recursion vLLM and SGLang run for Qwen3.5/3.6). The target verifies
[root, d_1..d_k] as a chain, through the same walk and sampler as every other method. Only the
first step's entries are committed; the later steps' K/V sit past the committed length and are
overwritten. After the walk, the accepted nodes' hidden states and tokens are stored: they are
the next round's pending entries.

The row stores keep every committed position, not just the pending ones, so prefix reuse can
seat a slot with another's first `length` positions: entries 0..length-2 and the hidden state at
length-1 that the rest of the prompt's first entry reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.models.mtp import MTPHead
from flashtree.tree import TreeSpec, chain_spec


class MTPDraft:
    """The head, its K/V cache (lengths: committed entries), the per-slot row stores, and per slot
    the positions waiting to become entries (on the host for shapes, on the device for indexing,
    so a round uploads nothing: the counts come from the walk)."""

    def __init__(self, head: MTPHead, target, k: int, num_slots: int, max_len: int, device: torch.device) -> None:
        self.head, self.target, self.k = head, target, k
        self.cache = head.new_cache(num_slots, max_len)
        dtype = target.embed_tokens.weight.dtype
        self.hidden = torch.zeros(num_slots, max_len, target.args.hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(num_slots, max_len, dtype=torch.long, device=device)
        self.waiting = [0] * num_slots
        self.pending = torch.ones(num_slots, dtype=torch.long, device=device)  # a padding row's slot waits on 1
        self.feature_layers = (target.num_layers - 1,)  # the target's last block: its final hidden state, unnormed

    def seat(self, slot: int, source: int | None, length: int) -> None:
        """Start a slot empty, or holding source's first `length` positions (a shared prefix)."""
        if source is None or length == 0:
            self.cache.set_length(slot, 0)
            self.wait(slot, 0)
            return
        self.cache.copy_prefix(source, slot, length - 1)  # entry length-1 needs the token after the prefix
        self.wait(slot, 1)
        if source != slot:
            self.hidden[slot, :length] = self.hidden[source, :length]
            self.tokens[slot, :length] = self.tokens[source, :length]

    def store(self, batch: SlotBatch, tokens: Tensor, features: Tensor) -> None:
        """Keep tokens [R, N] and the target's hidden states at rows start.. of each slot
        (features [R, N, d]: the last block's output, normed here as the target's head sees it)."""
        rows = batch.starts[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        index = (batch.slots[:, None], rows)
        self.hidden.index_put_(index, self.target.norm(features))
        self.tokens.index_put_(index, tokens)

    def prefill(self, batch: SlotBatch, ids: Tensor, features: Tensor) -> None:
        """A prompt chunk of one slot committed to the target: store it, and compute every entry
        whose next token is known now (all but the chunk's last position)."""
        self.store(batch, ids, features)
        slot = batch.slot_list[0]
        c, end = self.cache.lengths[slot], batch.start_list[0] + ids.shape[1]
        m = end - 1 - c
        self.wait(slot, 1)
        if m <= 0:
            return
        ctx = ForwardContext.prefill(self.cache, SlotBatch.of(self.cache, [slot]), m)
        embeds = self.target.embed_tokens(self.tokens[slot, c + 1 : end][None])
        self.head(embeds, self.hidden[slot, c : end - 1][None], ctx)
        self.cache.commit(ctx, [m])

    def wait(self, slot: int, n: int) -> None:
        """The slot's last n committed positions wait to become entries (outside the round)."""
        self.waiting[slot] = n
        self.pending[slot] = max(n, 1)

    def draft(self, batch: SlotBatch, roots: Tensor, key_len: int | None = None) -> TreeSpec:
        """The chain [root, d_1..d_k] per row (batch.starts: the target's committed lengths).

        key_len: a captured round's key bucket. Such a round knows no host lengths, so its first
        step spans k + 1 entries, the most a row can have pending: a row's entries past its own
        are written past its committed length and overwritten by the next steps before any reads them.
        """
        static = key_len is not None
        width = self.k + 1 if static else max(self.waiting[s] for s in batch.slot_list)
        p = self.pending.index_select(0, batch.slots)
        c = (batch.starts - p).clamp(min=0)  # = committed (a padding row's slot holds nothing)
        rows = c[:, None] + torch.arange(width, device=roots.device)
        slots = batch.slots[:, None]
        last = (p - 1)[:, None]
        tokens = self.tokens[slots, rows + 1].scatter(1, last, roots[:, None])
        committed = [self.cache.lengths[s] for s in batch.slot_list]
        ctx = ForwardContext.prefill(self.cache, self.at(batch, c, committed), width, key_len)
        out = self.head(self.target.embed_tokens(tokens), self.hidden[slots, rows], ctx)
        hidden = out.gather(1, last[..., None].expand(-1, -1, out.shape[-1]))
        drafts = [self.target.lm_head(hidden).argmax(-1)]
        for j in range(1, self.k):  # step j + 1 sits at position n + j - 1, after the previous step
            at = self.at(batch, batch.starts + j - 1, [n + j - 1 for n in batch.start_list])
            ctx = ForwardContext.prefill(self.cache, at, 1, key_len)
            hidden = self.head(self.target.embed_tokens(drafts[-1]), hidden, ctx)
            drafts.append(self.target.lm_head(hidden).argmax(-1))
        return chain_spec(torch.cat([roots[:, None]] + drafts, dim=1))

    @staticmethod
    def at(batch: SlotBatch, starts: Tensor, host_starts: list[int]) -> SlotBatch:
        """The head's batch starting at `starts` (host_starts on the host); a captured round's batch
        has no host lists, so its head batches are the tensors alone."""
        if not batch.slot_list:
            return SlotBatch.captured(batch.slots, starts)
        return SlotBatch(batch.slot_list, host_starts, batch.slots, starts)

    def accept(self, batch: SlotBatch, spec: TreeSpec, path: Tensor, features: Tensor, counts: list[int]) -> None:
        """After the walk: keep() the accepted nodes, then advance() the host's lengths."""
        self.keep(batch, spec, path, features, len(counts))
        self.advance(batch, counts)

    def keep(self, batch: SlotBatch, spec: TreeSpec, path: Tensor, features: Tensor, real: int | None = None) -> None:
        """The device half of a round's commit: the accepted nodes (path [R, A], -1 past the count)
        are stored and wait as the next round's pending entries. Rows past `real` pad the batch
        (a captured round keeps every row: its padding rows sit on the dummy slot)."""
        nodes = path.clamp(min=0)
        feats = features.gather(1, nodes[..., None].expand(-1, -1, features.shape[-1]))
        self.store(batch, spec.tokens.gather(1, nodes), feats)
        self.pending.index_copy_(0, batch.slots[:real], (path[:real] >= 0).sum(1))

    def advance(self, batch: SlotBatch, counts: list[int]) -> None:
        """The host half: the first step's entries are committed (the head now holds an entry for
        every position the target held), and each slot waits on its accepted count."""
        for slot, n, count in zip(batch.slot_list, batch.start_list, counts):
            self.cache.set_length(slot, n)
            self.waiting[slot] = count
