"""Measured speculation for a batch whose requests sample alike: AR steps, the chain, or a tree of
size b, whichever has delivered the most tokens per second.

A forecast from the drafter's confidence is one round stale and misjudges streaky acceptance;
what a shape actually accepts can be measured instead, and one round measures many shapes. The
top-b tree is a prefix-closed subset of any larger exact tree (tree/value.py), and the target's
pick at a node depends only on that node's prefix and on the noise of its position (seed-exact
sampling shares it by depth), so the walk through the small tree follows the big tree's accepted
path for as long as that path stays inside it. A round that verified a tree of B nodes therefore
gives, exactly, the tokens every top-b tree with b <= B would have accepted, and the chain's
(the path's run along the spine, the tree's best-child path, which is the chain the drafter
drafts); a chain round gives the chain's. Per sampling class (acceptance is a property of what
is sampled and how, not of the batch size) the selector keeps an exponential average of these
per arm, and prices every arm for the batch at hand with the cost model (measured at startup,
refined from timed rounds):

    rate(arm) = rows * (1 + accepted(arm)) / seconds(rows, arm),   rate(AR) = rows / seconds(AR)

It plays the best measured arm. A small share of round time is credit for exploration: an arm
whose information is stalest among those that could plausibly win (the older an estimate, the
more it may be off) is played when the credit covers its expected loss. Where AR wins, that share shrinks with how far drafting trails, so a
class whose drafts never pay (T = 1 with a weak drafter) hardly ever drafts. A class seen for the
first time drafts its first rounds with the largest tree that costs at most twice the cheapest
drafting round, so that one round measures many sizes.

The chosen plans are the fixed methods' own (every row alike), so a round costs what that fixed
method's round does: no per-row plan and, apart from the accepted path's place in the tree, no
extra data read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RATE = 0.05  # EMA weight of one row's observation (a batch's round weighs 1 - (1 - RATE)^rows)
KNOWN = 3  # rounds of evidence before an arm's average is trusted over its extrapolation
COLD_ROUNDS = 3  # drafting rounds a new class opens with (the exploration tree)
COLD_COST = 2.0  # the opening tree may cost this many times the cheapest drafting round
EXPLORE_SHARE = 0.04  # share of round time that pays for exploration while drafting wins
PROBE_MIN = 0.002  # ... and where AR wins by a wide margin
STALE_HOPE, STALE_ROUNDS = 0.5, 50  # an arm unobserved this many rounds may be worth up to 1.5x its estimate
AR_ARM, CHAIN_ARM = -2, -1  # arms: AR, the chain, or a tree grid column (>= 0)


@dataclass
class ClassStats:
    """Per sampling class: average drafted tokens accepted per row, by arm (tree columns, then
    the chain), rounds of evidence behind each, and rounds since each was last observed."""

    acc: np.ndarray
    seen: np.ndarray
    age: np.ndarray
    rounds: int = 0  # drafting rounds observed
    credit: float = 0.0  # seconds of exploration the class may spend
    changed: bool = True
    estimate: tuple = ()  # accepted()'s, until the next observation


class Selector:
    def __init__(self, grid: np.ndarray, depth: int) -> None:
        self.grid = grid
        self.depth = depth
        self.stats: dict[int, ClassStats] = {}

    def _class(self, cls: int) -> ClassStats:
        if cls not in self.stats:
            n = len(self.grid) + 1
            self.stats[cls] = ClassStats(np.zeros(n), np.zeros(n), np.full(n, np.inf))
        return self.stats[cls]

    # ---- estimates ---------------------------------------------------------------------------

    def accepted(self, cls: int) -> tuple[np.ndarray, float]:
        """Expected drafted tokens accepted per row: [G] per tree column, and the chain's.
        Tree columns never observed extend the largest observed one by its last increment, in
        geometric steps (a bigger tree accepts no less; a column past the drafter's depth adds
        branches only); the chain, never observed, takes the tree of the same size's value."""
        s = self._class(cls)
        G = len(self.grid)
        tree = s.acc[:G].copy()
        seen = s.seen[:G] > 0
        last = np.flatnonzero(seen)
        if len(last) == 0:
            tree[:] = 0.0
        else:
            j = int(last[-1])
            step = tree[j] - (tree[j - 1] if j > 0 and seen[j - 1] else 0.0)
            for k in range(j + 1, G):
                step *= 0.7
                tree[k] = min(self.depth, tree[k - 1] + max(step, 0.0))
            # A bigger tree accepts no less (exactly so within one round); columns last measured
            # long ago must not undercut fresher smaller ones.
            tree = np.maximum.accumulate(np.where(seen | (np.arange(G) > j), tree, 0.0))
        chain = s.acc[G] if s.seen[G] > 0 else float(tree[self.chain_column()])
        return tree, chain

    def chain_column(self) -> int:
        return int(np.searchsorted(self.grid, self.depth))

    def rates(self, cls: int, rows: int, seconds: dict[int, float], ar_seconds: float) -> dict[int, float]:
        """Predicted tokens per second of every arm that fits (`seconds`: arm -> round seconds)."""
        s = self._class(cls)
        if s.changed:
            s.estimate, s.changed = self.accepted(cls), False
        tree, chain = s.estimate
        out = {AR_ARM: rows / ar_seconds}
        for arm, sec in seconds.items():
            if arm != AR_ARM:
                out[arm] = rows * (1.0 + (chain if arm == CHAIN_ARM else float(tree[arm]))) / sec
        return out

    # ---- the choice --------------------------------------------------------------------------

    def choose(self, cls: int, rows: int, seconds: dict[int, float], ar_seconds: float) -> tuple[int, bool]:
        """The arm to play (AR_ARM, CHAIN_ARM or a tree column) and whether it explores."""
        s = self._class(cls)
        drafting = [a for a in seconds if a != AR_ARM]
        if not drafting:
            return AR_ARM, False
        if s.rounds < COLD_ROUNDS:
            cheapest = min(seconds[a] for a in drafting)
            trees = [a for a in drafting if a >= 0 and seconds[a] <= COLD_COST * cheapest]
            if trees:
                return max(trees), True
            return min(drafting, key=lambda a: seconds[a]), True
        rates = self.rates(cls, rows, seconds, ar_seconds)
        known = {a: r for a, r in rates.items() if a == AR_ARM or self._seen(s, a) >= KNOWN}
        best = max(known, key=known.get) if known else AR_ARM
        top = max(rates[a] for a in drafting)
        share = EXPLORE_SHARE
        if best == AR_ARM:  # exploration shrinks with how far the best drafting arm trails
            share = PROBE_MIN + (EXPLORE_SHARE - PROBE_MIN) * min(1.0, max(0.0, (top / rates[AR_ARM] - 0.5) / 0.5))
        s.credit = min(s.credit + share * seconds.get(best, ar_seconds), 8.0 * max(seconds.values()))
        # Candidates: arms whose rate, with optimism growing as their information ages, reaches the
        # best's (an estimate that is low because it is stale must not lock its arm out).
        plausible = [a for a in drafting if a != best
                     and rates[a] * (1.0 + STALE_HOPE * min(1.0, self._age(s, a) / STALE_ROUNDS)) >= rates[best]]
        if not plausible and best == AR_ARM:
            plausible = [max(drafting, key=rates.get)]
        if plausible:
            # The stalest; among equals the biggest tree, which also measures the smaller ones.
            cand = max(plausible, key=lambda a: (self._age(s, a), a))
            price = max(0.0, seconds[cand] - rows * (1.0 + self._tokens(rates, seconds, cand, rows)) / rates[best])
            if self._age(s, cand) > 1 and s.credit >= price:
                s.credit -= price
                return cand, True
        return best, False

    def _seen(self, s: ClassStats, arm: int) -> float:
        return float(s.seen[len(self.grid) if arm == CHAIN_ARM else arm])

    def _age(self, s: ClassStats, arm: int) -> float:
        return float(s.age[len(self.grid) if arm == CHAIN_ARM else arm])

    @staticmethod
    def _tokens(rates: dict[int, float], seconds: dict[int, float], arm: int, rows: int) -> float:
        """Accepted drafted tokens per row the arm is expected to bring."""
        return rates[arm] * seconds[arm] / rows - 1.0

    def predicted(self, cls: int, arm: int) -> float:
        if arm == AR_ARM:
            return 0.0
        tree, chain = self.accepted(cls)
        return chain if arm == CHAIN_ARM else float(tree[arm])

    # ---- learning ----------------------------------------------------------------------------

    def observe(self, cls: int, rows: int, tree: np.ndarray | None, chain: np.ndarray,
                chain_exact: bool, censored: np.ndarray | None = None) -> None:
        """One drafting round of `rows` rows: accepted tokens per row at the tree columns it
        measured (tree [rows, cols]) and along the chain (chain [rows]: exact for a chain round;
        from a tree, `censored` marks rows whose accepted path ran to the end of a spine shorter
        than the chain, a lower bound that counts half)."""
        s = self._class(cls)
        G = len(self.grid)
        s.age += 1
        s.rounds += 1
        s.changed = True
        w = 1.0 - (1.0 - RATE) ** rows
        if tree is not None and tree.size:
            cols = tree.shape[1]
            self._fold(s, slice(0, cols), tree.mean(0), w)
        trust = 1.0 if chain_exact or censored is None else 1.0 - 0.5 * float(np.mean(censored))
        self._fold(s, slice(G, G + 1), np.array([chain.mean()]), w * trust)

    @staticmethod
    def _fold(s: ClassStats, where: slice, x: np.ndarray, w: float) -> None:
        n = s.seen[where]
        weight = np.maximum(w, 1.0 / (n + 1))
        s.acc[where] = np.where(n > 0, s.acc[where] + weight * (x - s.acc[where]), x)
        s.seen[where] = n + 1
        s.age[where] = 0

    def idle(self, cls: int) -> None:
        """A round of AR steps for this class: its information ages."""
        s = self._class(cls)
        s.age += 1
