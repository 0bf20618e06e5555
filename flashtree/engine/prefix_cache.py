"""Prefix reuse: a prompt that starts with tokens a cache slot already holds skips their prefill.

The slots are the store. A slot's first rows never change while its request lives (commits write
past its length) and stay valid after it finishes, until the slot is given to another request.
So a new prompt is matched, token by token, against the prompt each slot holds (its longest
common prefix), and the match is copied into the new slot: the target's K/V and the drafter's
context K/V, both functions of the prefix tokens alone (nothing is copied when the new slot
itself holds the match). Free slots are given away least recently used first, so what stays
cached is what was used last, and the memory is the slots' own: nothing beyond them is kept,
except recurrent states.

A hybrid target's recurrent layers cannot be rewound: a slot's state is the one after all its
tokens. There, reuse also needs the state at the prefix's end, saved while a prefill passed that
point. States are saved at block-aligned points (PREFIX_BLOCK tokens) where a prompt's match
against the slots (its K/V) goes past the longest saved state: the prefill stops a chunk there
and saves the state. So the second request with a new shared prefix (a system prompt) saves
it, and later ones reuse it. At most MAX_STATES states are kept, least recently used evicted.

Requests that ask for prompt logprobs need every prompt position's logits, so they reuse nothing.
A drafter with sliding-window layers keeps only a ring of recent context, which a longer slot has
overwritten past the prefix; with such a drafter nothing is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

PREFIX_BLOCK = 16  # recurrent states are saved at multiples of this many tokens
MAX_STATES = 16  # recurrent states kept (each is every GDN layer's state and conv window for one slot)


@dataclass
class PrefixMatch:
    source: int  # slot holding the prefix's K/V (may be the request's own slot)
    length: int  # tokens reused
    state: int | None  # hybrid targets: the key of the recurrent state after them (the runner keeps it)
    save_at: int | None  # hybrid: prefill should stop a chunk here and save the state


class PrefixCache:
    """What each slot's first rows hold, and (hybrid targets) the saved recurrent states."""

    def __init__(self, num_slots: int, recurrent: bool) -> None:
        self.recurrent = recurrent
        self.tokens: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(num_slots)]
        self.held = [0] * num_slots  # rows [0, held) of the slot hold K/V of tokens[:held]
        self.last_used = [0] * num_slots  # LRU clock per slot
        self.clock = 0
        self.states: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix tokens -> state key

    # ---- seating ------------------------------------------------------------------------------

    def choose_slot(self, free: list[int]) -> int:
        """The least recently used free slot: what it holds is the least likely to be asked for."""
        return min(free, key=lambda s: self.last_used[s])

    def match(self, prompt: list[int], slot: int) -> PrefixMatch | None:
        """The longest reusable prefix for a prompt about to fill `slot`; None when none is.
        At least the prompt's last token is left to compute (its logits give the first token)."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = len(prompt) - 1
        common = [min(self._common(ids, s), limit) for s in range(len(self.held))]
        kv = max(common)
        if kv == 0:
            return None
        # Prefer the request's own slot (no copy), then any slot with the longest match.
        source = slot if common[slot] == kv else common.index(kv)
        if not self.recurrent:
            return PrefixMatch(source, kv, None, None)
        length, state = 0, None
        for key in {len(k) for k in self.states if len(k) <= kv}:
            prefix = tuple(prompt[:key])
            if key > length and prefix in self.states:
                length, state = key, self.states[prefix]
                self.states.move_to_end(prefix)
        aligned = kv // PREFIX_BLOCK * PREFIX_BLOCK
        save_at = aligned if aligned > length else None
        if length == 0:
            return PrefixMatch(source, 0, None, save_at) if save_at else None
        source = slot if common[slot] >= length else next(s for s, c in enumerate(common) if c >= length)
        return PrefixMatch(source, length, state, save_at)

    def _common(self, ids: np.ndarray, slot: int) -> int:
        held = self.tokens[slot][: min(self.held[slot], len(ids))]
        differ = np.flatnonzero(held != ids[: len(held)])
        return int(differ[0]) if len(differ) else len(held)

    # ---- what the slots hold ------------------------------------------------------------------

    def assign(self, slot: int, prompt: list[int], held: int) -> None:
        """`slot` now serves `prompt`, of which the first `held` tokens' K/V are in place."""
        self.tokens[slot] = np.asarray(prompt, dtype=np.int64)
        self.held[slot] = held
        self.touch(slot)

    def extend(self, slot: int, held: int) -> None:
        """A prefill chunk committed: the slot now holds `held` prompt tokens."""
        self.held[slot] = held

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_used[slot] = self.clock

    def save_state(self, prefix: list[int], key: int) -> list[int]:
        """Record that the recurrent state after `prefix` is kept under `key` (the runner keeps
        it); returns the keys of states evicted to stay within MAX_STATES, for the runner to drop."""
        self.states[tuple(prefix)] = key
        self.states.move_to_end(tuple(prefix))
        evicted = []
        while len(self.states) > MAX_STATES:
            evicted.append(self.states.popitem(last=False)[1])
        return evicted
