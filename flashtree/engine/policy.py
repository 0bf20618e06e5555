"""The speculation policy (budget="auto"): each round, for each request, a plain AR step (no
drafter call), the chain, or a tree of size b, whichever maximises the batch's predicted tokens
per second.

    rate = (R + sum over drafting rows of E_r) / seconds(plan)

E_r is the calibrated expected number of drafted tokens the target accepts (calibration.py),
read off curves that drafts of that request left behind. Every draft yields the chain curve
(calibrated spine reach summed by depth); a tree draft also yields the top-b tree's curve at the
grid sizes up to its budget, kept as its gap over the chain of the same draft (how much the
siblings add), which is a steadier quantity than either. A draft's confidence swings from round
to round, so the chain forecast blends the last draft's curve with the request's running mean
(which starts from its class's), the last one's weight fading while the request takes AR steps;
the tree forecast is that plus the request's mean gap. Sizes past those seen are extrapolated
(geometric increments, at ratios learned from trees that were that big). seconds(plan) comes
from the cost model.

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
learn), paid from a credit of PROBE_SHARE of the time spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashtree.engine.calibration import Calibration, sampling_class
from flashtree.engine.cost_model import CostModel
from flashtree.engine.sequence import Request

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
AR, CHAIN, TREE = 0, 1, 2
MODE_NAMES = ("ar", "chain", "tree")
PROBE_SHARE = 0.01  # of round time, spent on speculative rounds the model does not expect to pay
RHO_PRIOR = 0.8  # increment ratio between grid sizes before any tree that big was seen
SPINE_PRIOR = 0.7  # per-depth acceptance assumed for a sampling class nobody has drafted in yet
POOL_RATE = 0.1  # EMA weight of one row in a class's pooled curves
MEAN_RATE = 0.3  # EMA weight of one round in a request's mean curves
LAST_WEIGHT, LAST_FADE = 0.5, 0.8  # the last draft's share of the forecast, and its fade per AR round


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
    beta: np.ndarray | None = None  # [len(draft_rows), depth, 2] calibration of the drafting rows
    learn: bool = False  # read back curves and calibration data (auto only)
    column: int = 0  # the window's grid index (auto only)

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
        self.depth = block_size - 1
        self.grid = np.array([b for b in GRID if b < max_budget] + [max_budget])
        if self.depth not in self.grid and self.depth < max_budget:
            self.grid = np.sort(np.append(self.grid, self.depth))
        self.max_round_tokens = max_round_tokens
        G, D = len(self.grid), self.depth
        self.calibration = Calibration(slots, D)
        self.owner: list[str | None] = [None] * slots
        self.cls = [0] * slots
        # Per slot: the last draft's chain curve (NaN past the depth drafted), its running mean,
        # the mean gap tree - chain per grid size (NaN: no tree that big yet), rounds since a draft.
        self.ec = np.full((slots, D), np.nan)
        self.ec_mean = np.full((slots, D), np.nan)
        self.gap = np.full((slots, G), np.nan)
        self.idle = np.zeros(slots)
        self.last_seen = np.zeros(slots)
        self.pools: dict[int, dict[str, np.ndarray]] = {}
        self.rounds = 0
        self.credit = 0.0
        self.rate = 0.0  # the last plan's predicted tokens per second
        self._costs: dict[int, tuple[int, dict]] = {}
        self.rng = np.random.default_rng(0)

    # ---- per-request state ---------------------------------------------------------------

    def _claim(self, req: Request) -> None:
        s = req.slot
        if self.owner[s] == req.request_id:
            return
        self.owner[s] = req.request_id
        self.cls[s] = sampling_class(req.params)
        self.calibration.reset(s)
        pool = self._pool(self.cls[s])
        self.ec[s] = np.nan
        self.ec_mean[s], self.gap[s] = pool["ec"], pool["gap"]
        self.idle[s] = 0
        self.last_seen[s] = self.rounds

    def _pool(self, cls: int) -> dict[str, np.ndarray]:
        if cls not in self.pools:
            G, D = len(self.grid), self.depth
            gap = np.full(G, np.nan)
            gap[0] = 0.0  # the top-1 tree is the chain of one
            self.pools[cls] = {"ec": np.cumsum(SPINE_PRIOR ** np.arange(1, D + 1)), "gap": gap,
                               "rho": np.full(G, RHO_PRIOR)}
        return self.pools[cls]

    def _curves(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """[R, G] tree and [R, D] chain forecasts with every entry filled."""
        rho = np.stack([self._pool(self.cls[s])["rho"] for s in slots])
        w = (LAST_WEIGHT * LAST_FADE ** self.idle[slots])[:, None]
        mean, last = extend_chain(self.ec_mean[slots]), self.ec[slots]
        ec = np.where(np.isnan(last[:, :1]), mean, w * extend_chain(last) + (1 - w) * mean)
        et = extend_tree(ec[:, np.minimum(self.grid, self.depth) - 1] + self.gap[slots], rho)
        return np.clip(et, 0.0, self.depth), ec

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
        self._costs[rows] = (self.cost.refined // 16, tables)
        return tables

    # ---- the plan ---------------------------------------------------------------------------

    def plan(self, reqs: list[Request]) -> RoundPlan:
        R = len(reqs)
        for r in reqs:
            self._claim(r)
        slots = [r.slot for r in reqs]
        et, ec = self._curves(slots)
        cap = min(int(self.grid[-1]), self.max_round_tokens // R - 1)
        cols = int(np.searchsorted(self.grid, cap, side="right"))
        t = self._cost_tables(R)
        plan = RoundPlan([AR] * R, predicted=[0.0] * R, seconds=t["ar"], learn=True)
        rate = R / t["ar"]
        if cols > 0:
            g = self.grid[:cols]
            gain_t = et[:, :cols]
            gain_c = ec[:, np.minimum(g, self.depth) - 1]
            # A tree row costs its share of the build over a chain row; price it in tokens.
            use_tree = gain_t - (self.rate or rate) * t["tree_row"][None, :cols] > gain_c
            gain = np.where(use_tree, gain_t, gain_c)
            n = self.calibration.evidence(slots, [self.cls[s] for s in slots])
            drawn = gain * self.rng.gamma(n, 1.0 / n)[:, None]  # explore where the evidence is thin
            order = np.argsort(-drawn, axis=0, kind="stable")  # per window: rows by gain
            tokens = R + np.cumsum(np.take_along_axis(drawn, order, 0), 0)  # [k-1, j]: the first k rows draft
            kt = np.cumsum(np.take_along_axis(use_tree, order, 0), 0)  # tree rows among them
            verify = np.where(kt > 0, t["verify_tree"][:, :cols], t["verify_chain"][:, :cols])
            build = np.where(kt > 0, t["tree"][np.maximum(kt - 1, 0), np.arange(cols)], 0.0)
            seconds = verify + t["draft"][:, :cols] + build + t["over_spec"]
            rates = tokens / seconds
            k, j = np.unravel_index(np.argmax(rates), rates.shape)
            if rates[k, j] > rate:
                rows = [int(i) for i in order[: k + 1, j]]
                plan = self._build(R, rows, use_tree[:, j], gain[:, j], int(j), float(seconds[k, j]))
                rate = float(rates[k, j])
            if AR in plan.modes:
                self._probe(plan, slots, et, ec, t, cols)
        self.rate = rate
        self.rounds += 1
        idle = [slots[i] for i, m in enumerate(plan.modes) if m == AR]
        self.calibration.idle(idle)
        self.idle[idle] += 1
        ds = [slots[i] for i in plan.draft_rows]
        plan.beta = self.calibration.beta(ds, [self.cls[s] for s in ds])[:, : max(plan.depth, 1)]
        return plan

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

    def _probe(self, plan: RoundPlan, slots: list[int], et: np.ndarray, ec: np.ndarray, t: dict, cols: int) -> None:
        """Let the AR row unobserved longest draft too, when the probe credit pays for it."""
        self.credit = min(self.credit + PROBE_SHARE * plan.seconds, 4 * plan.seconds + 1.0)
        idle = [i for i, m in enumerate(plan.modes) if m == AR]
        i = min(idle, key=lambda r: self.last_seen[slots[r]])
        if plan.drafting:
            j, tree = plan.column, plan.tree_rows > 0
            seconds = self._seconds(t, plan.drafting + 1, plan.tree_rows + tree, j)
        else:
            j, tree = min(int(np.searchsorted(self.grid, 4)), cols - 1), True
            seconds = self._seconds(t, 1, 1, j)
        extra = seconds - plan.seconds
        if self.credit < extra:
            return
        self.credit -= extra
        size = int(self.grid[j])
        if not plan.drafting:
            plan.window, plan.budget, plan.depth, plan.column = size + 1, size, min(size, self.depth), j
        plan.seconds = seconds
        plan.probes.append(i)
        if tree:
            plan.modes[i] = TREE
            plan.draft_rows.insert(plan.tree_rows, i)
            plan.tree_rows += 1
            plan.predicted[i] = float(et[i, j])
        else:
            plan.modes[i] = CHAIN
            plan.draft_rows.append(i)
            plan.predicted[i] = float(ec[i, plan.chain - 1])

    # ---- learning ---------------------------------------------------------------------------

    def curve_columns(self, plan: RoundPlan) -> int:
        """Tree-curve columns the round reads back: the grid sizes up to the tree's budget."""
        return int(np.searchsorted(self.grid, plan.budget, side="right")) if plan.budget else 0

    def observe(self, plan: RoundPlan, slots: list[int], extras: np.ndarray | None) -> None:
        """Fold in a round's outcome. extras [drafting, cols + 5 * depth], per drafting row: the tree
        curve at the grid columns, the chain curve, then per depth and kind the drafter's predicted
        accepted nodes and the observed ones (runner.round_extras)."""
        if extras is None or not plan.drafting:
            return
        rows = plan.draft_rows
        ds = [slots[i] for i in rows]
        classes = [self.cls[s] for s in ds]
        cols, D = self.curve_columns(plan), plan.depth
        curve_t = extras[:, :cols]
        curve_c = extras[:, cols : cols + D]
        pred = extras[:, cols + D : cols + 3 * D].reshape(len(rows), D, 2)
        obs = extras[:, cols + 3 * D :].reshape(len(rows), D, 2)
        self.calibration.update(ds, classes, obs, pred)
        self.last_seen[ds] = self.rounds
        self.idle[ds] = 0
        c = np.full((len(rows), self.depth), np.nan)
        c[:, :D] = curve_c
        self.ec[ds] = c
        self.ec_mean[ds] = blend(self.ec_mean[ds], c, MEAN_RATE)
        nt = plan.tree_rows
        gap = np.full((nt, self.gap.shape[1]), np.nan)
        if nt and cols:
            gap[:, :cols] = curve_t[:nt] - curve_c[:nt][:, np.minimum(self.grid[:cols], D) - 1]
            self.gap[ds[:nt]] = blend(self.gap[ds[:nt]], gap, MEAN_RATE)
        for cls in set(classes):
            mine = [i for i, x in enumerate(classes) if x == cls]
            pool = self._pool(cls)
            pool["ec"] = blend(pool["ec"][None], c[mine].mean(0)[None], POOL_RATE)[0]
            tree_mine = [i for i in mine if i < nt]
            if tree_mine and cols:
                pool["gap"] = blend(pool["gap"][None], gap[tree_mine].mean(0)[None], POOL_RATE)[0]
                if cols >= 2:  # rho[m] = increment m+1 over increment m (increment 0 = E at the first size)
                    inc = np.diff(np.concatenate([[0.0], curve_t[tree_mine].mean(0)]))
                    ratio = np.divide(inc[1:], inc[:-1], out=np.full(cols - 1, RHO_PRIOR), where=inc[:-1] > 1e-6)
                    pool["rho"][: cols - 1] += POOL_RATE * (np.clip(ratio, 0.0, 1.5) - pool["rho"][: cols - 1])

