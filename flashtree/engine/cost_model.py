"""What a round costs on this machine: measured at startup (cached on disk: cost_cache), refined online.

The policy prices every plan with four tables: verify(rows, window), the target forward and pick
over one window for all rows; draft(rows, depth), a drafter pass with the LM head on `depth`
positions; tree(rows, budget), the tree builds; overhead(rows, kind), the rest of a round of AR
steps (0), the chain (1) or a tree (2), from whole rounds (ModelRunner.time_rounds). They hold
greedy rows CONTEXT keys deep (deeper keys and sampled rows are priced apart, `extra`). Startup
times the points that matter most and derives the rest; timed rounds then nudge them. Captured
rounds are priced by their replays instead (graphs.RoundGraphs.timed).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np
import torch

from flashtree.models.context import ForwardContext, SlotBatch
from flashtree.sampler import SamplingBatch, pick
from flashtree.sampling import SamplingParams
from flashtree.tree import chain_spec

FORMAT = 8  # bump when the tables change meaning or what they time changes speed: older files are then re-measured
WINDOWS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1025)
TREE_BUDGETS = (4, 16, 64, 256, 1024)
DEFAULT_SECONDS = 1.8  # startup measurement time budget
CONTEXT = 128  # committed rows per slot while timing (attention over the context is part of the cost)
measurements = 0  # startup measurements run in this process (the cache tests read it)


def _bracket(points: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Left bracket index and weight of v in sorted points; weights outside [0, 1] extrapolate."""
    i = np.clip(np.searchsorted(points, v, side="right") - 1, 0, len(points) - 2)
    return i, (v - points[i]) / (points[i + 1] - points[i])


class Grid:
    """Seconds over a 2-D grid of bucket points (each axis at least 2 points), bilinear, extrapolated
    along the last slope. Along the `monotone` axes each point is lifted to the smaller ones after
    every change, so no plan can look cheaper by growing."""

    def __init__(self, xs, ys, values, monotone: tuple[int, ...] = (0, 1)) -> None:
        self.xs = np.asarray(xs, dtype=float)
        self.ys = np.asarray(ys, dtype=float)
        self.values = np.asarray(values, dtype=float).reshape(len(self.xs), len(self.ys))
        self.monotone = tuple(monotone)
        self._project()

    def _project(self) -> None:
        for axis in self.monotone:
            self.values = np.maximum.accumulate(self.values, axis=axis)

    def __call__(self, x, y):
        x, y = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
        i, wx = _bracket(self.xs, x)
        j, wy = _bracket(self.ys, y)
        v = self.values
        out = ((1 - wx) * (1 - wy) * v[i, j] + wx * (1 - wy) * v[i + 1, j]
               + (1 - wx) * wy * v[i, j + 1] + wx * wy * v[i + 1, j + 1])
        return np.maximum(out, 0.0)

    def nudge(self, x: float, y: float, observed: float, rate: float) -> None:
        """Move the corners around (x, y) so the prediction there moves `rate` of the way to `observed`
        (clipped: one outlier round cannot double a cell). Scalar code: it runs with every refinement."""
        (i, wx), (j, wy) = _bracket(self.xs, x), _bracket(self.ys, y)
        wx, wy = (min(1.0, max(0.0, float(w))) for w in (wx, wy))  # within the bracket: only its corners move
        v = self.values
        corners = ((i, j, (1 - wx) * (1 - wy)), (i + 1, j, wx * (1 - wy)), (i, j + 1, (1 - wx) * wy),
                   (i + 1, j + 1, wx * wy))
        predicted = sum(float(v[a, b]) * w for a, b, w in corners)
        err = min(max(observed - predicted, -0.5 * predicted), predicted) if predicted > 0 else observed
        norm = sum(w * w for _, _, w in corners)
        for a, b, w in corners:
            v[a, b] = max(0.0, float(v[a, b]) + rate * err * w / norm)
        self._project()

    def as_dict(self) -> dict:
        return {"xs": self.xs.tolist(), "ys": self.ys.tolist(), "values": self.values.tolist(),
                "monotone": list(self.monotone)}

    @classmethod
    def from_dict(cls, d: dict) -> Grid:
        return cls(d["xs"], d["ys"], d["values"], tuple(d.get("monotone", (0, 1))))


def kind(drafting, tree_rows):
    """The overhead column of a round: AR steps 0, the chain 1, a tree 2 (elementwise where drafting,
    tree_rows are arrays)."""
    return np.where(np.asarray(drafting) > 0, np.where(np.asarray(tree_rows) > 0, 2, 1), 0)


