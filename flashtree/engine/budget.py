"""Budget "auto": pick each round's tree size from measured verify cost and the draft itself.

DDTree loses to chain DFlash when its budget is fixed while the verify cost grows with tree
size. Here the target's verify time is measured once per window size at startup, and every
round the tree is cut to the budget b maximising

    tokens per second = R * (1 + k * E_b) / (t_draft + t_verify(R * (b + 1)))

where E_b is the expected number of accepted drafted nodes of the top-b tree under the
drafter's own distribution (summed over the batch's rows) and k calibrates it against what the
target actually accepted (the drafter's product of marginals misjudges deep nodes).
"""

from __future__ import annotations

import bisect
import time

import torch

from flashtree.models.context import ForwardContext
from flashtree.tree import chain_spec

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


class AutoBudget:
    def __init__(self, max_budget: int, verify_seconds: dict[int, float], draft_seconds: float) -> None:
        self.max_budget = max_budget
        self.sizes = sorted(verify_seconds)
        # True cost never falls as the window grows and noise only adds time, so each point
        # is capped by every larger window's measurement.
        seconds = [verify_seconds[n] for n in self.sizes]
        self.seconds = [min(seconds[i:]) for i in range(len(seconds))]
        self.draft_seconds = draft_seconds
        self.calibration = 1.0
        self.candidates = [b for b in CANDIDATES if b < max_budget] + [max_budget]

    @classmethod
    @torch.inference_mode()
    def measure(cls, target, drafter, cache, draft_cache, max_budget: int, context: int = 256) -> "AutoBudget":
        """Time target windows of 1..max_budget+1 nodes and one drafter pass on slot 0, after a
        committed context of `context` rows (their contents do not change the cost), then reset it."""
        device = target.embed_tokens.weight.device
        context = min(context, cache.max_len - max_budget - 2)
        cache.set_length(0, context)
        draft_cache.set_length(0, context)
        sizes = sorted({1, max_budget + 1} | {n + 1 for n in CANDIDATES if n < max_budget})
        verify = {}
        for n in sizes:
            spec = chain_spec(torch.zeros(1, n, dtype=torch.long, device=device))
            verify[n] = _time(lambda: target(spec.tokens, ForwardContext.verify(cache, [0], spec),
                                             tuple(drafter.args.target_layer_ids)), device)
        block = torch.zeros(1, drafter.block_size, dtype=torch.long, device=device)
        draft = _time(lambda: target.lm_head(drafter(target.embed_tokens(block),
                                                     ForwardContext.block(draft_cache, [0], drafter.block_size))),
                      device)
        cache.set_length(0, 0)
        draft_cache.set_length(0, 0)
        return cls(max_budget, verify, draft)

    def verify_seconds(self, nodes: int) -> float:
        """Measured cost, linearly interpolated (and extrapolated past the largest size)."""
        i = bisect.bisect_left(self.sizes, nodes)
        if i < len(self.sizes) and self.sizes[i] == nodes:
            return self.seconds[i]
        i = min(max(i, 1), len(self.sizes) - 1)
        (n0, t0), (n1, t1) = (self.sizes[i - 1], self.seconds[i - 1]), (self.sizes[i], self.seconds[i])
        return t0 + (t1 - t0) * (nodes - n0) / (n1 - n0)

    def choose(self, expected: list[list[float]], cap: int) -> int:
        """The budget (<= cap) with the best predicted throughput; expected[r][b-1] = E_b of row r."""
        gains = [sum(row[min(b, len(row)) - 1] for row in expected if row) for b in self.candidates if b <= cap]
        return self.choose_gains(gains, len(expected), cap)

    def choose_gains(self, gains: list[float], rows: int, cap: int) -> int:
        """The same choice from gains[i] = E summed over the batch's rows at budget candidates[i]."""
        best, best_rate = 1, -1.0
        for b, gain in zip(self.candidates, gains):
            if b > cap:
                break
            rate = (rows + self.calibration * gain) / (self.draft_seconds + self.verify_seconds(rows * (b + 1)))
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def observe(self, predicted: float, accepted: int) -> None:
        """Move the calibration towards accepted / predicted drafted nodes (slow EMA)."""
        if predicted > 0.05:
            self.calibration += 0.05 * (min(accepted / predicted, 4.0) - self.calibration)