def blend(mean: np.ndarray, new: np.ndarray, rate: float) -> np.ndarray:
    """EMA step where `new` is known; entries `mean` lacks take `new` as is; NaN in new keeps mean."""
    stepped = np.where(np.isnan(mean), new, mean + rate * (new - mean))
    return np.where(np.isnan(new), mean, stepped)


def extend_tree(curve: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """Fill unknown grid columns: each adds rho times the previous column's increment."""
    et = curve.copy()
    et[:, 0] = np.where(np.isnan(et[:, 0]), 0.0, et[:, 0])
    for j in range(1, et.shape[1]):
        prev = et[:, j - 1] - (et[:, j - 2] if j >= 2 else 0.0)
        fill = et[:, j - 1] + np.maximum(prev, 0.0) * rho[:, j - 1]
        et[:, j] = np.where(np.isnan(et[:, j]), fill, et[:, j])
    return et


def extend_chain(curve: np.ndarray) -> np.ndarray:
    """Fill unknown depths: reach at depth d+1 ~ reach at d times the last conditional (the
    root's reach is 1)."""
    ec = curve.copy()
    ec[:, 0] = np.where(np.isnan(ec[:, 0]), 0.0, ec[:, 0])
    for d in range(1, ec.shape[1]):
        inc1 = ec[:, d - 1] - (ec[:, d - 2] if d >= 2 else 0.0)
        inc0 = (ec[:, d - 2] - (ec[:, d - 3] if d >= 3 else 0.0)) if d >= 2 else np.ones(len(ec))
        ratio = np.clip(np.divide(inc1, inc0, out=np.zeros_like(inc1), where=inc0 > 1e-9), 0.0, 0.95)
        ec[:, d] = np.where(np.isnan(ec[:, d]), ec[:, d - 1] + inc1 * ratio, ec[:, d])
    return ec
