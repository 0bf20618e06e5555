"""The speculation policy (budget="auto"): each round, per row, plain AR steps, the chain or a tree
of b nodes, whichever measured acceptance and round costs predict gives the most tokens a second:
rate = (R + sum over drafting rows of E_row(arm)) / seconds(R, arm, rows).

E is measured: a verified tree tells what every smaller top-b tree would have accepted (`by_size`),
and the chain's run along its spine. Acceptance comes in streaks, so the chain's E = shape x (level
+ P), a shape per sampling class, paired with the request's own recent base (its run over the first
BASE spine nodes), whose weight halves every FORGET tokens it goes unmeasured; a tree's is what it
kept at that level beside the chain on the same rows. Exploring thin trees, and probing requests on
AR steps as their output doubles, is paid from a credit of EXPLORE of the time drafting saved plus
PROBE of timed rounds' time. docs/performance.md says why.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import replace

import numpy as np

from flashtree.engine.cost_model import CONTEXT, CostModel
from flashtree.engine.round_plan import AR, RoundPlan, fixed_plan
from flashtree.engine.sequence import Request
from flashtree.sampling import SamplingParams

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
BASE, P = 3, 0.5  # the paired base (spine nodes), and the tokens added to it in the chain's shape
LEVELS = np.array([1.5, 2.5])  # bins of a row's level, each with its own tree statistics
LEVEL_RATE, REQUEST_RATE, SHAPE_RATE = 0.05, 0.3, 0.02  # EMA weights: per class row, per request round, per row
OWN_ROUNDS, OWN_RUNS = 2, 4  # after n rounds a request's own level, and its own chain run, count n / (n + these)
KNOWN = 8  # rows measured before an arm's estimate is trusted without exploring it
STALE = 300  # rounds of its class after which an arm not measured since is explored again, once
PRIOR_ROWS = 8  # the weight, in rows, of the level's and the chain's priors
SETTLE_ROWS, SETTLE_ROUNDS = 32, 128  # rows measured, or rounds, before a class whose drafts do not pay seats plain
EXPLORE, PROBE = 0.05, 0.01  # exploration credit: of the time drafting saved, and of timed rounds' time
FACTOR_RATE = 0.1  # EMA weight of a timed round in its arm's cost factor
FORGET = 8  # output tokens over which a request's own evidence halves (its acceptance drifts), and the most
# rounds AR steps are decided ahead: by then a held request's estimate has moved halfway back to its class's
HOLD = 32  # ... or this many where its class's estimate would not draft either, so fading cannot end the AR steps
PROBE_TOKENS = 8  # a request's tokens before a probe (its first rounds keep little at T = 0)
RECENT = 8  # requests whose own levels a class keeps: a new one is seated plain only if none would draft
SCOUT = 8  # requests seated while their class is settled on AR steps: one in this many may draft
SCALE_MIN = 0.25  # the least a sampled class's kept / predicted scales its estimates by
REUSE = 2  # rounds a lone request's drafting plan is played: planning is ~4% of a round at batch 1 (docs)


def sampling_class(params: SamplingParams) -> int:
    """Requests that accept alike: greedy is 0, sampled ones by temperature in tenths (>= 1)."""
    return 0 if params.greedy else max(1, min(50, round(params.temperature * 10)))


def by_size(codes: list[int], sizes: list[int]) -> tuple[list[int], int, bool]:
    """What one tree round measured, from its accepted path's codes (runner.path_codes: per node,
    root first, 4 x rank + 2 if it has a child in the tree + 1 if it is its parent's best child; -1
    past the path): per b in sizes, the drafted tokens the top-b tree would have accepted (ranks grow
    along a path); the run along the spine (the chain's); and whether it reached the spine's end."""
    path = list(itertools.takewhile(lambda c: c >= 0, codes[1:]))
    ranks = [c >> 2 for c in path]
    run = next((i for i, c in enumerate(path) if not c & 1), len(path))
    end = path[run - 1] if run else codes[0]
    return [bisect.bisect_right(ranks, b) for b in sizes], run, run == len(path) and not end & 2


class ClassStats:
    """Measured acceptance of one sampling class: the base's level, the chain's survival by depth and, per
    LEVELS bin of the rows' levels (a tree's edge where the chain keeps little says nothing of it where it
    keeps much), each tree's and the chain's kept tokens on the same rows; priors worth PRIOR_ROWS rows."""

    def __init__(self, arms: int, depth: int) -> None:
        self.level, self.level_rows = BASE / 2, 0.0
        self.kept = np.zeros((2, arms, len(LEVELS) + 1))  # per tree and level bin: its average kept, the chain's
        self.rows = np.zeros_like(self.kept[0])  # on the same rows, and the rows each rests on (the chain's: all runs)
        self.seen = np.zeros_like(self.kept[0])  # the class's round when each was last measured
        self.reached = np.full(depth, float(PRIOR_ROWS))  # the chain: rows that reached each depth ...
        self.stopped = self.reached / (depth / 2 + 1)  # ... and stopped there (prior: ~half kept)
        self._survival: np.ndarray | None = None  # their survival by depth, worked out when next read
        self.round, self.credit = 0, 0.0  # the class's rounds; seconds exploration may spend
        self.seated = 0.0  # scouts owed to requests seated plain (admit)
        self.recent: list[float] = []  # the own levels of its last RECENT measured requests
        self.calibration = np.array([1.0, 1.0, 0.0])  # rows chosen on their estimates: mean predicted, kept; rows

    def measured(self, level: int, counts: list[int], chain: float) -> None:
        """One tree row in `level` bin: per tree size up to the one played, drafted tokens kept; the chain's run."""
        n = len(counts)
        rate = np.maximum(SHAPE_RATE, 1.0 / (1.0 + self.rows[:n, level]))  # a plain mean over the first rows
        self.kept[:, :n, level] += rate * (np.array([counts, [chain] * n]) - self.kept[:, :n, level])
        self.rows[:n, level] += 1
        self.seen[:n, level] = self.round

    def chain_run(self, run: int, censored: bool, level: int = 0) -> float:
        """The chain kept `run` drafted tokens, and stopped at the next one unless censored; returns its
        expected run (past `run` where censored, from the survival before this row)."""
        run = int(run)
        if censored:
            survival = self.survival
            expected = run + survival[run:].sum() / (survival[run - 1] if run else 1.0)
        else:
            expected = run
        self.reached *= 1 - SHAPE_RATE
        self.stopped *= 1 - SHAPE_RATE
        self.reached[: run + (not censored)] += 1
        if not censored and run < len(self.stopped):
            self.stopped[run] += 1
        self._survival = None
        self.rows[-1, level] += 1
        self.seen[-1, level] = self.round
        return float(expected)

    def calibrate(self, predicted: float, kept: int) -> None:
        """A row chosen to draft on its (scaled) estimate `predicted` kept `kept` (priors: PRIOR_ROWS rows)."""
        c = self.calibration
        c[:2] += max(LEVEL_RATE, 1.0 / (1.0 + PRIOR_ROWS + c[2])) * (np.array([predicted / self.scale, kept]) - c[:2])
        c[2] += 1

    @property
    def scale(self) -> float:  # kept / predicted, bounded so a class on AR steps drafts again where raw estimates soar
        return min(max(self.calibration[1] / max(self.calibration[0], 1e-9), SCALE_MIN), 1 / SCALE_MIN)

    @property
    def survival(self) -> np.ndarray:  # the chain's survival by depth: worked out once a plan reads it, not per row
        if self._survival is None:
            self._survival = np.cumprod(1 - self.stopped / self.reached)
        return self._survival

    @property
    def shape(self) -> float:  # the chain's: its expected run over level + P
        return float(self.survival.sum()) / (self.level + P)

    def leveled(self, base: float) -> None:
        self.level += max(LEVEL_RATE, 1.0 / (1.0 + PRIOR_ROWS + self.level_rows)) * (base - self.level)
        self.level_rows += 1


