"""Sampling parameters: the public, per-request description of how to pick tokens.

The hot-path sampler that applies them lives in flashtree/sampler.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtree.errors import FlashtreeError


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
# All of a request's stop strings together, in characters: far above real stop lists, and it
# bounds the matcher each request builds (one trie node per character).
MAX_STOP_CHARS = 4096


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # same seed -> same text, whatever the method, budget or batch
    ignore_eos: bool = False
    n: int = 1  # samples returned; they share the prompt's prefill
    best_of: int | None = None  # samples drawn (>= n); the n with the highest cumulative logprob are returned
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives (0..20)
    prompt_logprobs: int | None = None  # the same for prompt tokens (the first has none); disables prefix reuse

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not 0.0 <= self.temperature <= 100.0:
            raise FlashtreeError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise FlashtreeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise FlashtreeError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise FlashtreeError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise FlashtreeError("stop strings must not be empty")
        if (chars := sum(map(len, self.stop))) > MAX_STOP_CHARS:
            raise FlashtreeError(f"the stop strings have {chars} characters in all; at most {MAX_STOP_CHARS} "
                                 "are allowed")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise FlashtreeError(f"seed must be an integer or None, got {self.seed!r}")
        if self.n < 1:
            raise FlashtreeError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise FlashtreeError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise FlashtreeError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Samples to draw: best_of, or n."""
        return self.best_of or self.n
