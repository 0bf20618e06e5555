"""The drafter's context for requests that are not drafting: held back, then appended at once.

A request the policy keeps on plain AR steps still commits tokens, and the drafter must see their
target features before it drafts for that request again. Appending one token's features a round
(the drafter's fc + K/V projections for every layer) would cost a few percent of an AR step on a
small target, for nothing until the request drafts. So the features of each committed token are
parked in a per-slot ring (one write on the device), and the buffered run is appended in one
drafter call when the request drafts again or when the ring fills. The drafter's committed
length then lags the target's by the held-back count, and catches up before any draft reads it.

The ring is indexed by position (position p of a slot lives at p % capacity), so parking is one
indexed copy at rows the host knows from the cache lengths (uploaded with the round's inputs),
with no counter on the device to keep.
"""

from __future__ import annotations

import torch
from torch import Tensor

CAPACITY = 64  # tokens a slot may hold back


class DeferredContext:
    def __init__(self, slots: int, features: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.buffer = torch.zeros(slots, capacity, features, dtype=dtype, device=device)
        self.flat = self.buffer.view(slots * capacity, features)
        self.offsets = torch.arange(capacity, device=device)
        # Held-back tokens per slot (the runner plans with it): the positions from the drafter's
        # committed length on.
        self.counts = [0] * slots

    def reset(self, slot: int) -> None:
        self.counts[slot] = 0

    def emptied(self, slots: list[int]) -> None:
        """These slots' held-back tokens were appended."""
        for s in slots:
            self.counts[s] = 0

    def due(self, drafting: list[int], idle: list[int]) -> list[int]:
        """Slots to append now: drafting ones holding anything, idle ones whose ring is full."""
        return [s for s in drafting if self.counts[s]] + [s for s in idle if self.counts[s] >= self.capacity]

    def groups(self, slots: list[int]) -> dict[int, list[int]]:
        """Slots by held-back count: each group is one drafter call of that many rows."""
        out: dict[int, list[int]] = {}
        for s in slots:
            out.setdefault(self.counts[s], []).append(s)
        return out

    def rows(self, slots: list[int], positions: list[int]) -> list[int]:
        """The ring rows (of `flat`) that hold these slots' tokens at these positions."""
        c = self.capacity
        return [s * c + p % c for s, p in zip(slots, positions)]

    def park(self, slot_list: list[int], rows: Tensor, features: Tensor) -> None:
        """Hold one token's features [k, F] for each slot, at its ring row (rows(): [k], on the device)."""
        self.flat.index_copy_(0, rows, features)
        for s in slot_list:
            self.counts[s] += 1

    def held(self, slots: Tensor, starts: Tensor, n: int) -> Tensor:
        """[k, n, F]: the held-back features of slots [k] at positions starts [k] .. + n - 1."""
        return self.buffer[slots[:, None], (starts[:, None] + self.offsets[:n]) % self.capacity]
