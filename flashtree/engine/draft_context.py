"""The drafter's context for requests that are not drafting: held back, then appended at once.

A request the policy keeps on plain AR steps still commits tokens, and the drafter must see their
target features before it drafts for that request again. Appending one token's features a round
(the drafter's fc + K/V projections for every layer) would cost a few percent of an AR step on a
small target, for nothing until the request drafts. So the features of each committed token are
parked in a per-slot buffer (one copy on the device), and the buffered run is appended in one
drafter call when the request drafts again or when the buffer fills. The drafter's committed
length then lags the target's by the buffered count, and catches up before any draft reads it.
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
        # Held-back tokens per slot, twice: on the host (the runner plans with it) and on the
        # device (where the next one goes), so parking needs no upload.
        self.counts = [0] * slots
        self.next = torch.zeros(slots, dtype=torch.long, device=device)

    def reset(self, slot: int) -> None:
        self.counts[slot] = 0
        self.next[slot] = 0

    def emptied(self, slots: list[int], on_device: Tensor) -> None:
        """These slots' held-back tokens were appended (slots also as a device tensor)."""
        for s in slots:
            self.counts[s] = 0
        self.next.index_fill_(0, on_device, 0)

    def due(self, drafting: list[int], idle: list[int]) -> list[int]:
        """Slots to append now: drafting ones holding anything, idle ones whose buffer is full."""
        return [s for s in drafting if self.counts[s]] + [s for s in idle if self.counts[s] >= self.capacity]

    def groups(self, slots: list[int]) -> dict[int, list[int]]:
        """Slots by held-back count: each group is one drafter call of that many rows."""
        out: dict[int, list[int]] = {}
        for s in slots:
            out.setdefault(self.counts[s], []).append(s)
        return out

    def park(self, slot_list: list[int], slots: Tensor, features: Tensor) -> None:
        """Hold one token's features [k, F] for each slot (slots [k] on the device)."""
        self.buffer[slots, self.next[slots]] = features
        self.next.index_add_(0, slots, torch.ones_like(slots))
        for s in slot_list:
            self.counts[s] += 1

    def held(self, slots: Tensor, n: int) -> Tensor:
        """[k, n, F]: the first n held-back features of slots [k]."""
        return self.buffer[slots, :n]