def row_points(max_rows: int) -> list[int]:
    """1, 2, 4, ... below max_rows, then max_rows (at least two points)."""
    return [1 << k for k in range((max_rows - 1).bit_length())] + [max_rows] if max_rows > 1 else [1, 2]


def window_points(max_window: int) -> list[int]:
    pts = [n for n in WINDOWS if n < max_window] + [max_window]
    return pts if len(pts) > 1 else [1, 2]


class CostModel:
    """The four tables, the round-time prediction for a plan, and online refinement."""

    def __init__(self, verify: Grid, draft: Grid, tree: Grid, overhead: Grid, coverage: dict,
                 source: str = "measured", seconds: float = 0.0, keys: tuple[float, float, float] = (0.0, 0.0, 0.0),
                 sample: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        self.verify, self.draft, self.tree, self.overhead = verify, draft, tree, overhead
        self.keys = keys  # seconds per key past CONTEXT: per verify row, per verify node, per drafting row
        self.sample = sample  # seconds a sampled row adds: its first node, each further node and position
        self.coverage = coverage  # the largest rows / window / budget measured
        self.source = source  # "measured" at this start, or "cache"
        self.seconds = seconds  # the startup measurement's wall time (0 from the cache)
        self.scale = 1.0  # whole-round correction when stages are not timed separately (GPU, no sync)
        self.refined = 0  # rounds folded in
        self.frozen = False  # no online refinement (tensor parallelism: every rank must plan alike)
        self.replays: dict[tuple[int, int, bool], float] = {}  # captured rounds' seconds by (bucket, window, tree)
        self.bucket: Callable[[int], int] | None = None  # ... and the batch bucket `rows` run as there

    def replayed(self, replays: dict[tuple[int, int, bool], float], bucket: Callable[[int], int]) -> None:
        """Price plans by captured rounds' replays from now on: their seconds by (batch bucket, window,
        tree), and the bucket a batch of `rows` runs as."""
        self.replays, self.bucket = replays, bucket

    def round_seconds(self, rows: int, window, drafting, depth, tree_rows, budget, keys: int = CONTEXT,
                      sampled: int = 0):
        """A plan's seconds; numpy arrays broadcast (the policy prices every arm at every count of
        drafting rows in one call: [arms, 1] plans against [1, rows] drafting rows)."""
        verify, draft, noise = self.extra(rows, window, drafting, keys, sampled, np.minimum(window, depth + 1))
        if self.replays:  # a captured round's time is its replay's, whoever drafts (inf: no graph plays it)
            bucket = self.bucket(rows)
            replay = np.vectorize(lambda w, b: self.replays.get((bucket, int(w), bool(b > 0)), np.inf))(window, budget)
            t = replay + noise + np.zeros(np.shape(drafting))
            return np.maximum(t + verify + draft, 0.5 * t) * self.scale
        t = self.staged(rows, window, drafting, depth, tree_rows, budget)
        t = t + self.overhead(rows, kind(drafting, tree_rows)) + noise
        return np.maximum(t + verify + draft, 0.5 * t) * self.scale

    def staged(self, rows: int, window, drafting, depth, tree_rows, budget):
        """The stage tables' part of a plan's seconds: verify, drafter pass (where drafting), tree build
        (where tree_rows); numpy arrays broadcast. What whole rounds take past it is `overhead`."""
        t = self.verify(rows, window)
        t = t + np.where(np.asarray(drafting) > 0, self.draft(drafting, depth), 0.0)
        return t + np.where((np.asarray(drafting) > 0) & (np.asarray(tree_rows) > 0), self.tree(tree_rows, budget), 0.0)

    def extra(self, rows, window, drafting, keys: int = CONTEXT, sampled: int = 0, positions=1) -> tuple:
        """What the tables (greedy, CONTEXT keys deep) leave out: (verify, drafter pass) seconds of `keys`
        committed keys a row (negative below CONTEXT), and the seeded noise of `sampled` rows over `window`
        nodes at `positions` distinct positions (nodes at one depth share it). Numpy arrays broadcast."""
        verify, draft, noise = self.per_key(rows, window, drafting, sampled, positions)
        deeper = keys - CONTEXT
        return verify * deeper, draft * deeper, noise

    def per_key(self, rows, window, drafting, sampled: int = 0, positions=1) -> tuple:
        """extra()'s (verify, drafter pass) seconds per key past CONTEXT, and its noise: the policy keeps
        them per batch, since only the keys change from round to round."""
        if self.replays:  # captured, a round runs its batch bucket, every row drafting where any does
            rows = self.bucket(rows)
            drafting = np.where(np.asarray(drafting) > 0, rows, 0)
        per_row, per_node, per_draft = self.keys
        first, node, position = self.sample
        return ((per_row + per_node * window) * rows, per_draft * drafting,
                sampled * (first + node * (window - 1) + position * (positions - 1)))

    def refine(self, rows: int, window: int, drafting: int, depth: int, tree_rows: int, budget: int,
               stages: dict[str, float] | None, total: float, rate: float = 0.1, keys: int = CONTEXT,
               sampled: int = 0) -> None:
        """Fold in one timed round. `stages` (verify, draft_pass, tree seconds) when the device was
        synchronised between stages; otherwise only the round's total moves a global scale."""
        if self.frozen:
            return
        self.refined += 1
        if stages is None:
            predicted = self.round_seconds(rows, window, drafting, depth, tree_rows, budget, keys, sampled) / self.scale
            if predicted > 0:
                self.scale += rate * (min(max(total / predicted, 0.5), 2.0) - self.scale)
            return
        verify, draft, noise = self.extra(rows, window, drafting, keys, sampled, min(window, depth + 1))
        self.verify.nudge(rows, window, stages["verify"] - (verify + noise), rate)
        modeled = stages["verify"]
        if drafting:
            self.draft.nudge(drafting, depth, stages["draft_pass"] - draft, rate)
            modeled += stages["draft_pass"]
            if tree_rows:
                self.tree.nudge(tree_rows, budget, stages["tree"], rate)
                modeled += stages["tree"]
        self.overhead.nudge(rows, kind(drafting, tree_rows), max(0.0, total - modeled), rate)

    def as_dict(self) -> dict:
        return {"format": FORMAT, "coverage": self.coverage, "verify": self.verify.as_dict(),
                "draft": self.draft.as_dict(), "tree": self.tree.as_dict(), "overhead": self.overhead.as_dict(),
                "keys": list(self.keys), "sample": list(self.sample)}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(Grid.from_dict(d["verify"]), Grid.from_dict(d["draft"]), Grid.from_dict(d["tree"]),
                   Grid.from_dict(d["overhead"]), d["coverage"], source="cache", keys=tuple(d["keys"]),
                   sample=tuple(d["sample"]))


# ---- startup measurement -----------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Best-of-n timings that stop taking new points once the time budget is spent."""

    def __init__(self, device: torch.device, seconds: float) -> None:
        self.device = device
        self.deadline = time.perf_counter() + seconds
        self.start = time.perf_counter()
        self.adaptive = seconds != float("inf")  # else every point runs the same repeats (tensor parallel)

    @property
    def spent(self) -> bool:
        return time.perf_counter() > self.deadline

    def __call__(self, fn, repeats: int = 2) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            _sync(self.device)
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
            if best > 0.2 and self.adaptive:  # big points: one timed run is enough
                break
        return best


def _interp(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through measured points, extrapolated along the outer slopes."""
    xs = sorted(points)
    if len(xs) == 1:  # proportional above the point
        return points[xs[0]] * max(1.0, x / xs[0])
    i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
    x0, x1 = xs[i], xs[i + 1]
    return max(0.0, points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0))


@torch.inference_mode()
def measure(target, drafter, passes: tuple[Callable, Callable], cache, draft_cache, max_rows: int, max_window: int,
            max_budget: int, seconds: float = DEFAULT_SECONDS) -> CostModel:
    """Time the target's verify, the drafter pass and the tree build on slots 0..max_rows-1, CONTEXT
    rows deep, most important points first, within `seconds`; derive the rest. `passes` are the
    runner's own (draft_pass, build), so what is timed is what a round runs (selector included)."""
    draft_pass, build = passes
    global measurements
    measurements += 1
    device = target.embed_tokens.weight.device
    timer = Timer(device, seconds)
    ctx = max(1, min(CONTEXT, cache.max_len - max_window - 2))

    def lengths(n: int) -> None:  # every slot's committed rows, target and drafter
        for s in range(max_rows):
            cache.set_length(s, n)
            draft_cache.set_length(s, n)

    lengths(ctx)
    depth = drafter.block_size - 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    layers = tuple(drafter.args.target_layer_ids)

    def logits(rows: int, d: int) -> torch.Tensor:
        return (torch.randn(rows, max(1, d), target.vocab_size, generator=gen) * 4).to(device)

    def verify(rows: int, n: int):
        batch = SlotBatch.of(cache, list(range(rows)))
        roots = torch.zeros(rows, dtype=torch.long, device=device)
        spec = build(roots, logits(rows, min(n - 1, depth)), None, n - 1) if n > 1 else chain_spec(roots[:, None])
        return lambda: target(spec.tokens.clamp(min=0), ForwardContext.verify(cache, batch, spec),
                              layers).logits.argmax(-1)

    def draft(rows: int, d: int):
        batch = SlotBatch.of(draft_cache, list(range(rows)))
        roots = torch.zeros(rows, dtype=torch.long, device=device)
        return lambda: draft_pass(batch, roots, d, None)

    def tree(rows: int, b: int):
        roots = torch.zeros(rows, dtype=torch.long, device=device)
        d = min(b, depth)
        lg = logits(rows, d)
        markov = draft(rows, d)()[2]
        if markov is not None:  # the selector's shapes, random like the logits (docs/performance.md)
            k = markov[0].shape[-1]
            markov = (torch.arange(k, device=device).expand(rows, d, k),
                      torch.log_softmax(torch.randn(rows, d, k, k, generator=gen) * 4, -1).to(device))
        return lambda: build(roots, lg, markov, b)

    windows = window_points(max_window)
    budgets = [b for b in TREE_BUDGETS if b < max_budget] + [max_budget]
    v, tr, body, head = {}, {}, {}, {}  # seconds by (rows, window), (rows, budget), rows and rows
    # Most important first: what AR, a small tree and the drafter cost at both batch ends.
    plan = [("v", 1, 1), ("v", max_rows, 1), ("d", 1, 0), ("d", max_rows, 0), ("t", 1, budgets[0]),
            ("t", max_rows, budgets[0])]
    plan += [("v", 1, n) for n in windows[1:4]] + [("v", max_rows, n) for n in windows[1:3]]
    plan += [("t", 1, b) for b in budgets[1:3]] + [("t", max_rows, b) for b in budgets[1:2]]
    plan += [("v", 1, n) for n in windows[4:]] + [("v", r, 1) for r in row_points(max_rows)[1:-1]]
    plan += [("v", max_rows, n) for n in windows[3:6]] + [("t", 1, b) for b in budgets[3:]]
    plan = list(dict.fromkeys(plan))
    for i, (kind, r, n) in enumerate(plan):
        if i >= 6 and timer.spent:
            break
        if kind == "v" and (r * n <= max(4096, max_rows * 2) or r == 1):
            v[r, n] = timer(verify(r, n))
        elif kind == "d":
            # The LM head (and the selector) scale with the depths scored, the drafter's body does not.
            full = timer(draft(r, depth))
            head[r] = min(full, max(0.0, full - timer(draft(r, 1))) * depth / max(1, depth - 1))
            body[r] = full - head[r]
        elif kind == "t":
            tr[r, n] = timer(tree(r, n))
    keys = (0.0, 0.0, 0.0)
    deep = min(8 * CONTEXT, cache.max_len - max_window - 2, draft_cache.max_len - 2 * (depth + 1))
    if ctx == CONTEXT and deep >= 2 * CONTEXT:
        # The same verify (one node and a wider window) and drafter pass, DEEP keys behind each row.
        wide = windows[min(4, len(windows) - 1)]
        points = []
        for length in (ctx, deep):
            lengths(length)
            points.append([timer(verify(max_rows, 1)), timer(verify(max_rows, wide)), timer(draft(max_rows, depth))])
        (ar, win, dr), (ar2, win2, dr2) = points
        span = max_rows * (deep - ctx)
        per_node = max(0.0, (win2 - win - (ar2 - ar)) / ((wide - 1) * span))
        keys = (max(0.0, (ar2 - ar) / span - per_node), per_node, max(0.0, (dr2 - dr) / span))
    lengths(0)
    sample = _sample_costs(timer, logits(max_rows, depth + 1))  # over the chain's window, the common round
    return _tables(v, body, head, tr, max_rows, windows, budgets, depth, max_window, max_budget,
                   time.perf_counter() - timer.start, keys, sample)


def _sample_costs(timer: Timer, x: torch.Tensor) -> tuple[float, float, float]:
    """Seconds a sampled row adds to the pick over logits x [rows, n, V]: its first node (timed apart:
    costs per element grow with the working set), each further node and each further distinct
    position (hashing noise over the vocabulary)."""
    rows, n, _ = x.shape
    greedy = SamplingBatch.build([SamplingParams()] * rows, [0] * rows, x.device)
    hot = SamplingBatch.build([SamplingParams(temperature=1.0)] * rows, list(range(rows)), x.device)
    spread = CONTEXT + torch.arange(n, device=x.device).expand(rows, n)
    one = x[:, :1].contiguous()
    first = max(0.0, timer(lambda: pick(one, hot, spread[:, :1], 1)) - timer(lambda: pick(one, greedy, spread[:, :1], 1)))
    if n < 2:
        return first / rows, 0.0, 0.0
    base = timer(lambda: pick(x, greedy, spread, n))
    same = torch.full_like(spread, CONTEXT)
    shared = timer(lambda: pick(x, hot, same, 1))  # one position per row
    each = timer(lambda: pick(x, hot, spread, n))
    per_position = max(0.0, (each - shared) / (rows * (n - 1)))
    per_node = max(0.0, (shared - base - first) / (rows * (n - 1)))
    return first / rows, per_node, per_position


def _floor(points: dict[int, float]) -> dict[int, float]:
    """Cap each point by every larger one: cost never falls as the size grows, and noise only adds time."""
    xs = sorted(points, reverse=True)
    return dict(zip(xs, itertools.accumulate((points[x] for x in xs), min)))


def _tables(v, body, head, tr, rows_max, windows, budgets, depth, max_window, max_budget,
            seconds, keys=(0.0, 0.0, 0.0), sample=(0.0, 0.0, 0.0)) -> CostModel:
    rows = row_points(rows_max)
    single = _floor({n: s for (r, n), s in v.items() if r == 1})  # tokens -> seconds at one row
    ar = _floor({r: s for (r, n), s in v.items() if n == 1})  # rows -> seconds at one node each

    def derived(r: int, n: int) -> float:
        return _interp(single, r * n) + max(0.0, _interp(ar, r) - _interp(single, r))

    at_max = {n: float(np.clip(s / max(derived(rows_max, n), 1e-9), 0.5, 2.0))
              for (r, n), s in v.items() if r == rows_max}
    # What was measured at the largest batch corrects the derived points, in proportion to their rows.
    ratio = {n: _interp(at_max, min(max(n, min(at_max)), max(at_max))) if at_max else 1.0 for n in windows}
    frac = {r: (r - 1) / (rows_max - 1) if rows_max > 1 else 0.0 for r in rows}
    values = np.array([[v.get((r, n), derived(r, n) * (1 + (ratio[n] - 1) * frac[r])) for n in windows] for r in rows],
                      dtype=float)
    values = np.minimum.accumulate(values[:, ::-1], axis=1)[:, ::-1]  # the rule of _floor, both ways
    values = np.minimum.accumulate(values[::-1], axis=0)[::-1]
    verify = Grid(rows, windows, values)
    draft_rows = sorted(body)
    if len(draft_rows) == 1:
        draft_rows = [draft_rows[0], draft_rows[0] + 1]
        body[draft_rows[1]] = body[draft_rows[0]] * 1.1
        head[draft_rows[1]] = head[draft_rows[0]] * 1.1
    draft = Grid(draft_rows, [0, depth], [[body[r], body[r] + head[r]] for r in draft_rows])
    tree_rows = [1, rows_max] if rows_max > 1 else [1, 2]
    tb = budgets if len(budgets) > 1 else [budgets[0], budgets[0] + 1]
    tvals = []
    for r in tree_rows:
        pts = {b: s for (rr, b), s in tr.items() if rr == r} or {b: s * r for (rr, b), s in tr.items() if rr == 1}
        tvals.append([_interp(_floor(pts), b) for b in tb])
    tree = Grid(tree_rows, tb, tvals)
    # What whole rounds cost past their stages (ModelRunner.time_rounds sets it): not a correction below
    # zero, which a round with fewer rows drafting than were timed would take whole.
    overhead = Grid(rows, [0, 1, 2], np.zeros((len(rows), 3)), monotone=())
    return CostModel(verify, draft, tree, overhead, {"rows": rows_max, "window": max_window, "budget": max_budget},
                     seconds=seconds, keys=keys, sample=sample)
