"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from flashtree.sampling import SamplingParams

STAGES = ("prefill", "draft", "tree", "verify", "commit")
_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Per-request measurements. Stage times of a batched round count fully for each member."""

    accept_lengths: list[int] = field(default_factory=list)  # per round, bonus token included
    # Per round, what the speculation policy chose and expected (budget="auto"; fixed methods
    # record their fixed choice with no prediction): "ar", "chain" or "tree"; drafted nodes
    # verified (0 for ar); expected accepted drafted tokens (accept_lengths - 1 is what it got).
    modes: list[str] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    predicted_accepts: list[float] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def wall_seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.arrival

    def as_dict(self) -> dict:
        return {
            "tau": self.mean_accept_length,
            "rounds": self.rounds,
            "accept_lengths": list(self.accept_lengths),
            "modes": list(self.modes),
            "draft_sizes": list(self.draft_sizes),
            "predicted_accepts": list(self.predicted_accepts),
            "stage_seconds": dict(self.stage_seconds),
            "wall_seconds": self.wall_seconds,
            "ttft_seconds": None if self.first_token is None else self.first_token - self.arrival,
        }


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    slot: int = -1
    bonus: int = -1  # the next round's root: sampled by the target, not yet in the cache
    text: str = ""
    prefix_offset: int = 0  # incremental detokenization window: ids[prefix_offset:read_offset]
    read_offset: int = 0  # was decoded last round
    stats: RequestStats = field(default_factory=RequestStats)
    seed: int = 0  # keys the sampling noise: params.seed, or fresh random bits (set by add_request)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
