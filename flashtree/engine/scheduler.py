"""Continuous batching: requests join and leave between rounds, one cache slot each."""

from __future__ import annotations

from collections import deque

from flashtree.engine.sequence import Request, Status
from flashtree.errors import QueueFull

__all__ = ["Scheduler", "QueueFull"]  # QueueFull lives in flashtree.errors; re-exported for old imports


class Scheduler:
    def __init__(self, max_batch: int, max_queue: int) -> None:
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch - 1, -1, -1))

    def add(self, req: Request) -> None:
        """Queue a request. Only requests beyond the free slots count against max_queue: the
        next admit() seats the others at once, so a burst on an idle engine is never refused."""
        if len(self.waiting) - len(self.free_slots) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests wait for a slot); retry later")
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; they need a prefill before their first round."""
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

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
