"""Sampling parameters and the target's per-node token choice.

The accept walk is lossless for any rule that picks each node's token from the target's
distribution at that node independently, so the engine samples once per tree node and
follows matching children. The distribution is the one AR decoding would sample from:
logits / temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashtree.errors import FlashtreeError


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
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

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A private RNG per request, so a seeded request samples the same under any batch."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The target's sampling distribution [..., V] for one request's logits [..., V]."""
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One independent draw per row of probs [..., V] (exponential race: argmax p / E)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def pick_tokens(logits: Tensor, params: list[SamplingParams], generators: list) -> Tensor:
    """The target's token at every node: logits [R, N, V] -> [R, N]."""
    picks = logits.argmax(-1)
    for r, p in enumerate(params):
        if not p.greedy:
            picks[r] = sample(probabilities(logits[r], p), generators[r])
    return picks
