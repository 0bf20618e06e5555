"""Measured speculation for a batch whose requests sample alike: AR steps, the chain, or a tree of
size b, whichever has delivered the most tokens per second.

A forecast from the drafter's confidence is one round stale and misjudges streaky acceptance;
what a shape accepts can be measured instead, and one round measures many shapes. The top-b tree
is a prefix-closed subset of any larger exact tree (tree/value.py), and the target's pick at a
node depends only on the node's prefix and on the noise of its position (seed-exact sampling
shares it by depth), so the walk through the small tree follows the big tree's accepted path for
as long as that path stays inside it. A round that verified a tree of B nodes therefore gives,
exactly, the tokens every top-b tree with b <= B would have accepted. The chain's draft is the
tree's spine (each node's best child), so its walk along the spine is the chain's, as far as the
spine goes (chain_tokens); a chain round gives the chain's to its full depth.

Estimates, per sampling class (acceptance depends on what is sampled, not on the batch size):
an arm's accepted tokens are shape x (level + P). The level is a recent average of a base every
drafting arm measures alike (the accepted path's first BASE_DEPTH spine nodes); an arm's shape is
a slow average of its accepted tokens over (P + the base) in the same rounds (a tree's: the sum
of what each grid size adds to the next smaller one, both measured in one round). P (a fraction
of a token) keeps the ratio finite where the base is ~0, and appears on both sides, so a steady
level gives back the arm's own average (the chain's shape: its tokens over the base, both from
every drafting round). Pairing matters:
acceptance comes in streaks and big trees are played when it runs high, so averaging each arm
over the rounds it happened to be played would credit big trees with the good stretches.

Prices: the cost model's seconds times the machine's current load times the arm's bias at this
batch size, both from timed rounds (ArmTimes). Then

    rate(arm) = (rows + drafting * accepted(arm)) / seconds(rows, arm),   rate(AR) = rows / seconds(AR)

drafting the rows that may draft (all, unless the batch holds plain requests: Policy.admit).

and the best measured arm is played. A share of round time (smaller the longer the same arm
stays the best: settled) is credit for exploration: the stalest of the runners-up (optimistic
where an arm rests on few rounds) is played when the credit covers its expected loss. Where AR
wins, the share shrinks with how far drafting trails, so a class whose drafts never pay (T = 1
with a weak drafter) hardly ever drafts, and AR steps are decided ahead until the next probe is
affordable; a drafting arm that clearly leads is decided a few rounds ahead too (kept), the
choice being most of a round's host work. A class seen for the first time opens with the largest
tree that costs at most twice the cheapest drafting round, which measures many sizes, with AR
steps timed between those rounds (an arm's price is only worth its ratio to the others', so they
are timed in the same seconds). A probe from AR steps drafts a few rows, or all of them while
the arm's price at this batch size rests on few of its own rounds.

The plans are the fixed methods' own (every row alike), so a round costs what that fixed method's
round does: no per-row plan and, apart from a tree round's accepted path codes (integers read
beside its tokens, decoded by by_size), nothing read back.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

RATE = 0.05  # EMA weight of one row in the level (a round of r rows weighs 1 - (1 - RATE)^r)
SHAPE_RATE = 0.01  # ... and in an arm's shape, which changes slowly
LONG_RATE = 0.002  # ... and in the long-run level: what a request seated now may expect (lead)
BASE_DEPTH = 3  # the level counts the accepted path's first BASE_DEPTH spine nodes
SHAPE_PRIOR = 0.5  # P: base tokens added to both sides of a shape, so it stays finite where the base is ~0
# Tokens of prior (at a ratio of 1) in an arm's own record (own_fix): about 40 rows. With 64 (a
# dozen rows), at T = 0, c = 1 the chain's first steady stretch of 40 rows, in hard text, put it at
# 0.74 of its measure, and exploration rounds are never steady, so that stood: the tree of 6 took
# the rest of the run (2 runs of 7 on trees, 0.90x the chain-led runs; 0 of 6 with 256).
OWN_PRIOR = 256.0
KNOWN = 3  # rounds of evidence before an arm's estimate is trusted
CHAIN_THIN = 64  # a hopeful chain measured in fewer rows than this is explored first
COLD_ROUNDS = 3  # drafting rounds a new class opens with (the exploration tree)
COLD_COST = 2.0  # the opening tree may cost this many times the cheapest drafting round
EXPLORE_SHARE = 0.015  # share of round time that pays for exploration while drafting wins (0.03 lost 2-4%)
# ... while the best arm is new; once it has held SETTLE rounds at one batch size, its predicted
# rate within SETTLE_MOVE of what it was then, the share shrinks as sqrt(SETTLE / rounds held),
# to SETTLE_FLOOR of it at most. At T = 0, c = 1 on the demo pair the chain leads the trees of
# 12-16 by 3-4% for good, and the full share (trees' first timings, then the stalest runner-up)
# kept 7-9% of rounds on trees: 1.5-2% behind the fixed dflash. A rate that moves (acceptance
# fell, or rose) starts it over: the runners-up's estimates are stale then. (The chain's rate
# there swings 15-20% with the level from one stretch of text to the next: 1.2 kept starting over.)
SETTLE, SETTLE_FLOOR, SETTLE_MOVE = 64, 0.25, 1.35
PROBE_MIN = 0.002  # ... and where AR wins by a wide margin
HOLD_MAX = 64  # AR rounds decided at once, at most
KEEP_MAX, KEEP_STEP = 4, 0.01  # drafting rounds decided at once, at most; the lead each one needs
KEEP_MIN = 2  # ... and at least, near a tie too
KEEP_AFTER = 16  # rounds of a class before a drafting choice is kept for more than its round
AR_MARGIN = 1.03  # a drafting arm is played over AR steps only where it predicts this much more
STAY = 1.03  # the drafting arm chosen last stays the best until another predicts this much more
TIE = 1.02  # drafting arms predicted within this factor of the best tie: the cheapest is played
PROBE_PRICE = 0.25  # a probe from AR steps after one that left AR ahead costs at least this share
#                     of its round: near parity (hopeful above AR's rate) probes were free, so every
#                     other round drafted. The first of a stretch stays cheap: a dip recovers fast.
STALE_WEIGHT = 8  # a drafting round after a stretch of AR steps moves the level as up to this many would
TIME_WINDOW, TIMED = 16, 3  # timed rounds kept per (batch size, arm); how many make its bias
THIN = 8  # a runner-up timed in fewer of its own rounds at this batch size is explored first
TREE_PRIOR = 8  # rounds' worth of weight the trees' pooled bias has in one tree's (ArmTimes)
LOAD_WINDOW = 5  # timed rounds whose median is the machine's load (ArmTimes): a round that also
#                 flushed held-back context does not move it, a lasting change of speed does in 3
AR_RECHECK = 0.67  # while drafting leads, AR steps within this share of its rate are re-timed now and then
AR_ARM, CHAIN_ARM = -2, -1  # arms: AR, the chain, or a tree grid column (>= 0)


@dataclass
class ClassStats:
    """Per sampling class. level: the recent average of the base (the accepted path's first
    BASE_DEPTH spine nodes, which every drafting arm measures alike). num/den per tree column:
    slow averages of what the column accepts over the next smaller column and of the base, over
    the rounds that measured it, so the sum of num/den up to a column is its shape, measured in
    the same rounds as its base (the chain's: reach and stops below). seen: rounds of evidence
    per arm (tree columns, then the chain); measured_at and played_at: the class's round (its
    clock) when each arm was last measured and last played, so an arm's age is clock - the older
    of the two (an AR round only ticks)."""

    num: list[float]  # (lists, not arrays: a drafting round reads and writes single entries, and
    den: list[float]  #  on a small target each numpy call between two forwards costs ~10 us)
    seen: list[float]
    measured_at: list[float]
    weight: list[float]  # rows of evidence per arm (a round weighs as its rows)
    # Per tree column, over the rounds that measured it (see pace): slow averages of the played
    # tree's tokens per row, of those over the column's, and of the column's.
    cover: list[float]
    steps: list[float]
    plain: list[float]
    clock: int = 0  # rounds of this class, AR steps included
    level: float = 0.0
    long_level: float = 0.0  # the base's long-run average (lead)
    gap: int = 1  # rounds since the last drafting round, this one included
    rounds: int = 0  # drafting rounds observed
    rows: float = 0.0  # ... and their rows (lead's hope)
    credit: float = 0.0  # seconds of exploration the class may spend
    changed: bool = True
    estimate: tuple = ()  # accepted()'s, until the next observation
    hold: tuple = (0, 0, 0.0)  # AR steps decided ahead: (rows, rounds left, credit per round)
    # A drafting arm decided ahead: (rows, rounds left, arm, credit per round, its estimate then).
    keep: tuple = (0, 0, AR_ARM, 0.0, 0.0)
    best: int = AR_ARM  # the drafting arm last chosen as the best (choose: it stays within STAY)
    # Per batch size: the best arm there (AR steps too), the round since when it has been, and
    # its rate then: the exploration share settles while they hold (settled). Per size, so a
    # batch that drains and refills comes back to a settled share: one record for every size
    # started over at each change of size, and at T = 0, c = 4 on the demo pair (a batch of 4
    # draining to 3, 2, 1 at the end of every stream of 16 requests) it never settled (the
    # factor averaged 1.00 over a run of 3 passes, 14 restarts of 15 from a change of size).
    settle: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    probes: int = 0  # probes from AR steps since a drafting arm was last the best
    ar_at: float = -math.inf  # the class's round when AR steps were last played to time them
    played_at: list[float] = field(default_factory=list)
    # The chain's kept tokens, from every drafting round (see chain_tokens): per depth d, slow
    # sums of the rows that reached d and of those that stopped there; and of the rows and their
    # base, for the chain's shape.
    reach: list[float] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)
    chain_rows: float = 0.0
    chain_base: float = 0.0
    # Per arm (tree columns, then the chain): slow sums, over its steady rows (observe), of the
    # tokens they kept and of what the uncorrected estimate predicted for them (own_fix).
    own: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    raw_estimate: tuple = ()  # the uncorrected estimate (accepted), as of the last choice


class Selector:
    def __init__(self, grid: np.ndarray, depth: int) -> None:
        self.grid = grid
        self.depth = depth
        self.stats: dict[int, ClassStats] = {}
        self.margin = AR_MARGIN
        self.explore_share = EXPLORE_SHARE
        self.shape_rate = SHAPE_RATE
        self.wide_cost = COLD_COST
        self.stay = STAY
        self.probing = False
        self.timing = False
        self.retime = False
        self.caps = [min(float(b), float(depth)) for b in grid]  # a tree of b nodes accepts b tokens at most

    def _class(self, cls: int) -> ClassStats:
        if cls not in self.stats:
            n = len(self.grid) + 1
            g = len(self.grid)
            self.stats[cls] = ClassStats([0.0] * g, [0.0] * g, [0.0] * n, [-math.inf] * n, [0.0] * n,
                                         [1.0] * g, [1.0] * g, [1.0] * g, played_at=[-math.inf] * n,
                                         reach=[0.0] * self.depth, stops=[0.0] * self.depth,
                                         own=[0.0] * n, raw=[0.0] * n)
        return self.stats[cls]

    # ---- estimates ---------------------------------------------------------------------------

    def accepted(self, cls: int) -> tuple[list[float], float]:
        """Expected drafted tokens accepted per row: [G] per tree column, and the chain's, as
        shape x (level + P), each times its arm's own record (own_fix). Tree columns never
        measured extend the largest measured one by its last increment, in shrinking steps; a
        bigger tree never accepts less. The chain's shape is its tokens from every drafting round
        (chain_tokens) over their base. (Plain floats: G is about a dozen, and this runs in
        every drafting round.)"""
        s = self._class(cls)
        s.raw_estimate = self._curves(s, None)
        fix = self.own_fix(s)
        return self._curves(s, fix) if any(f != 1.0 for f in fix) else s.raw_estimate

    def own_fix(self, s: ClassStats) -> list[float]:
        """Per arm (tree columns, then the chain), what its own steady rounds accepted over what
        the measured estimate predicted for them (1 with none). A round's acceptance depends on
        where it starts, and a round starts where the previous one ended: one measure of every
        smaller tree and of the chain is exact for the round's start, but the arm played puts
        the starts elsewhere than each arm would by itself. On the demo pair at T = 0, c = 4 (arms
        forced, same prompts and seeds) the chain measured 6.4 tokens along the spines of the
        trees of 12 and 16 and 5.6 along the tree of 8's, where its own rounds kept 4.96; the
        tree of 8 measured 4.10 in the tree of 16's rounds and 4.36 in its own. Only rounds that
        follow the same arm's round for the same request start where that arm puts them (steady,
        see observe).

        The chain keeps no record (its entry is 1): its own rounds are measured exactly and go
        into its estimate as they come (chain_tokens). With one, on the demo pair at T = 0, c = 1
        the record fell to 0.85-0.93 in five of the six engines where it was printed, and the
        trees of 12-16 took 26-64% of the rounds in 5 auto engines of 17 (0.94-0.96x the fixed
        dflash, which outran every tree by 3-4%); without, 1 of 11 spent 25% on trees, the rest
        3-9%. (Why it ran low there is not settled: a record compares rounds with the estimate
        they were chosen on, and an arm is chosen where its estimate runs high.) At c = 4, the
        chain and the tree of 8 tied, it made no difference."""
        fix = [(o + OWN_PRIOR) / (r + OWN_PRIOR) for o, r in zip(s.own, s.raw)]
        fix[-1] = 1.0
        return fix

    def _curves(self, s: ClassStats, fix: list[float] | None) -> tuple[list[float], float]:
        G = len(self.grid)
        # Tree column j holds its increment over column j - 1 (see observe): the shapes are sums.
        # P on one side only (it was, for the increments) took a steady level's estimates down
        # by base / (base + P): on the demo pair at T = 0 the tree of 8 was predicted 3.9 tokens
        # where the fixed ddtree-8 accepted 4.4, and the chain, 3% behind it, was played.
        shape = list(itertools.accumulate(n / (d + SHAPE_PRIOR) for n, d in zip(s.num, s.den)))
        scale = s.level + SHAPE_PRIOR
        seen = [j for j in range(G) if s.seen[j] > 0]
        if not seen:
            tree = [0.0] * G
        else:
            tree = [(1.0 + x * scale) * self._pace(s, k) - 1.0 for k, x in enumerate(shape)]
            if fix is not None:
                tree = [x * f for x, f in zip(tree, fix)]
            j = seen[-1]
            step = tree[j] - (tree[j - 1] if j > 0 else 0.0)
            for k in range(j + 1, G):
                step *= 0.7
                tree[k] = tree[k - 1] + max(step, 0.0)
            top = -math.inf
            for k in range(G):
                top = tree[k] = max(top, min(tree[k], self.caps[k]))
        chain = 0.0
        if s.chain_rows > 0:
            chain = self.chain_tokens(s) / (s.chain_base / s.chain_rows + SHAPE_PRIOR) * scale
            chain = min(chain * (fix[G] if fix is not None else 1.0), self.depth)
        return tree, chain

    def chain_tokens(self, s: ClassStats) -> float:
        """The chain's expected kept tokens a row, from the rounds' walks along the spine: the
        chain's draft is the tree's spine (the best children), and the target's pick at a depth
        is the same in both, so a tree round's run is exactly the chain's, or, where it reached
        the end of the tree's spine, a lower bound. Per depth d, of the rows known to reach d
        (a lower bound counts up to its own depth), the share that stopped there gives the chance
        of going on; the product of those chances, summed over depths, is the expectation (the
        Kaplan-Meier estimate). Where less than a row has
        reached a depth, the rest of the row stops there: past the spines measured, the chain
        counts for nothing until its own rounds (exact to its depth) or deeper spines reach
        there. Extrapolated instead with the chance at the depth before, the opening's few rows
        (the spine of the tree of 16 ends after a handful of nodes, and easy rows reach its
        end) put the chain at 8-11 tokens on the demo pair at T = 0, c = 4, where it accepts
        5.6, and it took the first dozen rounds from the tree of 8, 14% faster there.

        Measured in its own rounds only, the chain rested on the few rounds exploration gave it:
        on the demo pair at T = 0, c = 1 two engines of three had 18-19 rows of it after 380
        rounds, and estimated it at 4.8-5.2 tokens where the fixed dflash accepted 5.6 (trees
        took 95% of their rounds at 0.95-0.96x dflash)."""
        alive, total = 1.0, 0.0
        for reach, stops in zip(s.reach, s.stops):
            alive *= 1.0 - (stops + max(0.0, 1.0 - reach)) / max(reach, 1.0)
            total += alive
        return total

    @staticmethod
    def _pace(s: ClassStats, j: int) -> float:
        """Tree column j's tokens per round when played, over its average in the rounds that
        measured it. Those rounds start where the arms played put them, and a bigger tree (or
        the chain) moves through a run of easy text in fewer rounds than column j would: its
        rounds start there less often than j's own would, and j's average over them comes out
        low. Weighting each measured row by the tokens its round covered over what j would have
        covered there gives j's own rounds (exact where acceptance holds steady over a round's
        span; the played column's factor is 1). On the demo pair at T = 0, c = 4, the tree of 8
        averaged 4.17 tokens over the tree of 24's rounds and 4.05 over the tree of 15's, where
        its own rounds accepted 4.36: this takes the first to 4.28."""
        if s.steps[j] <= 0 or s.plain[j] <= 0:
            return 1.0
        return s.cover[j] / (s.steps[j] * s.plain[j])

    def chain_column(self) -> int:
        return int(np.searchsorted(self.grid, self.depth))

    def _estimate(self, cls: int) -> tuple[list[float], float]:
        """accepted(cls), recomputed only after an observation."""
        s = self._class(cls)
        if s.changed:
            s.estimate, s.changed = self.accepted(cls), False
        return s.estimate

    def rates(self, cls: int, rows: int, seconds: dict[int, float], ar_seconds: float,
              speculative: int | None = None, scale: float = 1.0) -> dict[int, float]:
        """Predicted tokens per second of every arm that fits (`seconds`: arm -> round seconds),
        `speculative` of the rows drafting in its rounds (all of them by default), with the
        accepted tokens scaled (at most the chain's depth) to another level (lead)."""
        tree, chain = self._estimate(cls)
        if scale != 1.0:
            tree = [min(self.depth, scale * x) for x in tree]
            chain = min(self.depth, scale * chain)
        k = rows if speculative is None else speculative
        out = {AR_ARM: rows / ar_seconds}
        for arm, sec in seconds.items():
            if arm != AR_ARM:
                out[arm] = (rows + k * (chain if arm == CHAIN_ARM else tree[arm])) / sec
        return out

    # ---- the choice --------------------------------------------------------------------------

    def choose(self, cls: int, rows: int, seconds: dict[int, float], ar_seconds: float,
               timed: dict[int, int] | None = None, speculative: int | None = None) -> int:
        """The arm to play: AR_ARM, CHAIN_ARM or a tree column.
        timed: rounds behind each arm's seconds at this batch size (modelled ones: 0; None: all
        trusted). speculative: rows that may draft (the others take AR steps in any arm)."""
        s = self._class(cls)
        self.probing = False  # set when the arm returned is a probe from AR steps
        self.timing = False  # ... or AR steps played to time them while drafting leads
        self.retime = False  # ... a probe drafting every row, its price at this batch size thin
        s.keep = (0, 0, AR_ARM, 0.0, 0.0)
        drafting = [a for a in seconds if a != AR_ARM]
        if not drafting:
            return AR_ARM
        if s.rounds < COLD_ROUNDS:
            if s.rounds and s.gap == 1 and timed is not None and timed.get(AR_ARM, TIMED) < TIMED:
                # The opening's AR steps are timed between its drafting rounds, not after them:
                # on a shared machine the speed changes by the second, and AR's price is only
                # worth its ratio to the drafting arms' (see the timing below).
                return self._time_ar(s)
            cheapest = min(seconds[a] for a in drafting)
            trees = [a for a in drafting if a >= 0 and seconds[a] <= COLD_COST * cheapest]
            if trees:
                return max(trees)
            return min(drafting, key=lambda a: seconds[a])
        rates = self.rates(cls, rows, seconds, ar_seconds, speculative)
        known = self._known(s, rates)
        # Drafting must beat AR steps by a margin: near parity the noise of its estimate, and the
        # held-back context its first round appends, decide.
        best = max(known, key=lambda a: known[a] * (1.0 if a == AR_ARM else 1.0 / self.margin))
        tied: list[int] = []  # trees the tie rule passed over for the cheapest
        if best != AR_ARM:
            s.probes = 0
            # Trees near a tie: the cheapest. Estimates err by a few percent, and the bigger a
            # tree the more its tokens rest on extrapolated increments and deep, streaky nodes.
            # On the demo pair at T = 0, c = 4, trees of 8 to 15 were predicted within 1% of each
            # other, the tree of 12 was played, and ddtree-8 ran 5-8% faster. (Not the chain:
            # it is measured only where it is played, and at c = 1, where it wins, a cheaper
            # tree near it took its rounds.)
            if best >= 0:
                bar = known[best] / TIE
                tied = [a for a in known if a >= 0 and known[a] >= bar]
                best = min(tied, key=seconds.get)
            if s.best in known and s.best != AR_ARM and known[s.best] * self.stay >= known[best]:
                best = s.best
            s.best = best
        a, since, ref = s.settle.get(rows, (None, 0, 0.0))
        if a != best or not ref / SETTLE_MOVE <= known[best] <= ref * SETTLE_MOVE:
            since = s.clock
            s.settle[rows] = (best, since, known[best])
        # Optimism where an arm's acceptance or its seconds at this batch size rest on few rounds.
        timed = timed or {}
        hope = {a: rates[a] * (1.0 + 1.0 / math.sqrt(1.0 + self._evidence(s, a, timed.get(a, TIMED))))
                for a in drafting}
        share = self.explore_share * settled(s.clock - since)
        # From AR steps the probe is the best drafting arm, hopeful only where its acceptance rests
        # on few rounds: its seconds are new at every batch size a draining batch passes through,
        # and counting that would make every such round a free probe.
        probe = max(drafting, key=rates.get)
        hopeful = rates[probe] * (1.0 + 1.0 / math.sqrt(1.0 + self._seen(s, probe)))
        if best == AR_ARM:  # exploration shrinks with how far that arm trails, hopefully
            top = hopeful / rates[AR_ARM]
            share = PROBE_MIN + (self.explore_share - PROBE_MIN) * min(1.0, max(0.0, (top - 0.6) / 0.4)) ** 2
        s.credit = min(s.credit + share * seconds.get(best, ar_seconds), 8.0 * max(seconds.values()))
        if best != AR_ARM and timed.get(AR_ARM, TIMED) < TIMED:
            # AR steps never timed here are priced at a drafting arm's error of the cost model,
            # and only their own rounds correct that: on the demo pair at T = 0, c = 16 the trees
            # ran 1.5x the model and AR steps 0.97x, so AR was priced 65% high, never played, and
            # the tree of 8 was played at 0.75x their rate. Such a round costs a fraction of
            # an AR step, TIMED of them in all (their bias carries to other batch sizes), so
            # the credit does not wait for them: paid from it, they came 7 rounds apart.
            return self._time_ar(s)
        # Candidates: the next two drafting arms by hope, the chain (only its own rounds measure
        # it past the trees' spines: at T = 0, c = 1 the trees of 15 and 16 held both places, the
        # chain was explored in 11 rounds of 330 and kept an estimate 6% low, where it won), and
        # the biggest tree that costs at most COLD_COST times the best's round (it measures every
        # smaller tree too); the stalest of them is played, so no estimate goes unrefreshed.
        ranked = sorted((a for a in drafting if a != best), key=hope.get, reverse=True)
        plausible = ranked[:2]
        if best != AR_ARM and CHAIN_ARM in ranked and CHAIN_ARM not in plausible:
            plausible.append(CHAIN_ARM)
        wide = [a for a in drafting if a >= 0 and seconds[a] <= self.wide_cost * seconds[best]]
        if wide and best != AR_ARM and max(wide) != best:
            plausible.append(max(wide))
        # AR steps too, while they are near enough for their price to matter: timed only while
        # played, a price set by a few slow early rounds would stand for good. On the demo pair
        # at T = 0, c = 16 one fresh engine in three played the tree of 8 in 89-94% of its rounds
        # at 0.74-0.77x `ar`, its AR steps timed in its first rounds only.
        if best != AR_ARM and rates[AR_ARM] >= AR_RECHECK * rates[best]:
            plausible.append(AR_ARM)
        if plausible:
            # From AR steps: the best drafting arm, priced at its hopeful rate (cheap while
            # drafting may well pay, dear once it has shown it does not). Else the stalest
            # runner-up, the two most hopeful never timed at this batch size first.
            thin: dict[int, bool] = {}
            if best == AR_ARM:
                cand = probe
                floor = PROBE_PRICE if s.probes else 0.0
                price = seconds[cand] * max(floor, 1.0 - hopeful / rates[AR_ARM])
            else:
                # Among equals the cheapest: after a wide tree every smaller one is as stale, and
                # taking the wide one again (never timed at this batch size, so always first)
                # spent the credit at twice the best's round. On the demo pair at T = 0, c = 4
                # the tree of 8 was measured in 10 rounds of a run, and predicted 3.4 tokens for
                # the 4.4 the fixed ddtree-8 accepted.
                # Then the runners-up whose seconds rest on few of their own rounds: a tree is
                # measured inside every bigger tree's rounds but timed only in its own, so its age
                # says nothing of its price. On the demo pair at T = 0, c = 4 the tree of 8, played
                # in few rounds, was priced at the trees' pooled bias, 3% above its own rounds
                # (the model's error is partly additive: small trees' bias is larger), and the
                # trees of 4 and 6 took its rounds at 0.91-0.96x the fixed ddtree-8.
                # A switch is never free: one predicted within STAY of the best (or ahead of the arm
                # that stays) costs that share of its round, so it is explored from the credit
                # like the others, not every round its age passes one.
                floor = self.stay - 1.0
                cost = {a: seconds.get(a, ar_seconds) * max(floor, 1.0 - rates[a] / rates[best]) for a in plausible}
                thin = {a: a in ranked[:2] and timed.get(a, TIME_WINDOW) < THIN for a in plausible}
                # And the chain while its own rows are few and it may well be the best: only its
                # own rounds measure it past the trees' spines (chain_tokens counts nothing there
                # till then), where every tree round measures the smaller trees whole, so
                # stalest-first gave it one round in thirty. On the demo pair at T = 0, c = 1 it
                # rested on 11 rounds after 389 and was predicted 2% below the tree of 12, where
                # the fixed dflash ran 6% faster than ddtree-12; auto played trees in 55-97% of
                # its rounds in two engines of five (0.95x dflash).
                if CHAIN_ARM in plausible and s.weight[len(self.grid)] < CHAIN_THIN \
                        and hope[CHAIN_ARM] >= rates[best]:
                    thin[CHAIN_ARM] = True
                cand = max(plausible, key=lambda a: (a in ranked[:2] and timed.get(a, TIMED) < TIMED, thin[a],
                                                     self._age(s, a), -cost[a]))
                price = cost[cand]
            if (self._age(s, cand) > 1 or timed.get(cand, TIMED) < TIMED or thin.get(cand, False)) \
                    and s.credit >= price:
                s.credit -= price
                s.probes += best == AR_ARM
                self.probing = best == AR_ARM
                # A probe from AR steps drafts a few rows, which measures acceptance but not the
                # arm's price at this batch size, and only its own timed rounds correct that: on
                # a shared machine, the tree of 6 timed in three slow rounds stood at 1.9x AR's
                # ratio to the model (1.1x where they ran in the same seconds), and every round
                # after took AR steps. Until THIN of its rounds are timed here it drafts them all.
                self.retime = self.probing and timed.get(cand, TIME_WINDOW) < THIN
                return self._time_ar(s) if cand == AR_ARM else cand
            if best == AR_ARM and share > 0:
                # Nothing changes until the credit covers that probe: hold AR steps till then.
                per_round = share * seconds[AR_ARM]
                s.hold = (rows, min(HOLD_MAX, math.ceil((price - s.credit) / per_round)) - 1, per_round)
        if best != AR_ARM and s.rounds >= KEEP_AFTER:
            self._keep(s, rows, best, known, tied, share * seconds[best])
        return best

    def _time_ar(self, s: ClassStats) -> int:
        """AR steps played to time them (the policy marks the round timed)."""
        self.timing = True
        s.ar_at = s.clock
        return AR_ARM

    def _keep(self, s: ClassStats, rows: int, best: int, known: dict[int, float], tied: list[int],
              per_round: float) -> None:
        """Decide the next rounds ahead where the best drafting arm leads its rival (AR steps
        at the margin; not the trees its tie rule passed over) by KEEP_STEP per round: a round
        moves a shape by about a percent at most once its arm rests on a hundred rows, and the
        level scales every drafting arm alike. On the demo pair at T = 0, c = 1 the choice took
        0.16 ms a round in place (its caches cold after the forward), 60% of what auto adds to a
        chain round there, and auto forced onto the chain ran 2-4% behind the fixed dflash.
        Near a tie too, KEEP_MIN rounds: there the choice costs little either way, and at
        T = 0, c = 1 (the chain and the trees of 12-16 within a few percent) every round chose."""
        rival = max((r * (self.margin if a == AR_ARM else 1.0) for a, r in known.items()
                     if a != best and a not in tied), default=0.0)
        ahead = KEEP_MAX if rival <= 0 else min(KEEP_MAX, max(KEEP_MIN, int((known[best] / rival - 1.0) / KEEP_STEP)))
        if ahead > 0:
            # s.estimate is fresh: choose has just priced the arms.
            s.keep = (rows, ahead, best, per_round, arm_value(s.estimate, best))

    def kept(self, cls: int, rows: int) -> int | None:
        """The drafting arm decided ahead for this round (see _keep), or None: choose decides."""
        s = self._class(cls)
        if s.keep[1] <= 0 or s.keep[0] != rows:
            return None
        s.keep = (rows, s.keep[1] - 1) + s.keep[2:]
        s.credit += s.keep[3]
        self.probing = False
        return s.keep[2]

    def lead(self, cls: int, rows: int, seconds: dict[int, float], ar_seconds: float) -> float:
        """AR's predicted rate over the best measured drafting arm's at these prices (0 while the
        class has too little evidence): Policy.admit asks it for the batch a request joins. A
        seat lasts the request's life, so drafting is judged at the class's long-run level, not
        the recent one: a cold stretch of acceptance must not seat requests plain for good."""
        s = self.stats.get(cls)
        # Hopeful while the estimates rest on few rows: x 1 + 1 / sqrt(1 + rows) on a drafting
        # arm's rate. A seat is for life, and a plain request adds no evidence. Without the hope,
        # on the demo pair at T = 0, c = 1, AR steps led by 1.03-1.14 on the estimates of seven
        # drafting rounds (the chain at 2.4 tokens, where it accepts 5.6), and every request
        # seated from then on took AR steps (at c = 4, after the three opening rounds, AR steps
        # led by 1.23 where drafting won by 12%). By rounds, as this release first had it
        # (1 + 1 / sqrt(1 + rounds)), the hope lasted where few rounds draft: at T = 0, c = 16,
        # where AR steps lead by about 15%, no request was seated plain and auto ran at
        # 0.90-0.93x `ar` (0.98x by rows, 176 of its 192 requests seated while the class was
        # settled on AR steps).
        # The rows are the class's, every drafting round's, not each arm's: the level, which
        # scales every arm alike, is what few rounds leave uncertain, and an arm's own rows can
        # stay few for good. By the arm's, at T = 0.7, c = 1 the chain (never played, its rows
        # 0: a hope of 2) and the trees of 6 and up (measured in the three opening rounds only:
        # 1.4-1.5) kept the lead at 0.77-0.82 where AR steps ran 1.5x the best tree: every request
        # was seated speculative, and auto ran at 0.94-0.97x `ar`.
        if s is None or s.rounds < COLD_ROUNDS:
            return 0.0
        scale = (s.long_level + SHAPE_PRIOR) / (s.level + SHAPE_PRIOR)
        rates = self.rates(cls, rows, seconds, ar_seconds, scale=scale)
        drafts = [r for a, r in self._known(s, rates).items() if a != AR_ARM]
        if not drafts:
            return 0.0
        return rates[AR_ARM] / (max(drafts) * (1.0 + 1.0 / math.sqrt(1.0 + s.rows)))

    def _known(self, s: ClassStats, rates: dict[int, float]) -> dict[int, float]:
        """The rates whose estimates rest on KNOWN rounds or more (AR's always; the chain is
        measured in every drafting round)."""
        return {a: r for a, r in rates.items() if a == AR_ARM or self._seen(s, a) >= KNOWN}

    def held(self, cls: int, rows: int) -> bool:
        """Another AR round of a hold (see choose): nothing to compute, the credit accrues."""
        s = self._class(cls)
        if s.hold[1] <= 0 or s.hold[0] != rows:
            return False
        s.hold = (rows, s.hold[1] - 1, s.hold[2])
        s.credit += s.hold[2]
        self.idle(cls)
        return True

    def _evidence(self, s: ClassStats, arm: int, timed: int) -> float:
        """Rounds behind an arm's rate: its acceptance measurements, or its timed rounds at this
        batch size while those are fewer than TIMED."""
        seen = self._seen(s, arm)
        return seen if timed >= TIMED else min(seen, timed)

    def _slot(self, arm: int) -> int:
        """The arm's entry in a ClassStats list: tree columns first, then the chain."""
        return len(self.grid) if arm == CHAIN_ARM else arm

    def _seen(self, s: ClassStats, arm: int) -> float:
        return float(s.seen[self._slot(arm)])

    def _age(self, s: ClassStats, arm: int) -> float:
        """Rounds since the arm was last measured or last played, whichever is older. A tree is
        measured in every bigger tree's round but timed only in its own: by measurement alone
        the trees below the one played were never stale, their prices rested on rounds from
        other stretches, and on the demo pair at T = 0, c = 1 one engine of five played the tree
        of 32, priced 2% above the tree of 16 where the fixed cells ran it 26% dearer (0.85x
        dflash)."""
        if arm == AR_ARM:
            return float(s.clock - s.ar_at)
        i = self._slot(arm)
        return float(s.clock - min(s.measured_at[i], s.played_at[i]))

    def predicted(self, cls: int, arm: int) -> float:
        """The arm's expected drafted tokens accepted per row. In rounds decided ahead (kept), the
        estimate they were decided with: recomputing it after each of their observations was
        most of a kept round's plan, for the stats alone."""
        if arm == AR_ARM:
            return 0.0
        s = self._class(cls)
        if s.changed and s.keep[0] and s.keep[2] == arm:
            return s.keep[4]
        return arm_value(self._estimate(cls), arm)

    # ---- learning ----------------------------------------------------------------------------

    def observe(self, cls: int, rows: int, tree: list[list[float]] | np.ndarray | None, run: np.ndarray | list,
                kept: list[int] | None = None, chain: list[tuple[int, bool]] | None = None,
                steady: list[bool] | None = None) -> None:
        """One drafting round of `rows` rows. run [rows]: the accepted path's run along the spine
        (a chain round: the chain's accepted tokens). tree [rows, cols]: a tree round's accepted
        tokens at each tree column it measured (None: a chain round), as the requests keep them
        (Policy.observe cuts them at each row's room). kept [rows]: a chain round's accepted
        tokens as kept (default: run). chain [rows]: a tree round's measure of the chain, the
        tokens it would have kept and whether that is exact (else a lower bound: the run reached
        the end of the tree's spine; default: every run, exact). The base is the walk's, uncut:
        it is the level every arm is scaled by, and a request's last round says nothing about the
        text's acceptance. steady [rows]: whether the row's previous round played this arm too (its
        round starts where the arm's own rounds do): those rows go to the arm's own record
        (own_fix)."""
        s = self._class(cls)
        G = len(self.grid)
        s.clock += 1
        s.rounds += 1
        s.rows += rows
        s.changed = True
        s.hold = (0, 0, 0.0)
        run = run.tolist() if isinstance(run, np.ndarray) else run
        b = sum(min(r, BASE_DEPTH) for r in run) / len(run)
        # After a stretch of AR steps the level is stale: this round's news counts for the rounds
        # missed (up to STALE_WEIGHT), or one probe would hardly move a level that fell in a
        # cold stretch, and the class would stay on AR steps long after the stretch ended.
        weight = 1.0 - (1.0 - RATE) ** (rows * min(s.gap, STALE_WEIGHT))
        s.level = b if s.rounds == 1 else s.level + weight * (b - s.level)
        long = max(1.0 - (1.0 - LONG_RATE) ** rows, 1.0 / s.rounds)
        s.long_level += long * (b - s.long_level)
        s.gap = 1
        s.played_at[len(tree[0]) - 1 if tree is not None and len(tree[0]) else G] = s.clock
        if tree is not None and len(tree[0]):
            # Per column, what it accepts over the next smaller one, measured in the same rounds
            # (one round measures both exactly): a column's own average over the rounds that
            # reached it drifts from its neighbour's, which were other rounds. On the demo pair at
            # T = 0, c = 1 the tree of 12 had measured 2.03 x the base and the tree of 15 1.73 x:
            # the tree of 12 was predicted 5.3 tokens where its own rounds accepted 4.2, and every
            # bigger tree as much (a bigger tree never accepts less).
            # (Plain Python: between two forwards each numpy call costs ~10 us, and this ran at
            # 145 us a round as numpy.)
            table = tree.tolist() if isinstance(tree, np.ndarray) else tree
            n = len(table)
            x = [sum(col) / n for col in zip(*table)]
            self._fold(s, 0, [x[0]] + [x[j] - x[j - 1] for j in range(1, len(x))], b, rows)
            cover = [1.0 + r[-1] for r in table]  # the played tree's tokens per row (its column is the last)
            steps = [sum(c / (1.0 + v) for c, v in zip(cover, col)) / n for col in zip(*table)]
            step = 1.0 - (1.0 - self.shape_rate) ** rows
            c = sum(cover) / n
            for j, (h, m) in enumerate(zip(steps, x)):
                u = max(step, rows / s.weight[j])  # as _fold's (which counted this round already)
                s.cover[j] += u * (c - s.cover[j])
                s.steps[j] += u * (h - s.steps[j])
                s.plain[j] += u * (1.0 + m - s.plain[j])
        else:
            s.weight[G] += rows
            chain = [(k, True) for k in (run if kept is None else kept)]
        if steady is not None and s.raw_estimate:
            played = tree is not None and len(tree[0])  # a chain round only fades the records (own_fix)
            self._fold_own(s, len(tree[0]) - 1 if played else CHAIN_ARM,
                           [r[-1] for r, st in zip(table, steady) if st] if played else [], rows)
        if chain is None:
            chain = [(k, True) for k in run]
        self._fold_chain(s, chain, b, rows)

    def _fold_own(self, s: ClassStats, arm: int, got: list[float], rows: int) -> None:
        """Steady rows of the arm played: what they kept, and what the uncorrected estimate the
        round was chosen with predicted (see own_fix). Every arm's record fades with the class's
        rows (at LONG_RATE), so a ratio learned in one stretch of text, or while the estimates
        lagged a change of acceptance, does not stand for good over an arm no longer played."""
        keep = (1.0 - LONG_RATE) ** rows
        s.own = [keep * x for x in s.own]
        s.raw = [keep * x for x in s.raw]
        if got:
            i = self._slot(arm)
            s.own[i] += sum(got)
            s.raw[i] += len(got) * arm_value(s.raw_estimate, arm)

    def _fold_chain(self, s: ClassStats, chain: list[tuple[int, bool]], base: float, rows: int) -> None:
        """The round's measure of the chain (see chain_tokens) into the class's slow sums."""
        D = self.depth
        last = [0.0] * D  # rows whose last depth known reached is d
        stopped = [0.0] * D
        for tokens, exact in chain:
            k = min(int(tokens), D)
            # (A fractional count is an average: its rows stop at the integers either side.)
            for n, w in ((k, 1.0 - (tokens - k)), (k + 1, tokens - k)) if k < tokens else ((k, 1.0),):
                if exact and n < D:
                    last[n] += w
                    stopped[n] += w
                elif n > 0:
                    last[min(n, D) - 1] += w
        keep = (1.0 - self.shape_rate) ** rows
        reached = list(itertools.accumulate(reversed(last)))[::-1]  # rows known to reach d
        s.reach = [keep * x + n for x, n in zip(s.reach, reached)]
        s.stops = [keep * x + n for x, n in zip(s.stops, stopped)]
        s.chain_rows = keep * s.chain_rows + rows
        s.chain_base = keep * s.chain_base + base * rows
        i = self._slot(CHAIN_ARM)
        s.seen[i] += 1
        s.measured_at[i] = s.clock

    def _fold(self, s: ClassStats, first: int, xs: list[float], base: float, rows: int) -> None:
        """Entries first.. take the round's accepted tokens xs and its base."""
        step = 1.0 - (1.0 - self.shape_rate) ** rows
        for i, x in enumerate(xs, first):
            s.weight[i] += rows
            w = max(step, rows / s.weight[i])  # a plain average (by rows) until the EMA takes over
            s.num[i] += w * (x - s.num[i])
            s.den[i] += w * (base - s.den[i])
            s.seen[i] += 1
            s.measured_at[i] = s.clock

    def idle(self, cls: int) -> None:
        """A round of AR steps for this class: its information ages."""
        s = self._class(cls)
        s.clock += 1
        s.gap += 1


def settled(held: int) -> float:
    """The exploration share's factor once the best arm has held `held` rounds (SETTLE): exploring
    keeps estimates fresh where arms are close, and the longer one arm stays the best, the less
    likely a stale estimate is hiding a better one (as the bonus of a confidence bound shrinks)."""
    return min(1.0, max(SETTLE_FLOOR, math.sqrt(SETTLE / max(held, 1))))


def by_size(codes: list[int], sizes: list[int]) -> tuple[list[int], int, bool]:
    """What one tree round measured, from its accepted path's codes (runner.path_codes: per node,
    root first, 4 x its rank in the tree's order + 2 where it has a child in the tree + 1 where
    it is its parent's best child; -1 past the path): the drafted tokens the top-b tree would
    have accepted, for each b in sizes; the path's run along the spine; and whether the run
    reached the end of the tree's spine, where the chain of best children (the chain's draft)
    goes on unmeasured (else the run is exactly what the chain would have accepted).

    Exact (tree/value.py accepted_by_size says why): the top-b tree holds the nodes ranked 1..b,
    and ranks grow along a path (a child never outranks its parent), so it accepts the path's
    nodes ranked b or better. A spine node with a child in the tree has its best child there."""
    ranks = []
    run, spine, last = 0, True, codes[0]
    for c in codes[1:]:
        if c < 0:
            break
        ranks.append(c >> 2)
        spine = spine and bool(c & 1)
        if spine:
            run += 1
            last = c
    return [bisect.bisect_right(ranks, b) for b in sizes], run, spine and not last & 2


def arm_value(estimate: tuple[list[float], float], arm: int) -> float:
    """A drafting arm's entry in an estimate (accepted(): the trees' list, the chain's value)."""
    return estimate[1] if arm == CHAIN_ARM else estimate[0][arm]


def median(values) -> float:
    """statistics.median, without its type dispatch (it runs on every timed round)."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class ArmTimes:
    """What each arm's rounds cost, per batch size, as three factors: the cost model's seconds,
    the machine's load, and the arm's bias. The load is the median of the last LOAD_WINDOW timed
    rounds' seconds over the model's, each divided by its arm's bias. An arm's bias is the median
    of its last TIME_WINDOW rounds' ratios over the load of their time (robust to a slow round),
    once TIMED of them are in; an arm with fewer takes the bias of the timed drafting arm
    nearest to it (the model's error depends on the shape: a global scale priced the tree of 8
    a third too high on the demo pair). A tree's median leans on the median of every tree's
    rounds at that batch size until its own rounds add up (TREE_PRIOR): three rounds are a
    noisy median, and on the demo pair at T = 0, c = 4 the tree of 8 stood 18% above its fixed
    method's rounds from four of them (the tree of 24 was played), the tree of 6 at 1.29.

    Arms are played in different stretches, and on a shared machine stretches run at different
    speeds. Priced by their own rounds' medians, on the demo pair at T = 0, c = 4, the tree of 8
    stood 18% above what the fixed ddtree-8 measured in the same minutes, from three rounds
    played early on, and the chain was played in its place."""

    def __init__(self, window: Callable[[int], int]) -> None:
        self.window = window  # arm -> the verify window it runs (nearest windows share model errors)
        self.rounds: dict[tuple[int, int], deque] = {}  # per (rows, arm): its rounds' ratios over the load
        self.bias: dict[tuple[int, int], float] = {}
        self.own: dict[int, dict[int, tuple[float, int]]] = {}  # per batch size, per tree: its median, rounds
        self.trees: dict[int, deque] = {}  # per batch size: every tree round's ratio over the load
        self.stale: set[tuple[int, int]] = set()  # keys with rounds newer than their bias
        self.ar_sizes: set[int] = set()  # batch sizes where AR steps have a bias
        self.load = 0.0  # seconds over the model's, for an arm of bias 1 (0: nothing timed yet)
        self.recent: deque = deque(maxlen=LOAD_WINDOW)  # the last rounds' load
        self._near: dict[tuple[int, tuple[int, ...]], list[int]] = {}

    def record(self, rows: int, arm: int, seconds: float, modelled: float) -> None:
        """A round of `arm` at `rows` took `seconds`; the model priced it `modelled`. Runs every
        round, so the bias waits until a plan asks (held AR rounds ask nothing)."""
        if seconds <= 0 or modelled <= 0:
            return
        ratio = seconds / modelled
        key = (rows, arm)
        if not self.load:
            self.load = ratio
        elif key in self.bias:  # an arm without a bias yet tells nothing about the load
            self.recent.append(ratio / self.bias[key])
            self.load = median(self.recent)
        # Taken after the load moved: a lasting change of speed shows in the next few ratios
        # only, which the bias's median passes over, and goes to the load.
        if key not in self.rounds:
            self.rounds[key] = deque(maxlen=TIME_WINDOW)
        self.rounds[key].append(ratio / self.load)
        if arm >= 0:
            if rows not in self.trees:
                self.trees[rows] = deque(maxlen=2 * TIME_WINDOW)
            self.trees[rows].append(ratio / self.load)
        self.stale.add(key)

    def _update(self) -> None:
        sizes = set()
        for key in self.stale:
            ratios = self.rounds[key]
            if key[1] >= 0:
                self.own.setdefault(key[0], {})[key[1]] = (median(ratios), len(ratios))
                sizes.add(key[0])
            elif len(ratios) >= TIMED:
                self.bias[key] = median(ratios)
                if key[1] == AR_ARM:
                    self.ar_sizes.add(key[0])
        for rows in sizes:  # the trees' pooled median moved: every tree's bias at this size
            pool = self.trees[rows]
            prior = median(pool) if len(pool) >= TIMED else None
            for arm, (mid, n) in self.own[rows].items():
                if prior is not None:
                    self.bias[rows, arm] = (n * mid + TREE_PRIOR * prior) / (n + TREE_PRIOR)
                elif n >= TIMED:
                    self.bias[rows, arm] = mid
        self.stale.clear()

    def counts(self, rows: int, arms) -> dict[int, int]:
        """Timed rounds behind each arm's seconds at this batch size; AR's, where it has none
        here, those of the batch size its bias comes from (seconds)."""
        out = {a: len(self.rounds.get((rows, a), ())) for a in arms}
        if AR_ARM in out and (rows, AR_ARM) not in self.bias:
            near = self._ar_size(rows)
            if near is not None:
                out[AR_ARM] = len(self.rounds[near, AR_ARM])
        return out

    def _ar_size(self, rows: int) -> int | None:
        """The batch size nearest to rows where AR steps have a bias, or None."""
        if not self.ar_sizes:
            return None
        return min(self.ar_sizes, key=lambda r: (abs(math.log(r / rows)), r))

    def seconds(self, rows: int, modelled: dict[int, float]) -> dict[int, float]:
        """Seconds per arm at this batch size: the model's times the load times the arm's bias
        (AR's from the nearest batch size it was timed at; else the nearest timed drafting
        arm's; 1 with nothing timed at all)."""
        self._update()
        if not self.load:
            return dict(modelled)
        bias = self._biases(rows, modelled)
        if AR_ARM in modelled and AR_ARM not in bias:
            # AR steps' own error of the model, from another batch size, before a drafting
            # arm's: a plain verify is the model's simplest shape, a tree's error says little.
            near = self._ar_size(rows)
            if near is not None:
                bias[AR_ARM] = self.bias[near, AR_ARM]
        arms = tuple(modelled)
        out = {}
        for a, m in modelled.items():
            b = bias.get(a)
            if b is None:
                b = next((bias[x] for x in self._nearest(a, arms) if x in bias), 1.0)
            out[a] = m * self.load * b
        return out

    def _biases(self, rows: int, modelled: dict[int, float]) -> dict[int, float]:
        """The arms' biases at this batch size; while no drafting arm has one here, the nearest
        timed batch size's fill in (a draining batch passes through sizes never timed). Priced
        at the bare model instead, while AR's timed rounds carried the load, drafting looked
        cheaper at each new size by as much as the machine ran slower than the model."""
        own = {a: self.bias[rows, a] for a in modelled if (rows, a) in self.bias}
        if any(a != AR_ARM for a in own):
            return own
        sizes = {r for r, a in self.bias if a != AR_ARM}
        if not sizes:
            return own
        near = min(sizes, key=lambda r: (abs(math.log(r / rows)), r))
        return {a: self.bias[near, a] for a in modelled if (near, a) in self.bias} | own

    def _nearest(self, arm: int, arms: tuple[int, ...]) -> list[int]:
        """The drafting arms by how near they are to arm: trees before the chain for a tree (the
        chain builds no tree, so its model error says little about a tree's), then by window
        (sorted once per arm set). By window alone the tree of 8 took the chain's bias, 1.5 from
        three slow rounds, and the tree of 16 was played in its place, 10% slower."""
        key = (arm, arms)
        if key not in self._near:
            w = self.window(arm)
            self._near[key] = sorted((a for a in arms if a != AR_ARM),
                                     key=lambda x: ((x == CHAIN_ARM) != (arm == CHAIN_ARM),
                                                    abs(math.log(self.window(x) / w))))
        return self._near[key]

