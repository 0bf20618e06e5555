"""Continuous batching: requests join and leave between rounds, one cache slot each.

A seated request first prefills its prompt, in chunks the engine sizes (at most
max_prefill_tokens per step, shared by all prefilling requests), while seated requests that
have their first token keep decoding. The samples of one group are seated together: the
first prefills, the others copy its prompt K/V when it is done.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from flashtree.engine.sequence import Request, Status
from flashtree.errors import QueueFull

__all__ = ["Scheduler", "QueueFull"]  # QueueFull lives in flashtree.errors; re-exported for old imports

SlotChooser = Callable[[Request, list[int]], int]  # (request, free slots) -> the slot to give it


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int) -> None:
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # seated, in seating order: prefilling or decoding
        self.free_slots = list(range(max_batch - 1, -1, -1))

    def add(self, req: Request | list[Request]) -> None:
        """Queue a request (or a group's samples, seated together). Only requests beyond the free
        slots count against max_queue: the next admit() seats the others at once, so a burst on
        an idle engine is never refused."""
        reqs = req if isinstance(req, list) else [req]
        if len(self.waiting) + len(reqs) - len(self.free_slots) > self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests wait for a slot); retry later")
        self.waiting.extend(reqs)

    def admit(self, choose: SlotChooser | None = None) -> list[Request]:
        """Seat waiting requests in free slots (a group only when all its samples fit), in order."""
        admitted = []
        while self.waiting and self.free_slots:
            head = self.waiting[0]
            size = len(head.group.samples) if head.group is not None else 1
            if size > len(self.free_slots):
                break
            for _ in range(size):
                req = self.waiting.popleft()
                slot = choose(req, self.free_slots) if choose is not None else self.free_slots[-1]
                self.free_slots.remove(slot)
                req.slot = slot
                req.status = Status.RUNNING
                self.running.append(req)
                admitted.append(req)
        return admitted

    def prefilling(self) -> list[Request]:
        """Seated requests with prompt left to compute, in seating order."""
        return [r for r in self.running if r.prefills and not r.prefilled]

    def decoding(self) -> list[Request]:
        """Seated requests that hold their next round's root."""
        return [r for r in self.running if r.decoding]

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
