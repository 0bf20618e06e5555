"""The speculation policy (budget="auto"): each round, plain AR steps (no drafter call), the
chain, or a tree of size b, whichever maximises the batch's predicted tokens per second.

A batch whose requests sample alike (one sampling class, the usual case) is planned by the
selector (selector.py): the arm that has measured best, every row alike, as the fixed methods'
own plans. A mixed batch is planned per request by the split, described here:

    rate = (R + sum over drafting rows of E_r) / seconds(plan)

E_r is the calibrated expected number of drafted tokens the target accepts. Its raw material is
what drafts of that request left behind, read back with each round's one read: the drafter's
spine reach per depth (prefix probability of the top-1 path) and, for a tree, per grid size b
how many spine nodes the top-b tree holds and how much raw reach its branch nodes add. The
current calibration (calibration.py) turns these into E at plan time:

    chain(l) = sum_{d <= l} min(1, beta[d, spine] * reach_d)
    tree(b)  = chain(spine nodes in the top-b tree) + beta_branch * branch reach(b)

so a correction learned later applies to old drafts too. A draft's confidence swings from round
to round, so the spine forecast blends the last draft's reach with the request's running mean
(which starts from its class's), the last one's weight fading while the request takes AR steps;
tree structure comes from the means. Sizes past those seen are extrapolated (geometric
increments, at ratios learned from trees that were that big). seconds(plan) is the cost model's.

A batch verifies one window for all its rows (shorter rows are padding), so the round's node
budget is spent by widening everyone's window: for each window on the grid, rows are taken in
order of gain while the next one pays for its share of the drafter pass, and the best (window,
rows) pair wins. As the batch grows, a wider window costs more nodes per row of gain, so the
window shrinks, then rows drop to AR, with no rule for it.

Decisions use only what the previous round's one read brought back. They explore where the
estimates rest on little: each request's gain is scaled by a draw from Gamma(n, 1/n) (mean 1,
variance 1/n), n the evidence behind its calibration (Thompson-style), so one unlucky round
does not lock a request out of speculating, while a class that has shown many times that its
drafts do not pay (T = 1 with a weak drafter) is hardly ever drafted for. On top of that,
requests that stopped drafting are probed now and then (a speculative round chosen only to
learn), paid from a credit of a share of the time spent that grows with how often the class's
drafts win big (see PROBE_MAX): streaks start unseen while a request takes AR steps.

When a batch is clearly better off on AR steps, the plan holds for a few rounds (more the
clearer it is), so that steady state costs almost no host time per round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from flashtree.engine.calibration import Calibration, sampling_class
from flashtree.engine.cost_model import CostModel
from flashtree.engine.selector import AR_ARM, CHAIN_ARM, ArmTimes, Selector
from flashtree.engine.sequence import Request

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
AR, CHAIN, TREE = 0, 1, 2
MODE_NAMES = ("ar", "chain", "tree")
# Probes: speculative rounds the forecast does not expect to pay, paid from a credit of a share of
# round time. A class's share follows how often its drafted rows win big (a round at least twice
# AR's rate): acceptance comes in long streaks (a greedy request falling into a copy), a streak's
# start cannot be seen from AR steps, and the rounds it would have won are where speculation earns
# most; so a class that wins big often re-tests every few rounds, and one whose drafts never pay
# (T = 1 with a weak drafter) hardly at all.
PROBE_MIN, PROBE_MAX = 0.002, 0.25
BIG_WIN_RATE, BIG_WIN_PRIOR, BIG_WIN_FULL = 0.1, 0.0, 0.2  # EMA weight per row, its start, the rate at PROBE_MAX
RHO_PRIOR = 0.8  # increment ratio between grid sizes before any tree that big was seen
SPINE_PRIOR = 0.7  # per-depth spine reach ratio assumed for a class nobody has drafted in yet
POOL_RATE = 0.1  # EMA weight of one row in a class's pooled curves
MEAN_RATE = 0.5  # EMA weight of one round in a request's mean curves
LAST_WEIGHT, LAST_FADE = 0.8, 0.8  # the last draft's share of the forecast, and its fade per AR round
OWN_FADE = 0.8  # per AR round, the request's own data yields to its class's in the forecast
STREAK_DECAY, STREAK_PRIOR = 0.5, 1.0  # the request's recent accepted / forecast ratio (see observe)
CHAIN_MARGIN = 1.3  # a chain row must forecast this many times the tree's accepted tokens
RECORD_DECAY, RECORD_PRIOR = 0.97, 4.0  # chains' accepted / planned record per class: fade per round, prior
MAX_HOLD = 64  # rounds an all-AR plan may be reused without re-planning
HELD_RATE = 0.1  # EMA weight of one append in the seconds per held-back token (Policy.timed)
PROBE_ROWS = 0.25  # share of a batch's rows a probe from AR steps drafts (at least one)
SETTLED_LEAD = 1.0  # AR steps this many times drafting's long-run rate: the class is settled on them (admit)
SCOUT_EVERY = 8  # requests seated while their class is settled on AR steps: one in this many may draft
SCOUT_MAX = 64  # ... or, where AR steps lead by more than SETTLED_LEAD, one in up to this many (admit)
SCOUT_ROWS = 4  # ... of a batch of up to this many rows; of a bigger one, fewer in proportion (admit)


@dataclass
class RoundPlan:
    """What one round does, per batch row, and what the policy expects of it."""

    modes: list[int]  # AR, CHAIN or TREE per batch row
    window: int = 1  # nodes per row in the verify (root included)
    budget: int = 0  # tree rows' drafted nodes
    chain: int = 0  # chain rows' drafted nodes
    depth: int = 0  # draft positions the LM head scores
    draft_rows: list[int] = field(default_factory=list)  # tree rows first, then chain rows
    tree_rows: int = 0
    predicted: list[float] = field(default_factory=list)  # per batch row: expected accepted drafted tokens
    seconds: float = 0.0
    probes: list[int] = field(default_factory=list)
    ar_seconds: float = 0.0  # what the round would have taken on AR steps only (auto)
    learn: bool = False  # read back curves and calibration data (auto only)
    column: int = 0  # the window's grid index (auto only)
    arm: int | None = None  # the selector's arm (selector.py), for a batch whose requests sample alike
    cls: int = 0  # ... and their sampling class
    measure: int = 0  # tree columns whose accepted tokens the round reads back for the selector
    timed: bool = False  # AR steps played to time them (Selector.choose): always learned from
    steady: list[bool] | None = None  # per drafting row: its request's previous round played this arm too (auto)

    @property
    def drafting(self) -> int:
        return len(self.draft_rows)

    def label(self, row: int) -> str:
        return MODE_NAMES[self.modes[row]]

    def size(self, row: int) -> int:
        """Drafted nodes the row verifies (0 for AR)."""
        return {AR: 0, CHAIN: self.chain, TREE: self.budget}[self.modes[row]]


def fixed_plan(rows: int, method: str, block_size: int, budget: int) -> RoundPlan:
    """Every row drafts alike: the chain (dflash), a tree of `budget` nodes (ddtree) or nothing (ar)."""
    if method == "ar":
        return RoundPlan([AR] * rows, predicted=[0.0] * rows)
    if method == "dflash":
        n = block_size - 1
        return RoundPlan([CHAIN] * rows, window=block_size, chain=n, depth=n, draft_rows=list(range(rows)),
                         predicted=[0.0] * rows)
    return RoundPlan([TREE] * rows, window=budget + 1, budget=budget, depth=min(budget, block_size - 1),
                     draft_rows=list(range(rows)), tree_rows=rows, predicted=[0.0] * rows)


class Policy:
    def __init__(self, cost: CostModel, slots: int, block_size: int, max_budget: int, max_round_tokens: int) -> None:
        self.cost = cost
        self.slots = slots
        self.depth = block_size - 1
        self.grid = np.array([b for b in GRID if b < max_budget] + [max_budget])
        if self.depth not in self.grid and self.depth < max_budget:
            self.grid = np.sort(np.append(self.grid, self.depth))
        self.max_round_tokens = max_round_tokens
        G, D = len(self.grid), self.depth
        self.calibration = Calibration(slots, D)
        self.owner: list[str | None] = [None] * slots
        self.cls = [0] * slots
        # Per slot: the last draft's spine reach per depth (NaN past the depth drafted), its
        # running mean, the tree structure per grid size (spine nodes in the top-b tree, branch
        # reach; NaN: no tree that big seen yet), and rounds since the last draft.
        self.reach = np.full((slots, D), np.nan)
        self.reach_mean = np.full((slots, D), np.nan)
        self.spine_nodes = np.full((slots, G), np.nan)
        self.branch = np.full((slots, G), np.nan)
        self.spine_nodes_last = np.full((slots, G), np.nan)  # the last tree draft's (NaN past its budget)
        self.branch_last = np.full((slots, G), np.nan)
        self.idle = np.zeros(slots)
        # The selector's AR rounds count as idle lazily (ticks since a slot's mark): a numpy
        # update per round cost 58 us on the cold caches between two forwards, 1% of an AR step
        # on the demo pair.
        self.ticks = 0
        self.tick_mark = np.zeros(slots)
        # Forecasts at every size [slots, G] (tree) and [slots, D] (chain), from the last draft
        # and from the means, refreshed when a slot's data or calibration changes (so a round
        # on AR steps costs a blend, not the calibration and extrapolation).
        self.fc_last_t = np.zeros((slots, G))
        self.fc_last_c = np.zeros((slots, D))
        self.fc_mean_t = np.zeros((slots, G))
        self.fc_mean_c = np.zeros((slots, D))
        self.fc_pool_t = np.zeros((slots, G))
        self.fc_pool_c = np.zeros((slots, D))
        self.has_last = np.zeros(slots, dtype=bool)
        # Recent accepted and same-round forecast tokens: the next round follows the last ones
        # more than any draft's own confidence says (acceptance comes in streaks).
        self.streak = np.zeros((slots, 2))
        self.last_seen = np.zeros(slots)
        self.pools: dict[int, dict[str, np.ndarray]] = {}
        self.rounds = 0
        self.credit = 0.0
        self.rate = 0.0  # the last plan's predicted tokens per second
        self._costs: dict[int, tuple[int, dict]] = {}
        self.rng = np.random.default_rng(0)
        self.hold: tuple[list[str], RoundPlan] | None = None  # an all-AR plan reused while the batch stays
        self.hold_left = 0
        self.next_probe = 0.0  # credit (seconds) the last unaffordable probe needed: a hold ends there
        self.held_cost = 0.0  # seconds per held-back drafter context token appended (timed)
        self.selector = Selector(self.grid, self.depth)  # batches whose requests sample alike (selector.py)
        self.sizes = [int(b) for b in self.grid]
        self.scouting: dict[int, float] = {}  # per class, scouts owed to the requests seated plain (admit)
        self._arms: dict[int, tuple[int, dict[int, float], dict[int, RoundPlan]]] = {}
        self.last_arm: list[tuple] = [()] * slots  # per slot: (request, arm, round) of its last drafting round
        self.times = ArmTimes(lambda arm: 1 if arm == AR_ARM else self.depth + 1 if arm == CHAIN_ARM
                              else int(self.grid[arm]) + 1)

    # ---- per-request state ---------------------------------------------------------------

    def _claim(self, req: Request) -> bool:
        """Start a new request's state from its class's (True); its forecasts are the caller's to
        refresh, so a round's new requests are refreshed together."""
        s = req.slot
        if self.owner[s] == req.request_id:
            return False
        self.owner[s] = req.request_id
        self.cls[s] = sampling_class(req.params)
        self.calibration.reset(s)
        pool = self._pool(self.cls[s])
        self.reach[s] = np.nan
        self.reach_mean[s], self.spine_nodes[s], self.branch[s] = pool["reach"], pool["spine_nodes"], pool["branch"]
        self.spine_nodes_last[s], self.branch_last[s] = np.nan, np.nan
        self.streak[s] = 0.0
        self.idle[s] = 0
        self.tick_mark[s] = self.ticks
        self.last_seen[s] = self.rounds
        return True

    def _pool(self, cls: int) -> dict[str, np.ndarray]:
        if cls not in self.pools:
            G, D = len(self.grid), self.depth
            spine_nodes, branch = np.full(G, np.nan), np.full(G, np.nan)
            spine_nodes[0], branch[0] = 1.0, 0.0  # the top-1 tree is the chain of one
            self.pools[cls] = {"reach": SPINE_PRIOR ** np.arange(1, D + 1), "spine_nodes": spine_nodes,
                               "branch": branch, "rho": np.full(G, RHO_PRIOR),
                               "record": np.zeros((2, 2)), "big_win": BIG_WIN_PRIOR}
        return self.pools[cls]

    def _calibrated(self, slots: list[int], reach: np.ndarray, spine_nodes: np.ndarray,
                    branch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tree [k, G] and chain [k, D] expected accepts from raw draft data, under each slot's
        current calibration, extended past the sizes seen."""
        classes = [self.cls[s] for s in slots]
        beta = self.calibration.beta(slots, classes, self.idle[slots])
        # No clamp at 1 per node: beta is a ratio of expected counts, and the forecast is one too.
        chain = np.minimum(np.cumsum(beta[:, :, 0] * extend_reach(reach), axis=1), np.arange(1, self.depth + 1))
        at = np.clip(np.nan_to_num(spine_nodes, nan=1.0).astype(int), 1, self.depth) - 1
        tree = np.take_along_axis(chain, at, 1) + self.calibration.branch_beta(slots, classes, self.idle[slots])[:, None] * branch
        rho = np.stack([self._pool(c)["rho"] for c in classes])
        return np.clip(extend_tree(tree, rho), 0.0, self.depth), chain

    def _refresh(self, slots: list[int]) -> None:
        """Recompute the forecasts of these slots: from their means, their classes' pools and their
        last drafts, in one calibrated pass (this runs every drafting round)."""
        k = len(slots)
        pools = [self._pool(self.cls[s]) for s in slots]
        last = self.reach[slots]
        has = ~np.isnan(last[:, 0])
        self.has_last[slots] = has
        # The last tree's structure where it was that big, the mean's beyond.
        sn, br = self.spine_nodes_last[slots], self.branch_last[slots]
        known = ~np.isnan(sn)
        reach = np.concatenate([self.reach_mean[slots], np.stack([p["reach"] for p in pools]),
                                np.where(has[:, None], last, self.reach_mean[slots])])
        spine = np.concatenate([self.spine_nodes[slots], np.stack([p["spine_nodes"] for p in pools]),
                                np.where(known, sn, self.spine_nodes[slots])])
        branch = np.concatenate([self.branch[slots], np.stack([p["branch"] for p in pools]),
                                 np.where(known, br, self.branch[slots])])
        t, c = self._calibrated(list(slots) * 3, reach, spine, branch)
        self.fc_mean_t[slots], self.fc_mean_c[slots] = t[:k], c[:k]
        self.fc_pool_t[slots], self.fc_pool_c[slots] = t[k : 2 * k], c[k : 2 * k]
        if has.any():
            self.fc_last_t[slots], self.fc_last_c[slots] = t[2 * k :], c[2 * k :]

    def _curves(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """[R, G] tree and [R, D] chain forecasts with every entry filled: the last draft's curves
        blended into the request's means, and those into its class's, the request's own data
        fading with rounds spent on AR steps (an unobserved request is expected to be typical)."""
        idle = self.idle[slots]
        w = (LAST_WEIGHT * LAST_FADE ** idle * self.has_last[slots])[:, None]
        num, den = self.streak[slots].T
        m = np.clip((num + STREAK_PRIOR) / (den + STREAK_PRIOR), 0.3, 3.0)[:, None]
        a = (OWN_FADE ** idle)[:, None]
        et = a * m * (w * self.fc_last_t[slots] + (1 - w) * self.fc_mean_t[slots]) + (1 - a) * self.fc_pool_t[slots]
        ec = a * m * (w * self.fc_last_c[slots] + (1 - w) * self.fc_mean_c[slots]) + (1 - a) * self.fc_pool_c[slots]
        # Each class keeps a record, per mode, of tokens accepted against tokens planned: it
        # corrects what the forecast misses in level (e.g. calibration learned on trees, whose deep
        # spine nodes are the confident ones, does not carry over to chains). It fades back to
        # neutral over rounds, so a mode it once ruled out is tried again.
        record = np.array([self._pool(self.cls[s])["record"] for s in slots])  # [R, mode, (got, planned)]
        fix = np.clip((record[..., 0] + RECORD_PRIOR) / (record[..., 1] + RECORD_PRIOR), 0.3, 3.0)
        et, ec = et * fix[:, :1], ec * fix[:, 1:]
        return np.clip(et, 0.0, self.depth), np.minimum(ec, np.arange(1, self.depth + 1))

    # ---- costs ------------------------------------------------------------------------------

    def _cost_tables(self, rows: int) -> dict:
        """Cost arrays for a batch of `rows`, recomputed as the model refines."""
        cached = self._costs.get(rows)
        if cached is not None and cached[0] == self.cost.refined // 16:
            return cached[1]
        c, g = self.cost, self.grid
        k = np.arange(1, rows + 1)[:, None]
        depth = np.minimum(g, self.depth)[None, :]
        tables = {
            "verify_tree": c.verify(rows, 1 + g)[None, :] * c.scale,
            "verify_chain": c.verify(rows, 1 + depth)[0][None, :] * c.scale,
            "draft": c.draft(k, depth) * c.scale,
            "tree": c.tree(np.maximum(k, 1), g[None, :]) * c.scale,
            "tree_row": (c.tree(2, g) - c.tree(1, g)) * c.scale,
            "over_spec": float(c.overhead(rows, 1)) * c.scale,
            "ar": (float(c.verify(rows, 1)) + float(c.overhead(rows, 0))) * c.scale,
        }
        # A lower bound on any drafting round's seconds: one row, the cheapest window.
        tables["spec_min"] = float((tables["verify_chain"][0] + tables["draft"][0]).min() + tables["over_spec"])
        self._costs[rows] = (self.cost.refined // 16, tables)
        return tables

    # ---- the plan ---------------------------------------------------------------------------

    def plan(self, reqs: list[Request]) -> RoundPlan:
        """The selector's measured arm for a batch whose requests sample alike; the per-request
        split where they do not. A batch of requests seated plain (admit) takes AR steps without
        a plan: that is the steady state where drafting does not pay, and every microsecond
        spent there is lost against an `ar` engine."""
        if not any(r.speculative for r in reqs):
            self.rounds += 1
            self.ticks += 1
            return self._arm_table(len(reqs))[1][AR_ARM]
        classes = {sampling_class(r.params) for r in reqs}
        if len(classes) == 1:
            return self._select(reqs, classes.pop())
        return self.split(reqs)

    def split(self, reqs: list[Request]) -> RoundPlan:
        """Per request, from its forecasts: AR, the chain or a tree, the node budget spent by
        marginal gain (the module docstring)."""
        R = len(reqs)
        ids = [r.request_id for r in reqs]
        every = [r.slot for r in reqs]
        self.idle[every] += self.ticks - self.tick_mark[every]  # the selector's AR rounds, caught up
        self.tick_mark[every] = self.ticks
        if self.hold_left and ids != self.hold[0] and set(ids) < set(self.hold[0]):
            self._shrink_hold(reqs)
        if self.hold_left and self.hold[0] == ids and self.credit < self.next_probe:
            self.hold_left -= 1
            plan = self.hold[1]
            self._earn(plan, [r.slot for r in reqs])
            self.rounds += 1
            self.idle[[r.slot for r in reqs]] += 1
            return plan
        self.hold_left = 0
        fresh = [r.slot for r in reqs if self._claim(r)]
        slots = [r.slot for r in reqs]
        for c in {self.cls[s] for s in slots}:
            self._pool(c)["record"] *= RECORD_DECAY
        # New requests, and those whose calibration drifted toward the pool while they took AR steps.
        stale = fresh + [s for s in slots if self.idle[s]]
        if stale:
            self._refresh(stale)
        et, ec = self._curves(slots)
        plain = [i for i, r in enumerate(reqs) if not r.speculative]
        if plain:  # rows that may not draft gain nothing by it (and are never probed)
            et[plain], ec[plain] = -1.0, -1.0
        cap = min(int(self.grid[-1]), self.max_round_tokens // R - 1)
        cols = int(np.searchsorted(self.grid, cap, side="right"))
        t = self._cost_tables(R)
        plan = RoundPlan([AR] * R, predicted=[0.0] * R, seconds=t["ar"], learn=True)
        rate = R / t["ar"]
        if cols > 0:
            n = self.calibration.evidence(slots, [self.cls[s] for s in slots], self.idle[slots])
            luck = self.rng.gamma(n, 1.0 / n)  # explore where the evidence is thin
            # Cheap exit, the steady state of a batch that does not pay: even every row's best
            # gain at the cheapest drafting round cannot beat AR.
            best = np.maximum(et.max(1), ec.max(1))
            if (R + luck @ best) / t["spec_min"] <= rate:
                cols = 0
                self._hold(ids, plan, self._pool_ratio(slots, t, rate, cap))
        if cols > 0:
            g = self.grid[:cols]
            gain_t = et[:, :cols]
            gain_c = ec[:, np.minimum(g, self.depth) - 1]
            # A tree row costs its share of the build over a chain row (priced in tokens), and a
            # chain must win by a margin (its forecast extrapolates the deep spine more).
            use_tree = CHAIN_MARGIN * gain_t - (self.rate or rate) * t["tree_row"][None, :cols] > gain_c
            gain = np.where(use_tree, gain_t, gain_c)
            rates, order, seconds = self._rates(R, gain * luck[:, None], use_tree, t, cols)
            k, j = np.unravel_index(np.argmax(rates), rates.shape)
            if rates[k, j] <= rate:
                self._hold(ids, plan, self._pool_ratio(slots, t, rate, cap))
            else:
                rows = [int(i) for i in order[: k + 1, j]]
                plan = self._build(R, rows, use_tree[:, j], gain[:, j], int(j), float(seconds[k, j]))
                rate = float(rates[k, j])
        plan.ar_seconds = t["ar"]
        if AR in plan.modes and self.grid[0] <= cap:
            self._probe(plan, slots, et, ec, t, int(np.searchsorted(self.grid, cap, side="right")), rate, plain)
        self.rate = rate
        self.rounds += 1
        self.idle[[slots[i] for i, m in enumerate(plan.modes) if m == AR]] += 1
        return plan

    def admit(self, params, rows: int) -> bool:
        """May a request being seated ever draft? Not when its class is settled on AR steps: in
        the batch it joins (rows, itself included: a burst on an idle engine is one batch), AR
        steps are predicted SETTLED_LEAD times the best measured drafting arm's rate, with the
        class's acceptance at its long-run level (Selector.lead). A few still may, the scouts:
        their probes keep measuring the class. One in SCOUT_EVERY where AR steps lead by
        SETTLED_LEAD, one in SCOUT_EVERY x lead^2 (up to SCOUT_MAX) where they lead by more, for
        drafting must then gain that much to pay. A scout costs even where it never drafts: the
        drafter takes its prompt, and each AR round parks its features. On the demo pair at T = 1,
        c = 16 (AR steps lead by 2), one in eight cost auto 0.5-3% against `ar`. In a batch of
        more than SCOUT_ROWS the share shrinks in proportion, so about as many scouts sit in a
        round as in a batch of SCOUT_ROWS: a scout measures acceptance per row, which does not
        depend on the batch, while a round parks the whole batch's features if any row in it
        is a scout. On the demo pair at T = 0, c = 16 (benchmarks/twin_spread.py, two autos
        and two `ar` engines, 2 passes), auto ran at 0.979-0.986x the faster `ar` with the share
        of a batch of four, 0.983-0.988x with a quarter of it (the other `ar` at 0.997 and
        0.987). The others cost
        what an `ar` engine's requests do: the drafter never sees their prompts or tokens. They
        take AR steps to the end, whatever the class or the load turns to.
        The bar is parity: on the demo pair at T = 0, c = 16, where AR steps lead drafting by a
        few percent, requests seated speculative paid a tenth more per prompt (the drafter's
        context) for nothing. Judged at the recent level instead, a cold stretch at T = 0, c = 4
        (where drafting wins by 40%) seated every request plain, the scouts alone were too few to
        pay for a probe, and the cell ran on AR steps to its end (0.70x the best)."""
        cls = sampling_class(params)
        rows = max(1, min(self.slots, rows))
        modelled, _ = self._arm_table(rows)
        # AR steps at their bare price: a request seated plain parks no drafter context (its
        # AR steps cost what an `ar` engine's do), where the rounds' AR price (ar_price) is for
        # speculative rows, which park it. Priced with it at T = 0.7, c = 1 (0.1-0.3 ms a token
        # where a round takes 4 ms), AR steps looked up to 7% dearer than a plain seat's.
        seconds = self.times.seconds(rows, modelled)
        lead = self.selector.lead(cls, rows, seconds, seconds[AR_ARM])
        if lead < SETTLED_LEAD:
            return True
        every = min(SCOUT_MAX, SCOUT_EVERY * lead * lead) * max(1.0, rows / SCOUT_ROWS)
        owed = self.scouting.get(cls, 0.0) + 1.0 / every
        self.scouting[cls] = owed - (owed >= 1.0)
        return owed >= 1.0

    def _select(self, reqs: list[Request], cls: int) -> RoundPlan:
        """A batch whose requests sample alike: the selector's measured arm, every row alike, as
        the fixed method's plan (no per-row plan, and none of the split's data read back). Rows
        that may not draft (admit) take AR steps in any plan; a round without a row that may
        asks the selector nothing."""
        R = len(reqs)
        held = R in self._arms and self.selector.held(cls, R)
        rows = [] if held else [i for i, r in enumerate(reqs) if r.speculative]
        if not rows:
            self.rounds += 1  # AR steps decided ahead, or nothing else possible
            self.ticks += 1
            return self._arm_table(R)[1][AR_ARM]
        modelled, plans = self._arm_table(R)
        kept = self.selector.kept(cls, R) if len(rows) == R else None
        if kept is not None and kept in plans:  # a drafting arm decided ahead
            self.rounds += 1
            return self._steady(self._played(plans[kept], R, cls, kept), reqs)
        seconds = self.ar_price(self.times.seconds(R, modelled), len(rows))
        if len(rows) < R:  # plain rows in the batch: only the others draft, at their price
            seconds, timed = self._partial(R, len(rows), modelled, plans, seconds), None
        else:
            timed = self.times.counts(R, seconds)
            if self.cost.frozen:  # nothing is timed (see timed): no AR steps played to time them
                del timed[AR_ARM]
        arm = self.selector.choose(cls, R, seconds, seconds[AR_ARM], timed, len(rows))
        plan = plans[arm]
        self.rounds += 1
        if arm == AR_ARM:
            self.selector.idle(cls)
            self.ticks += 1
            return dataclasses.replace(plan, timed=True) if self.selector.timing else plan
        if self.selector.probing and not self.selector.retime and len(rows) > PROBE_ROWS * R:
            # A probe from AR steps measures acceptance, a per-row average: a few rows (in turn)
            # do, at a fraction of a whole batch's drafting round and held-back context.
            k = max(1, int(PROBE_ROWS * R))
            start = self.rounds % len(rows)
            rows = sorted((rows[start:] + rows[:start])[:k])
        if len(rows) < R:
            return self._steady(self._only(plan, rows, self.selector.predicted(cls, arm), cls), reqs)
        return self._steady(self._played(plan, R, cls, arm), reqs)

    def _steady(self, plan: RoundPlan, reqs: list[Request]) -> RoundPlan:
        """Mark the drafting rows whose request's previous round played this arm (Selector.own_fix)."""
        steady = []
        for i in plan.draft_rows:
            r = reqs[i]
            steady.append(self.last_arm[r.slot] == (r.request_id, plan.arm, self.rounds - 1))
            self.last_arm[r.slot] = (r.request_id, plan.arm, self.rounds)
        plan.steady = steady
        return plan

    def _played(self, plan: RoundPlan, R: int, cls: int, arm: int) -> RoundPlan:
        """The arm's plan for every row, with the selector's prediction (a shallow copy: the
        table's plans are shared). Copied by its __dict__: copy.copy (a tenth of
        dataclasses.replace's time) still took 29 us a round on the caches a forward leaves."""
        out = object.__new__(RoundPlan)
        out.__dict__.update(plan.__dict__)
        out.predicted = [self.selector.predicted(cls, arm)] * R
        out.cls = cls
        return out

    def _partial(self, R: int, k: int, modelled: dict[int, float], plans: dict[int, RoundPlan],
                 seconds: dict[int, float]) -> dict[int, float]:
        """Per arm, the seconds of a round of R rows where only k draft: the whole batch's (timed
        or modelled) scaled as the cost model prices k drafting rows against R. Every row still
        verifies the window (shorter rows are padding), so a few scouts drafting among plain rows
        cost most of a whole drafting round: priced as if all drafted, the arm looked far better
        than it is, and on the demo pair at T = 0, c = 16 the scouts (one row in eight) drafted
        in one round in ten at 2.5x an AR round's time."""
        t = self._cost_tables(R)
        out = {AR_ARM: seconds[AR_ARM]}
        for arm, full in seconds.items():
            if arm != AR_ARM:
                tree = k if plans[arm].tree_rows else 0
                out[arm] = full * self._seconds(t, k, tree, plans[arm].column) / modelled[arm]
        return out

    @staticmethod
    def _only(plan: RoundPlan, rows: list[int], predicted: float, cls: int) -> RoundPlan:
        """The arm's plan drafting these rows only (the others take AR steps). Its round is not
        that arm's cost at this batch size, so it is not timed (timed)."""
        keep = set(rows)
        mode = plan.modes[0]
        return dataclasses.replace(plan, modes=[mode if i in keep else AR for i in range(len(plan.modes))],
                                   draft_rows=rows, tree_rows=len(rows) if plan.tree_rows else 0,
                                   predicted=[predicted if i in keep else 0.0 for i in range(len(plan.modes))],
                                   cls=cls)

    def timed(self, plan: RoundPlan, rows: int, seconds: float, held: tuple[float, int] = (0.0, 0)) -> None:
        """A round the selector planned took `seconds` of wall time, `held` of it (seconds, tokens)
        appending held-back drafter context. That append is the cost of the AR steps that parked
        the tokens, so it goes to AR's price (ar_price), not to the arm that happened to draft
        next: a probe after a stretch of AR steps appends the whole stretch, and on the demo pair
        at T = 0, c = 4 the chain's timed rounds, mostly such probes, stood at 1.6x the cost
        model; the tree of 8 borrowed that bias, and AR steps were played where drafting won by
        12%. Not kept under a frozen cost model (tensor parallelism): every rank must price, so
        plan, alike."""
        if self.cost.frozen:
            return
        if held[1]:
            per_token = held[0] / held[1]
            self.held_cost = per_token if not self.held_cost else self.held_cost + HELD_RATE * (per_token - self.held_cost)
        if plan.arm is not None and plan.drafting in (0, rows):
            self.times.record(rows, plan.arm, seconds - held[0], plan.seconds)

    def ar_price(self, seconds: dict[int, float], parked: int) -> dict[int, float]:
        """The arms' seconds with AR's carrying the held-back context its rows park (appended
        when they draft again, or when the ring fills: draft_context.py)."""
        return seconds | {AR_ARM: seconds[AR_ARM] + self.held_cost * parked}

    def _arm_table(self, R: int) -> tuple[dict[int, float], dict[int, RoundPlan]]:
        """Per arm that fits a batch of R (max_round_tokens), its predicted seconds and its plan;
        rebuilt now and then as the cost model refines (arms already played are priced as timed)."""
        key = self.cost.refined // 128
        hit = self._arms.get(R)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        t = self._cost_tables(R)
        cap = min(int(self.grid[-1]), self.max_round_tokens // R - 1)
        cols = int(np.searchsorted(self.grid, cap, side="right"))
        seconds = {AR_ARM: t["ar"]}
        plans = {AR_ARM: RoundPlan([AR] * R, predicted=[0.0] * R, seconds=t["ar"], ar_seconds=t["ar"], arm=AR_ARM)}
        for j in range(cols):
            seconds[j] = self._seconds(t, R, R, j)
            plans[j] = dataclasses.replace(fixed_plan(R, "ddtree", self.depth + 1, int(self.grid[j])), column=j,
                                           seconds=seconds[j], ar_seconds=t["ar"], arm=j, measure=j + 1)
        if self.depth <= cap:
            j = self.selector.chain_column()
            seconds[CHAIN_ARM] = self._seconds(t, R, 0, j)
            plans[CHAIN_ARM] = dataclasses.replace(fixed_plan(R, "dflash", self.depth + 1, 0), column=j,
                                                   seconds=seconds[CHAIN_ARM], ar_seconds=t["ar"], arm=CHAIN_ARM)
        self._arms[R] = (key, seconds, plans)
        return seconds, plans

    def _rates(self, R: int, gain: np.ndarray, use_tree: np.ndarray, t: dict, cols: int):
        """[R, cols] predicted tokens/s when the first k+1 rows by gain draft at window column j,
        the row order per column, and the seconds."""
        order = np.argsort(-gain, axis=0, kind="stable")
        tokens = R + np.cumsum(np.take_along_axis(gain, order, 0), 0)
        kt = np.cumsum(np.take_along_axis(use_tree, order, 0), 0)  # tree rows among the first k+1
        verify = np.where(kt > 0, t["verify_tree"][:, :cols], t["verify_chain"][:, :cols])
        build = np.where(kt > 0, t["tree"][np.maximum(kt - 1, 0), np.arange(cols)], 0.0)
        seconds = verify + t["draft"][:, :cols] + build + t["over_spec"]
        return tokens / seconds, order, seconds

    def _pool_ratio(self, slots: list[int], t: dict, rate: float, cap: int) -> float:
        """Best drafting rate over AR's if these requests were typical of their classes: where
        their forecasts drift while they take AR steps, so how long an all-AR plan may hold."""
        cols = int(np.searchsorted(self.grid, cap, side="right"))
        et = np.clip(self.fc_pool_t[slots][:, :cols], 0.0, self.depth)
        ec = self.fc_pool_c[slots][:, np.minimum(self.grid[:cols], self.depth) - 1]
        use_tree = et > ec
        rates = self._rates(len(slots), np.where(use_tree, et, ec), use_tree, t, cols)[0]
        return float(rates.max()) / rate

    def _hold(self, ids: list[str], plan: RoundPlan, ratio: float) -> None:
        """Reuse this all-AR plan for the next rounds: none when drafting for typical requests of
        these classes would be within 10% of paying (ratio = its best rate over AR's), up to
        MAX_HOLD when it would cost a third of the rate."""
        self.hold = (ids, plan)
        self.hold_left = int(MAX_HOLD * min(1.0, max(0.0, (0.95 - ratio) / 0.3)))

    def _shrink_hold(self, reqs: list[Request]) -> None:
        """Requests left an all-AR batch that was holding: the rest keep holding, for as long as
        the same rule gives their smaller batch (at most what was left), without a full plan."""
        R, slots = len(reqs), [r.slot for r in reqs]
        cap = min(int(self.grid[-1]), self.max_round_tokens // R - 1)
        t = self._cost_tables(R)
        plan = RoundPlan([AR] * R, predicted=[0.0] * R, seconds=t["ar"], learn=True, ar_seconds=t["ar"])
        left = self.hold_left
        if self.grid[0] <= cap:
            self._hold([r.request_id for r in reqs], plan, self._pool_ratio(slots, t, R / t["ar"], cap))
        else:
            self.hold = ([r.request_id for r in reqs], plan)
        self.hold_left = min(left, self.hold_left)

    def _build(self, R: int, rows: list[int], use_tree: np.ndarray, gain: np.ndarray, column: int,
               seconds: float) -> RoundPlan:
        size = int(self.grid[column])
        modes, predicted = [AR] * R, [0.0] * R
        tree = [i for i in rows if use_tree[i]]
        chain = [i for i in rows if not use_tree[i]]
        for i in rows:
            modes[i] = TREE if use_tree[i] else CHAIN
            predicted[i] = float(gain[i])
        length = min(size, self.depth)
        return RoundPlan(modes, window=1 + (size if tree else length), budget=size if tree else 0,
                         chain=length if chain else 0, depth=length, draft_rows=tree + chain, tree_rows=len(tree),
                         predicted=predicted, seconds=seconds, learn=True, column=column)

    def _seconds(self, t: dict, k: int, kt: int, j: int) -> float:
        """Predicted round seconds with k drafting rows, kt of them trees, at grid column j."""
        if k == 0:
            return t["ar"]
        s = (t["verify_tree"] if kt else t["verify_chain"])[0, j] + t["draft"][k - 1, j] + t["over_spec"]
        return float(s + (t["tree"][kt - 1, j] if kt else 0.0))

    def _earn(self, plan: RoundPlan, slots: list[int]) -> None:
        """Probe credit for this round: its AR rows' classes' share of its time (capped at a few rounds)."""
        idle = [self.cls[slots[i]] for i, m in enumerate(plan.modes) if m == AR]
        if idle:
            share = max(probe_share(self._pool(c)["big_win"]) for c in set(idle))
            self.credit = min(self.credit + share * plan.seconds, max(4 * plan.seconds, 1.5 * self.next_probe))

    def _probe(self, plan: RoundPlan, slots: list[int], et: np.ndarray, ec: np.ndarray, t: dict, cols: int,
               rate: float, plain: list[int]) -> None:
        """Let the AR row unobserved longest draft too, when the probe credit pays for it. A probe
        costs its extra seconds less the tokens it is expected to bring (at the plan's rate)."""
        self._earn(plan, slots)
        idle = [i for i, m in enumerate(plan.modes) if m == AR and i not in plain]
        if not idle:
            return
        i = min(idle, key=lambda r: self.last_seen[slots[r]])
        if plan.drafting:
            j, tree = plan.column, plan.tree_rows > 0
            seconds = self._seconds(t, plan.drafting + 1, plan.tree_rows + tree, j)
        else:
            j, tree = min(int(np.searchsorted(self.grid, 4)), cols - 1), True
            seconds = self._seconds(t, 1, 1, j)
        expected = float(et[i, j]) if tree else float(ec[i, plan.chain - 1])
        extra = seconds - plan.seconds
        price = extra - max(0.0, expected) / rate
        if self.credit < price:
            self.next_probe = price
            return
        self.credit -= max(0.0, price)
        self.next_probe = 0.0
        self.hold_left = 0  # this plan is no longer all-AR
        size = int(self.grid[j])
        if not plan.drafting:
            plan.window, plan.budget, plan.depth, plan.column = size + 1, size, min(size, self.depth), j
        plan.seconds = seconds
        plan.probes.append(i)
        if tree:
            plan.modes[i] = TREE
            plan.draft_rows.insert(plan.tree_rows, i)
            plan.tree_rows += 1
        else:
            plan.modes[i] = CHAIN
            plan.draft_rows.append(i)
        plan.predicted[i] = expected

    # ---- learning ---------------------------------------------------------------------------

    def _observe_arm(self, plan: RoundPlan, accepted: list[int], room: list[int] | None,
                     measured: list[tuple[list[int], int, bool]] | None) -> None:
        """The selector's share of a round it planned. measured: a tree round's, per drafting row,
        what every grid size up to its own accepted and the run along the spine (by_size). Each
        arm is credited with the drafted tokens the
        request keeps: at most room - 1, room being the tokens it may still emit (max_tokens). A
        walk past that is cut, and a long chain's walks are cut more: on the demo pair at T = 0,
        c = 4 (64 tokens a request), 8.5% of the chain's walked tokens lay past the end and 3% of
        the tree of 8's, so by walks the chain led by 2.4% a round where in tokens kept the tree
        of 8 did by 3.5%."""
        rows = plan.draft_rows if len(accepted) > plan.drafting else range(len(accepted))
        cap = [min(room[i] - 1, self.depth) for i in rows] if room is not None else [self.depth] * len(rows)
        if plan.arm == CHAIN_ARM:
            walked = [accepted[i] for i in rows]
            self.selector.observe(plan.cls, len(walked), None, walked, [min(a, c) for a, c in zip(walked, cap)],
                                  steady=plan.steady)
            return
        tree = [[min(x, c) for x in by] for (by, _, _), c in zip(measured, cap)]
        # The chain's kept tokens: the run, exact unless it reached the end of the tree's spine
        # short of the row's cap (then at least the run).
        chain = [(min(run, c), not open or run >= c) for (_, run, open), c in zip(measured, cap)]
        self.selector.observe(plan.cls, len(tree), tree, [run for _, run, _ in measured], chain=chain,
                              steady=plan.steady)

    def curve_columns(self, plan: RoundPlan) -> int:
        """Tree-curve columns the round reads back: the grid sizes up to the tree's budget."""
        return int(np.searchsorted(self.grid, plan.budget, side="right")) if plan.budget else 0

    def observe(self, plan: RoundPlan, slots: list[int], extras: np.ndarray | None, accepted: list[int],
                room: list[int] | None = None, measured: list[tuple[list[int], int, bool]] | None = None) -> None:
        """Fold in a round's outcome. extras [drafting, 2 * cols + 5 * depth], per drafting row (see
        runner.round_extras): spine nodes and branch reach of the top-b tree at the grid columns,
        the spine reach per depth, then per depth and kind the drafter's predicted accepted nodes
        and the observed ones. accepted: drafted tokens accepted, per batch row. room: per batch
        row, the tokens its request could still emit before the round (None: no limit).
        measured: in the selector's tree rounds, per drafting row, what each grid size up to the
        round's accepted and the run along the spine (by_size)."""
        if plan.arm is not None and plan.drafting:
            self._observe_arm(plan, accepted, room, measured)
        if extras is None or not plan.drafting or not plan.learn:
            return
        rows = plan.draft_rows
        k = len(rows)
        ds = [slots[i] for i in rows]
        classes = [self.cls[s] for s in ds]
        cols, D = self.curve_columns(plan), plan.depth
        spine_nodes, branch = extras[:, :cols], extras[:, cols : 2 * cols]
        reach = extras[:, 2 * cols : 2 * cols + D]
        pred = extras[:, 2 * cols + D : 2 * cols + 3 * D].reshape(k, D, 2)
        obs = extras[:, 2 * cols + 3 * D :].reshape(k, D, 2)
        self.calibration.update(ds, classes, obs, pred, self.idle[ds])
        self.last_seen[ds] = self.rounds
        self.idle[ds] = 0
        r = np.full((k, self.depth), np.nan)
        r[:, :D] = reach
        self.reach[ds] = r
        self.reach_mean[ds] = blend(self.reach_mean[ds], r, MEAN_RATE)
        nt = plan.tree_rows
        sn, br = np.full((nt, len(self.grid)), np.nan), np.full((nt, len(self.grid)), np.nan)
        if nt and cols:
            sn[:, :cols], br[:, :cols] = spine_nodes[:nt], branch[:nt]
            tree_slots = ds[:nt]
            self.spine_nodes_last[tree_slots], self.branch_last[tree_slots] = sn, br
            self.spine_nodes[tree_slots] = blend(self.spine_nodes[tree_slots], sn, MEAN_RATE)
            self.branch[tree_slots] = blend(self.branch[tree_slots], br, MEAN_RATE)
        for cls in set(classes):
            mine = [i for i, x in enumerate(classes) if x == cls]
            pool = self._pool(cls)
            pool["reach"] = blend(pool["reach"][None], r[mine].mean(0)[None], POOL_RATE)[0]
            trees = [i for i in mine if i < nt]
            if trees and cols:
                pool["spine_nodes"] = blend(pool["spine_nodes"][None], sn[trees].mean(0)[None], POOL_RATE)[0]
                pool["branch"] = blend(pool["branch"][None], br[trees].mean(0)[None], POOL_RATE)[0]
        self._refresh(ds)
        # The streak: what was accepted against what this very draft forecast, under the new
        # calibration; and the class's record of accepted against planned.
        got = np.array([accepted[i] for i in rows], dtype=float)
        same = np.array([self.fc_last_t[s, plan.column] if i < nt else self.fc_last_c[s, plan.chain - 1]
                         for i, s in enumerate(ds)])
        self.streak[ds] = STREAK_DECAY * self.streak[ds] + np.stack([got, same], 1)
        for i in range(k):
            self._pool(classes[i])["record"][0 if i < nt else 1] += (got[i], plan.predicted[rows[i]])
        # Big wins: rows whose share of the round's time bought at least twice the tokens AR would have.
        if plan.seconds > 0 and plan.ar_seconds > 0:
            bar = 2.0 * plan.seconds / plan.ar_seconds - 1.0  # drafted tokens accepted per row for that
            for i in range(k):
                pool = self._pool(classes[i])
                pool["big_win"] += BIG_WIN_RATE * (float(got[i] >= bar) - pool["big_win"])
        if nt and cols >= 2:  # rho[m] = increment m+1 over increment m of the calibrated tree curve
            for cls in set(classes[:nt]):
                mine = [i for i in range(nt) if classes[i] == cls]
                curve = self.fc_last_t[[ds[i] for i in mine]][:, :cols].mean(0)
                inc = np.diff(np.concatenate([[0.0], curve]))
                ratio = np.divide(inc[1:], inc[:-1], out=np.full(cols - 1, RHO_PRIOR), where=inc[:-1] > 1e-6)
                rho = self._pool(cls)["rho"]
                rho[: cols - 1] += POOL_RATE * (np.clip(ratio, 0.0, 1.5) - rho[: cols - 1])


def probe_share(big_win: float) -> float:
    """The share of round time a class spends probing, from how often its drafts win big."""
    return PROBE_MIN + (PROBE_MAX - PROBE_MIN) * min(1.0, big_win / BIG_WIN_FULL)


def blend(mean: np.ndarray, new: np.ndarray, rate: float) -> np.ndarray:
    """EMA step where `new` is known; entries `mean` lacks take `new` as is; NaN in new keeps mean."""
    stepped = np.where(np.isnan(mean), new, mean + rate * (new - mean))
    return np.where(np.isnan(new), mean, stepped)


def extend_tree(curve: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """Fill unknown grid columns: each adds rho times the previous column's increment."""
    et = curve.copy()
    et[:, 0] = np.where(np.isnan(et[:, 0]), 0.0, et[:, 0])
    for j in np.flatnonzero(np.isnan(et[:, 1:]).any(0)) + 1:  # columns with nothing to fill stay as they are
        prev = et[:, j - 1] - (et[:, j - 2] if j >= 2 else 0.0)
        fill = et[:, j - 1] + np.maximum(prev, 0.0) * rho[:, j - 1]
        et[:, j] = np.where(np.isnan(et[:, j]), fill, et[:, j])
    return et


def extend_reach(reach: np.ndarray) -> np.ndarray:
    """Fill unknown depths of spine reach: each further depth multiplies by the last conditional
    (reach_d / reach_{d-1}, the root's reach being 1)."""
    out = reach.copy()
    out[:, 0] = np.where(np.isnan(out[:, 0]), SPINE_PRIOR, out[:, 0])
    for d in np.flatnonzero(np.isnan(out[:, 1:]).any(0)) + 1:  # depths with nothing to fill stay as they are
        before = out[:, d - 2] if d >= 2 else np.ones(len(out))
        ratio = np.clip(np.divide(out[:, d - 1], before, out=np.zeros(len(out)), where=before > 1e-12), 0.0, 0.98)
        out[:, d] = np.where(np.isnan(out[:, d]), out[:, d - 1] * ratio, out[:, d])
    return out