class Policy:
    """Plans rounds for the rows of a batch; learns from the rounds it planned (observe)."""

    def __init__(self, cost: CostModel, slots: int, block_size: int, max_budget: int, max_round_tokens: int,
                 grid: tuple[int, ...] = GRID) -> None:
        self.cost = cost
        self.depth = block_size - 1
        self.grid = [b for b in grid if b < max_budget] + [max_budget]  # the tree sizes it may play
        self.chain_arm = len(self.grid)
        self.cap = np.minimum(np.append(self.grid, self.depth), self.depth)  # the most each arm can keep
        self.windows = np.append(self.grid, [self.depth, 0]) + 1.0  # each arm's verify window, AR's last
        self.positions = np.minimum(self.windows, self.depth + 1)  # ... and the positions it spans
        self.max_round_tokens = max_round_tokens
        self.classes: dict[int, ClassStats] = {}
        self.owner: list[str | None] = [None] * slots
        self.cls = [0] * slots
        self.level = np.zeros(slots)  # each request's own recent base ...
        self.measured = np.zeros(slots)  # ... and the rounds it rests on
        self.run = np.zeros(slots)  # each request's own recent chain run (its spine's, in tree rounds)
        self.due = np.zeros(slots)  # the output tokens at which a request on AR steps is probed (again)
        self.tokens = np.zeros(slots)  # each request's output tokens when last planned
        self.since = np.zeros(slots)  # ... and when last measured: its own evidence fades with the tokens since
        self.bins = np.zeros(slots, dtype=int)  # each row's level bin when last planned (observe teaches that bin)
        self.factor = np.ones(len(self.grid) + 2)  # timed / modelled seconds per arm; the last is AR's
        self.rounds = 0
        self.hold: tuple[list[str], int] = ([], 0)  # rounds decided ahead: for this batch, this many rounds ...
        self.held: RoundPlan | None = None  # ... of this plan (None: AR steps)
        self._tables: dict[int, tuple[int, np.ndarray, bool]] = {}  # per rows: refinements // 16, table, arms priced
        self._plans: dict[tuple[int, int], RoundPlan] = {}
        self._per_key: dict[tuple[int, int], tuple] = {}  # seconds() per (rows, sampled): cost.per_key's

    def arm_plan(self, arm: int, rows: int) -> RoundPlan:
        """A drafting arm's plan for every row of a batch, kept (building one each round was a tenth of
        the plan's time)."""
        if (arm, rows) not in self._plans:
            chain = arm == self.chain_arm
            plan = fixed_plan(rows, "dflash" if chain else "ddtree", self.depth + 1, 0 if chain else self.grid[arm])
            self._plans[arm, rows] = replace(plan, arm=arm, measure=0 if chain else arm + 1)
        return self._plans[arm, rows]

    def seconds(self, rows: int, keys: int = CONTEXT, sampled: int = 0) -> tuple[float, np.ndarray]:
        """AR steps' seconds for `rows` rows (`sampled` not greedy, the deepest `keys` keys deep), and
        [arms, rows + 1]: each arm's with k rows drafting (inf where it exceeds max_round_tokens)."""
        c, base, d = self.cost, self._table(rows), keys - CONTEXT
        if (rows, sampled) not in self._per_key:
            self._per_key[rows, sampled] = c.per_key(rows, self.windows[:, None], np.arange(rows + 1), sampled,
                                                     self.positions[:, None])
        verify, draft, noise = self._per_key[rows, sampled]
        table = np.maximum(base + (verify * d + noise + draft * d) * c.scale, 0.5 * base) * self.factor[:, None]
        return table[-1, 0], table[:-1]

    def ar_seconds(self, rows: int, keys: int = CONTEXT, sampled: int = 0) -> float:
        """seconds()'s first answer alone, at a tenth of its price: held rounds are most rounds."""
        c, base = self.cost, self._table(rows, arms=False)[-1, 0]
        verify, draft, noise = c.extra(rows, 1.0, 0, keys, sampled, 1.0)
        return max(base + (verify + noise + draft) * c.scale, 0.5 * base) * self.factor[-1]

    def _table(self, rows: int, arms: bool = True) -> np.ndarray:
        """[arms + 1, rows + 1] from the cost model's tables (greedy, CONTEXT keys deep), AR's last at
        k = 0; rebuilt every 16 refinements in one array call, the arms' rows only once asked for (AR's
        cell alone costs a fortieth: a batch of plain requests asks for nothing else)."""
        c, key = self.cost, self.cost.refined // 16
        if self._tables.get(rows, (None,))[0] != key:
            table = np.full((self.chain_arm + 2, rows + 1), np.inf)
            table[-1, 0] = c.round_seconds(rows, 1, 0, 0, 0, 0)
            self._tables[rows] = (key, table, False)
        key, table, priced = self._tables[rows]
        if arms and not priced:
            plans = [self.arm_plan(arm, rows) for arm in range(self.chain_arm + 1)]
            window, depth, budget, tree = (np.array([[getattr(p, f)] for p in plans])
                                           for f in ("window", "depth", "budget", "tree_rows"))
            k = np.arange(1, rows + 1)
            seconds = c.round_seconds(rows, window, k, depth, k * (tree > 0), budget)
            table[:-1, 1:] = np.where(window <= self.max_round_tokens // rows, seconds, np.inf)
            self._tables[rows] = (key, table, True)
        return table

    def _stats(self, cls: int) -> ClassStats:
        if cls not in self.classes:
            self.classes[cls] = ClassStats(self.chain_arm + 1, self.depth)
        return self.classes[cls]

    def _class_of(self, s: int) -> int:
        """Whose statistics a row reads and teaches: its sampling class's, or apart (-1 - class) in its
        opening, its first PROBE_TOKENS tokens, which are guessed unlike the text after them."""
        return -1 - self.cls[s] if self.tokens[s] < PROBE_TOKENS else self.cls[s]

    def _claim(self, req: Request) -> None:
        s = req.slot
        if self.owner[s] != req.request_id:
            if self.owner[s] is not None and self.measured[s]:
                recent = self._stats(self.cls[s]).recent
                recent[:] = [*recent[1 - RECENT:], float(self.level[s])]
            self.owner[s], self.cls[s] = req.request_id, sampling_class(req.params)
            self.level[s], self.measured[s], self.due[s] = self._stats(self.cls[s]).level, 0.0, PROBE_TOKENS
            self.since[s] = 0.0

    def _own(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """How much each request's own level and own chain run weigh against its class's: n measured rounds
        count n / (n + OWN_ROUNDS or OWN_RUNS), halved every FORGET output tokens since the last, so a request
        held on AR steps after a hard stretch drifts back to its class."""
        n = self.measured[slots]
        fresh = 0.5 ** ((self.tokens[slots] - self.since[slots]) / FORGET)
        return n / (n + OWN_ROUNDS) * fresh, n / (n + OWN_RUNS) * fresh

    def _levels(self, slots: np.ndarray, classes: list[int], own: np.ndarray) -> np.ndarray:
        """Each row's level: its own, shrunk toward its class's (else the lucky rows would be chosen to draft)."""
        return own * self.level[slots] + (1 - own) * np.array([self._stats(c).level for c in classes])

    def expected(self, classes: list[int], levels: np.ndarray, slots: np.ndarray | None = None,
                 own: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[rows, arms]: the drafted tokens each row (its class and level) is expected to keep, and the rows
        each estimate rests on (at most KNOWN). A tree keeps what it kept in the row's level bin, less where
        the chain is expected to keep less than it did on those rows; never measured there, the chain's first b."""
        uniq = sorted(set(classes))
        idx, stats = [uniq.index(c) for c in classes], [self._stats(c) for c in uniq]
        bins = LEVELS.searchsorted(levels, "right")
        chain = np.array([st.shape for st in stats])[idx][:, None] * (np.asarray(levels)[:, None] + P)
        if slots is not None:  # requests unlike their class's others, by their own runs (own) once the class is measured
            self.bins[slots] = bins  # a plan's rows: the bins observe teaches
            own = (own * [stats[i].level_rows >= SETTLE_ROWS for i in idx])[:, None]
            chain = own * self.run[slots][:, None] + (1 - own) * chain
        per = np.array([(s.rows, s.round - s.seen, *s.kept) for s in stats])[idx, :, :, bins]
        rows, age, kept, paired = per.transpose(1, 0, 2)  # each [rows, arms], at the row's level bin
        known = np.where(age <= STALE, np.minimum(rows, KNOWN), 0)
        shifted = np.minimum(np.maximum(chain + kept - paired, 0.0), kept)[:, :-1]  # moved down with the chain only
        trees = np.where(rows[:, :-1] > 0, shifted, chain * self.cap[:-1] / self.depth)
        out = np.concatenate((np.maximum.accumulate(trees, axis=1), chain), axis=1)
        opening = np.array(classes) < 0  # an opening: the chain or AR steps, never explored
        out[opening, :-1], known[opening] = 0.0, KNOWN
        known[:, -1] = np.maximum(known[:, -1], 1)  # the chain rests on its prior from the start
        # A sampled row's acceptance is mostly noise, so rows chosen where their estimates run high keep less:
        # kept / predicted over such rows of the class scales its estimates (greedy classes keep 1).
        calibrated = np.array([st.scale for st in stats])[idx][:, None]
        return np.minimum(out * calibrated, self.cap), known

    def plan(self, reqs: list[Request]) -> RoundPlan:
        R = len(reqs)
        self.rounds += 1
        ids = [r.request_id for r in reqs]
        keys = max(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
        sampled = sum(not r.params.greedy for r in reqs)

        def steps(seconds: float = 0.0) -> RoundPlan:  # AR steps for every row (0 s: observe prices them)
            return RoundPlan([AR] * R, predicted=[0.0] * R, seconds=seconds, keys=keys, sampled=sampled)

        if self.hold[1] > 0 and self.hold[0] == ids:
            # Held rounds are timed too: every drafting arm is judged against AR's factor.
            self.hold = (ids, self.hold[1] - 1)
            if self.held is None:
                return steps()
            self.tokens[reqs[0].slot] = len(reqs[0].output_ids)  # (observe dates its measurements by it)
            return self.held
        for r in reqs:
            self._claim(r)
        rows = [i for i, r in enumerate(reqs) if r.speculative]
        if not rows:
            return steps()
        ar_seconds, table = self.seconds(R, keys, sampled)
        ar_rate = R / ar_seconds
        slots = np.array([reqs[i].slot for i in rows])
        self.tokens[slots] = [len(reqs[i].output_ids) for i in rows]
        classes = [self._class_of(s) for s in slots]
        own_level, own_run = self._own(slots)
        gains, known = self.expected(classes, self._levels(slots, classes, own_level), slots, own_run)  # [k, arms]
        room = [reqs[i].params.max_tokens - len(reqs[i].output_ids) - 1 for i in rows]  # drafted tokens it may keep
        room = np.maximum(np.array(room, dtype=float), 0.0)[:, None]
        gains = np.minimum(gains, room)
        # A tree is played for its rate only once measured; before that, only to explore it.
        arm, k, rate = self._best(np.where(known > 0, gains, 0.0), table, R)
        explore, short = self._explore(set(classes), gains, known, table, R, max(rate, ar_rate))
        explored = explore is not None
        baseline = max(rate, ar_rate) if explored else ar_rate  # the rate of the plan it displaces (observe)
        if explored:
            arm, k = explore, len(rows)
        elif rate <= ar_rate:
            probe = self._probe(reqs, rows, classes, gains, table, R, ar_rate)
            if probe is None:
                # AR steps measure nothing: held until the batch changes, or an exploration or probe is due.
                due = [self.due[reqs[i].slot] - 1 - len(reqs[i].output_ids) for i in rows]
                rounds = min(self._hold(classes, room, table, R, ar_rate), short / (PROBE * ar_seconds),
                             *[d for d in due if d >= 0])
                self.hold, self.held = (ids, int(rounds)), None
                return steps(ar_seconds)
            arm, explored, baseline = self.chain_arm, True, ar_rate
            rows = [rows[j] for j in probe]
            gains, k = gains[probe], len(probe)
        chosen = {rows[i]: float(gains[i, arm]) for i in np.argsort(-gains[:, arm], kind="stable")[:k]}
        plan = self.arm_plan(arm, R)
        plan = replace(plan, modes=[plan.modes[0] if i in chosen else AR for i in range(R)], draft_rows=sorted(chosen),
                       tree_rows=len(chosen) if plan.tree_rows else 0, seconds=float(table[arm, k]),
                       predicted=[chosen.get(i, 0.0) for i in range(R)], explored=explored, keys=keys, sampled=sampled,
                       baseline=baseline)
        if R == 1 and not explored:  # a lone request's plan seldom changes from one round to the next
            self.hold, self.held = (ids, REUSE - 1), plan
        return plan

    def _hold(self, classes: list[int], room: np.ndarray, table: np.ndarray, R: int, ar_rate: float) -> int:
        """The most rounds AR steps may be decided ahead: FORGET, over which the rows' own evidence fades
        toward their classes', or HOLD where their classes' estimates alone would not draft either."""
        gains, known = self.expected(classes, np.array([self._stats(c).level for c in classes]))
        return FORGET if self._best(np.where(known > 0, np.minimum(gains, room), 0.0), table, R)[2] > ar_rate else HOLD

    def _probe(self, reqs: list[Request], rows: list[int], classes: list[int], gains: np.ndarray, table: np.ndarray,
               R: int, ar_rate: float) -> list[int] | None:
        """Rows past their openings not measured since their output was half what it is (or ever): the chain
        drafts for them, paid from credit (under AR steps nothing measures them; a class says little of them)."""
        fresh = [j for j, i in enumerate(rows)
                 if len(reqs[i].output_ids) >= self.due[reqs[i].slot]]
        if not fresh or not np.isfinite(table[self.chain_arm, len(fresh)]):
            return None
        short = self._short(self.chain_arm, gains[fresh], [classes[j] for j in fresh], table, R, ar_rate)
        return fresh if short <= 0 else None

    @staticmethod
    def _best(gains: np.ndarray, table: np.ndarray, R: int) -> tuple[int, int, float]:
        """The (arm, drafting rows, rate) that maximises tokens a second: per arm, the rows in
        order of gain, as many as pay."""
        order = -np.sort(-gains, axis=0)  # [k, arms], each arm's gains descending
        tokens = R + np.cumsum(order, axis=0)  # [k, arms]: tokens with the best 1..k rows drafting
        rates = tokens.T / table[:, 1 : gains.shape[0] + 1]  # [arms, k]
        arm, k = divmod(int(rates.argmax()), rates.shape[1])
        return int(arm), int(k) + 1, float(rates[arm, k])

    def _explore(self, classes: set[int], gains: np.ndarray, known: np.ndarray, table: np.ndarray, R: int,
                 best_rate: float) -> tuple[int | None, float]:
        """The largest thin tree (it measures every smaller one) that could beat best_rate (every row keeping
        all it can, or past a measured tree, the chain's plus that tree's best gain a node times the nodes:
        gains grow slower), else the chain if thin, once the credit covers it; and the credit still short."""
        sizes = self.windows[:-2] - 1.0
        lift = np.where(known[:, :-1] > 0, np.maximum(gains[:, :-1] - gains[:, -1:], 0.0) / sizes, -1.0).max(1)
        reach = gains[:, -1:] + np.concatenate((lift[:, None] * sizes, np.full((len(gains), 1), np.inf)), axis=1)
        upper = np.where(lift[:, None] >= 0, np.minimum(reach, self.cap), self.cap).sum(0)
        thin = np.flatnonzero((known < KNOWN).any(0) & ((R + upper) / table[:, len(gains)] > best_rate))
        if not len(thin):
            return None, np.inf
        arm = int(thin[-2] if thin[-1] == self.chain_arm and len(thin) > 1 else thin[-1])
        short = self._short(arm, gains, classes, table, R, best_rate)
        return (arm, 0.0) if short <= 0 else (None, short)

    def _short(self, arm: int, gains: np.ndarray, classes, table: np.ndarray, R: int, rate: float) -> float:
        """The predicted loss of `arm` drafting the rows of `gains`, against `rate`, less their credit."""
        return table[arm, len(gains)] - (R + gains[:, arm].sum()) / rate - min(self._stats(c).credit for c in classes)

    def observe(self, plan: RoundPlan, slots: list[int], accepted: list[int], measured: list | None,
                seconds: float, rounds: int = 1) -> None:
        """Fold in a round: per row its accepted drafted tokens, per drafting row of a tree round
        by_size's (accepted per size, spine run, chain unmeasured), and the round's wall seconds; it
        stands for `rounds` rounds of its classes (the runner observes a sample of AR rounds)."""
        R = len(slots)
        priced = plan.seconds or (self.ar_seconds(R, plan.keys, plan.sampled) if plan.arm is None else 0.0)
        if self.cost.frozen:  # tensor parallel: every rank plans alike, so none uses its own clock
            seconds = priced
        arm = -1 if plan.arm is None else plan.arm  # timed / modelled seconds, per arm
        if not self.cost.frozen and priced > 0:
            modelled = priced / self.factor[arm]
            self.factor[arm] += FACTOR_RATE * (min(max(seconds / modelled, 0.5), 2.0) - self.factor[arm])
        if plan.arm is None:
            credit = PROBE * seconds
        else:
            # Against the plan it displaced (AR steps; for an exploration, the best arm where drafting pays):
            # an exploration pays what it lost, as it ran (a thin arm's cost is least known).
            gain = (R + sum(accepted)) / (plan.baseline or R / self.ar_seconds(R, plan.keys, plan.sampled)) - seconds
            credit = PROBE * seconds + (min(0.0, gain) if plan.explored else EXPLORE * max(0.0, gain))
            for n, row in enumerate(plan.draft_rows):
                s = slots[row]
                cls, level = self._class_of(s), self.bins[s]  # its level bin when planned
                st = self._stats(cls)
                sampled = (cls if cls >= 0 else -1 - cls) > 0  # an opening's class is -1 - its sampling class
                if sampled and not plan.explored and plan.predicted[row] > 0:  # a row chosen on its estimate
                    st.calibrate(plan.predicted[row], accepted[row])
                counts, run, censored = measured[n] if plan.tree_rows else ([], accepted[row], False)
                chain = st.chain_run(run, censored and run < self.depth, level)  # the chain along the spine
                if counts:  # a tree round: every smaller tree exactly, and the chain on the same row
                    st.measured(level, counts, chain)
                base = min(run, BASE)
                st.leveled(base)
                if cls >= 0:  # the opening says little of the request either
                    rate = max(REQUEST_RATE, 1.0 / (1.0 + self.measured[s]))
                    self.level[s] += rate * (base - self.level[s])
                    self.run[s] += rate * (chain - self.run[s])
                    self.measured[s] += 1
                    self.due[s] = 2 * self.tokens[s]
                    self.since[s] = self.tokens[s]
        for c in {self.cls[s] for s in slots}:
            for st in (self._stats(c), self._stats(-1 - c)):
                st.credit += credit
                st.round += rounds

    def settled(self, params: SamplingParams) -> bool:
        """Whether the class is measured enough to seat its requests plain: SETTLE_ROWS rows (its
        openings' count), or SETTLE_ROUNDS rounds (a class its plans keep on AR steps measures few)."""
        cls = sampling_class(params)
        st = self._stats(cls)
        return st.level_rows + self._stats(-1 - cls).level_rows >= SETTLE_ROWS or st.round >= SETTLE_ROUNDS

    def admit(self, params: SamplingParams, rows: int, running: Request | None = None) -> bool:
        """May a request being seated ever draft? Not once its class is settled and no arm would pay in
        the batch it joins, with any number of its rows drafting, even at the best own level of its
        last RECENT requests (or its own, for a `running` request judged again: seated plain, it costs
        what an `ar` request does), but for one scout in SCOUT, whose rounds keep the class measured."""
        if not self.settled(params):
            return True
        cls = sampling_class(params)
        st = self._stats(cls)
        rows = max(1, min(rows, len(self.owner)))
        ar_seconds, table = self.seconds(rows, sampled=rows if cls else 0)
        s = running.slot if running is not None else None
        own = [self.level[s]] if s is not None and self.owner[s] == running.request_id and self.measured[s] else []
        gains = self.expected([cls], [max([st.level, *st.recent, *own])])[0][0]
        if ((rows + np.arange(1, rows + 1) * gains[:, None]) / table[:, 1:]).max() > rows / ar_seconds:
            return True
        st.seated += 1.0 / SCOUT
        if st.seated >= 1.0:
            st.seated -= 1.0
            return True
        return False
