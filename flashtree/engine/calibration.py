"""Calibrated acceptance: how far to trust the drafter's own node probabilities.

A drafted node's value is min(1, beta[depth, kind] * exp(score)) (flashtree/tree/value.py). beta
is a ratio estimate, accepted nodes over predicted ones, learned from every speculative round:
for each depth and kind (on the spine of top-1 children, or off it) the drafter predicted the
sum of that depth and kind's reach probabilities, and the round observed how many the target
accepts. The observation is the walk's expectation given the target's logits where that is
cheap and exact (greedy: the argmax path; temperature-only sampling: each node's sampling
probability multiplied down its path), which carries far less noise than the walk's 0/1 outcome;
top-k/top-p rows count the walk's outcome (runner.observation).

Estimates are kept per request and pooled per sampling class (temperature, in tenths: a request
at T = 1 and one at T = 0 accept very differently), each shrunk toward the level above it by
pseudo-counts, so a request with few rounds of its own follows the pool, and a depth the pool
rarely sees follows the pool's kind-wide estimate:

    beta_kind[c, k]    = (sum_d obs + K1) / (sum_d pred + K1)          (prior: trust the drafter)
    beta_pool[c, d, k] = (obs + K0 * beta_kind) / (pred + K0)
    beta_req[d, k]     = (obs_req + K * beta_pool) / (pred_req + K)

Old evidence fades (DECAY_REQ per speculative round of the request, DECAY_IDLE per round it
spends on AR steps, DECAY_POOL per round), so a request whose text turns easy or hard is
followed within a few rounds, and one that stopped drafting drifts back toward its class.
`evidence` is how many rounds a request's estimate rests on: the policy's exploration is wide
where it is small.
"""

from __future__ import annotations

import numpy as np

from flashtree.sampling import SamplingParams

K, K0, K1 = 6.0, 2.0, 1.0
DECAY_REQ, DECAY_IDLE, DECAY_POOL = 0.85, 0.97, 0.97
BETA_RANGE = (0.02, 20.0)
EVIDENCE_IDLE = 0.9  # per AR round, how much a request's own drafted rounds still count as evidence


def sampling_class(params: SamplingParams) -> int:
    """Requests that accept alike: greedy is 0, sampled ones by temperature in tenths (>= 1)."""
    return 0 if params.greedy else max(1, min(50, round(params.temperature * 10)))


class Calibration:
    """Ratio estimates per request (slot) and pooled per class. A request's rounds on AR steps age
    its evidence lazily: the caller passes how many it spent since it last drafted (`idle`)."""

    def __init__(self, slots: int, depth: int) -> None:
        self.depth = depth
        self.obs = np.zeros((slots, depth, 2))
        self.pred = np.zeros((slots, depth, 2))
        self.rounds = np.zeros(slots)  # drafted rounds behind each request's estimate, faded like it
        self.pool: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.pool_evidence: dict[int, float] = {}

    def reset(self, slot: int) -> None:
        self.obs[slot] = 0.0
        self.pred[slot] = 0.0
        self.rounds[slot] = 0.0

    def _pool(self, cls: int) -> tuple[np.ndarray, np.ndarray]:
        if cls not in self.pool:
            self.pool[cls] = (np.zeros((self.depth, 2)), np.zeros((self.depth, 2)))
            self.pool_evidence[cls] = 0.0
        return self.pool[cls]

    def pool_beta(self, cls: int) -> np.ndarray:
        obs, pred = self._pool(cls)
        kind = (obs.sum(0) + K1) / (pred.sum(0) + K1)
        return (obs + K0 * kind) / (pred + K0)

    def beta(self, slots: list[int], classes: list[int], idle: np.ndarray) -> np.ndarray:
        """[len(slots), depth, 2]: each request's estimate."""
        if not slots:
            return np.ones((0, self.depth, 2))
        pools = {c: self.pool_beta(c) for c in set(classes)}
        prior = np.stack([pools[c] for c in classes])
        age = (DECAY_IDLE ** idle)[:, None, None]
        b = (age * self.obs[slots] + K * prior) / (age * self.pred[slots] + K)
        return np.clip(b, *BETA_RANGE)

    def branch_beta(self, slots: list[int], classes: list[int], idle: np.ndarray) -> np.ndarray:
        """[len(slots)]: one correction for all branch (off-spine) nodes, pooled over depths: tree
        forecasts apply it to a tree's summed branch reach."""
        kind = {}
        for c in set(classes):
            obs, pred = self._pool(c)
            kind[c] = (obs[:, 1].sum() + K1) / (pred[:, 1].sum() + K1)
        prior = np.array([kind[c] for c in classes])
        age = DECAY_IDLE ** idle
        b = (age * self.obs[slots, :, 1].sum(1) + K * prior) / (age * self.pred[slots, :, 1].sum(1) + K)
        return np.clip(b, *BETA_RANGE)

    def evidence(self, slots: list[int], classes: list[int], idle: np.ndarray) -> np.ndarray:
        """[len(slots)]: how many independent looks each request's estimate rests on, counted in
        rounds, not nodes: a round's nodes stand or fall together (a chain stops at its first
        miss) and acceptance comes in streaks, so a round is one observation however many nodes
        it drafted. Its own drafted rounds (fading as the estimate does) count in full, its
        class's at a tenth and at most 1, since other text is only a hint. While a request takes
        AR steps its own looks fade faster than its estimate (EVIDENCE_IDLE): the text moves on.
        Counting nodes made the policy so sure of a stale estimate that it stopped re-trying
        speculation."""
        own = self.rounds[slots] * EVIDENCE_IDLE ** idle
        for c in classes:
            self._pool(c)
        pool = np.array([self.pool_evidence[c] for c in classes])
        return 1.0 + own + np.minimum(1.0, 0.1 * pool)

    def update(self, slots: list[int], classes: list[int], obs: np.ndarray, pred: np.ndarray,
               idle: np.ndarray) -> None:
        """Fold in one round: obs/pred [k, D', 2] for the speculating requests (D' <= depth), which
        spent `idle` [k] rounds on AR steps before it."""
        d = obs.shape[1]
        age = (DECAY_REQ * DECAY_IDLE ** idle)[:, None, None]
        self.obs[slots] *= age
        self.pred[slots] *= age
        self.obs[slots, :d] += obs
        self.rounds[slots] = self.rounds[slots] * age[:, 0, 0] + 1.0
        self.pred[slots, :d] += pred
        for c in set(classes):
            rows = [i for i, x in enumerate(classes) if x == c]
            po, pp = self._pool(c)
            po *= DECAY_POOL
            pp *= DECAY_POOL
            po[:d] += obs[rows].sum(0)
            pp[:d] += pred[rows].sum(0)
            self.pool_evidence[c] = self.pool_evidence[c] * DECAY_POOL + len(rows)
