"""One request's state as it moves through the engine, and the group of samples it may belong to."""

from __future__ import annotations

import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from flashtree.engine.stops import StopMatcher
from flashtree.sampling import SamplingParams

STAGES = ("prefill", "draft", "tree", "verify", "commit")
_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds a slot: prefilling, then decoding
    FINISHED = "finished"


class TokenLogprob(NamedTuple):
    """A committed token's log-probability under the distribution it was sampled from, and the
    `k` most likely tokens there (best first, ties by lower id)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


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
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not a prefill

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
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class Request:
    """One sample: a cache slot, its output and its detokenizer state."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: new_request_id())
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    slot: int = -1
    bonus: int = -1  # the next round's root: sampled by the target, not yet in the cache (-1 before the first)
    num_computed: int = 0  # prompt tokens whose K/V the slot holds (prefilled, copied or reused)
    save_state_at: int | None = None  # hybrid prefix reuse: a prefill chunk ends here to save the state
    # False: seated (budget="auto") while its sampling class was settled on AR steps, so it only
    # takes AR steps and the drafter never sees it: no prompt context, no held-back tokens.
    speculative: bool = True
    text: str = ""
    prefix_offset: int = 0  # incremental detokenization window: ids[prefix_offset:read_offset]
    read_offset: int = 0  # was decoded last round
    stops: StopMatcher | None = None  # where the text stands in its stop strings (made on first use)
    stats: RequestStats = field(default_factory=RequestStats)
    seed: int = 0  # keys the sampling noise: derived from params.seed, or fresh random bits (see add_group)
    group: RequestGroup | None = None
    index: int = 0  # which sample of its group
    logprobs: list[TokenLogprob] | None = None  # per output token, when asked (or best_of needs them)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def held_back(self) -> int:
        """Characters at the end of `text` that could still grow into a stop string: a stream
        withholds them, since the engine cuts the text before a stop string once it is whole."""
        return 0 if self.stops is None or self.finished else self.stops.held

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefills(self) -> bool:
        """Computes its own prompt: a group's other samples copy the first sample's."""
        return self.index == 0

    @property
    def prefilled(self) -> bool:
        return self.num_computed == len(self.prompt_ids)

    @property
    def decoding(self) -> bool:
        return self.bonus >= 0 and not self.finished


def derived_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed in a group seeded with `seed`: the seed itself for sample 0 (so n=1 is
    a plain seeded request), else the first 8 bytes (little-endian, top bit cleared) of
    blake2b(f"{seed}:{index}"), which no neighbouring seed reproduces."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class RequestGroup:
    """The samples (n, or best_of) of one prompt; they share its prefill."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[Request]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def choices(self) -> list[Request]:
        """The n samples to return: all of them in order, or with best_of the n highest by
        cumulative logprob (ties: lower index), in that order."""
        n = self.params.n
        if len(self.samples) == n:
            return list(self.samples)
        return sorted(self.samples, key=lambda s: (-s.cumulative_logprob, s.index))[:n]
