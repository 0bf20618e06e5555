"""The bench's arithmetic, kept free of models and timers so tests can check it by hand.

Stages of one round (see flashtree/engine/runner.py), as the engine times them:
  draft   drafter forward over [bonus, MASK x (L-1)] + the target's LM head on the block, and
          appending the accepted nodes' target features to the drafter's context (its K/V)
  tree    build_tree (ddtree) or build_chain (dflash) from the draft logits; ar has none
  verify  target forward over the tree's nodes (mask included) + the per-node pick (argmax or sample)
  commit  accept walk + the round's one host read + KV compaction of the accepted path
"Overhead" = (tree + commit) / round: the round's work besides the drafter and target forwards.
Time outside the rounds (prefill aside) is the engine's scheduling and detokenising.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

ROUND_STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class RequestRecord:
    """One measured request: what the engine's RequestStats said, plus its token counts."""

    prompt_id: str
    prompt_tokens: int
    output_tokens: int
    wall_seconds: float  # add_request -> finished, prefill included
    accept_lengths: list[int]  # tokens emitted per round, bonus included
    stage_seconds: dict[str, float]  # prefill + ROUND_STAGES
    finish_reason: str = ""
    output_ids: list[int] = field(default_factory=list)


def tau(records: list[RequestRecord]) -> float:
    """Mean tokens per round over all rounds of all requests (round-weighted, bonus counted)."""
    rounds = sum(len(r.accept_lengths) for r in records)
    return sum(sum(r.accept_lengths) for r in records) / rounds if rounds else 0.0


def tokens_per_second(records: list[RequestRecord]) -> float:
    """Output tokens over wall time, prefill included, summed over requests run one at a time."""
    seconds = sum(r.wall_seconds for r in records)
    return sum(r.output_tokens for r in records) / seconds if seconds > 0 else 0.0


def stage_seconds_per_round(records: list[RequestRecord]) -> dict[str, float]:
    """Mean seconds per round for each round stage."""
    rounds = sum(len(r.accept_lengths) for r in records)
    return {s: sum(r.stage_seconds.get(s, 0.0) for r in records) / rounds if rounds else 0.0 for s in ROUND_STAGES}


def round_seconds(per_round: dict[str, float]) -> float:
    return sum(per_round[s] for s in ROUND_STAGES)


def overhead_share(per_round: dict[str, float]) -> float:
    """(tree + commit) / round time."""
    total = round_seconds(per_round)
    return (per_round["tree"] + per_round["commit"]) / total if total > 0 else 0.0


def outside_rounds_share(records: list[RequestRecord]) -> float:
    """Wall time in neither prefill nor a round stage (scheduling, detokenising, Python) / wall."""
    wall = sum(r.wall_seconds for r in records)
    inside = sum(r.stage_seconds.get(s, 0.0) for r in records for s in ("prefill", *ROUND_STAGES))
    return max(0.0, wall - inside) / wall if wall > 0 else 0.0


def accept_histogram(records: list[RequestRecord], max_len: int = 1) -> list[int]:
    """counts[k-1] = rounds that emitted k tokens, for k = 1 .. max(max_len, longest seen)."""
    lengths = [a for r in records for a in r.accept_lengths]
    counts = [0] * max([max_len, *lengths])
    for a in lengths:
        counts[a - 1] += 1
    return counts


def fractions(counts: list[int]) -> list[float]:
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def speedup(value: float, baseline: float) -> float | None:
    return value / baseline if baseline > 0 else None


def decode_speedup(tau_: float, round_s: float, ar_round_s: float, ar_tau: float = 1.0) -> float | None:
    """Tokens per second of decode rounds alone, relative to ar: tau / T_round over ar's."""
    if round_s <= 0 or ar_round_s <= 0:
        return None
    return (tau_ / round_s) / (ar_tau / ar_round_s)


def predicted_speedup(tau_: float, t_ar_step: float, t_draft: float, t_verify: float, overhead: float) -> float:
    """tau * T_ar_step / (T_draft + T_verify(n) + overhead): the cost model the budget should be picked by."""
    return tau_ * t_ar_step / (t_draft + t_verify + overhead)


def interpolate(points: list[tuple[int, float]], n: float) -> float:
    """Linear interpolation of a measured cost curve [(nodes, seconds)], clamped at its ends."""
    pts = sorted(points)
    xs = [p[0] for p in pts]
    if n <= xs[0]:
        return pts[0][1]
    if n >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_left(xs, n)
    if xs[i] == n:
        return pts[i][1]
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


@dataclass
class CellSummary:
    """Every number the bench reports for one (suite, temperature, method, budget)."""

    suite: str
    temperature: float
    method: str
    budget: int | str | None  # ddtree: an int or "auto"; mtp: the drafted tokens k
    requests: int
    rounds: int
    output_tokens: int
    wall_seconds: float
    tau: float
    tokens_per_s: float
    stage_ms_per_round: dict[str, float]
    round_ms: float
    prefill_ms_per_request: float
    overhead_share: float
    outside_rounds_share: float
    accept_counts: list[int]
    accept_fractions: list[float]
    tree_nodes: int | None  # verified nodes per round: 1 (ar), L (dflash), k+1 (mtp), B+1 (ddtree), None (auto)
    speedup: float | None = None  # wall tokens/s vs ar, same suite and temperature
    decode_speedup: float | None = None  # rounds only: tau/T_round vs ar's
    predicted_speedup: float | None = None  # from the cost curve's T_verify(tree_nodes)
    predicted_verify_ms: float | None = None
    matches_ar: float | None = None  # greedy only: fraction of requests with ar's exact output

    @property
    def label(self) -> str:
        return f"{self.method}-{self.budget}" if self.method in ("ddtree", "mtp") else self.method


def summarize(suite: str, temperature: float, method: str, budget: int | str | None, tree_nodes: int | None,
              records: list[RequestRecord], max_len: int) -> CellSummary:
    per_round = stage_seconds_per_round(records)
    counts = accept_histogram(records, max_len)
    return CellSummary(
        suite=suite,
        temperature=temperature,
        method=method,
        budget=budget,
        requests=len(records),
        rounds=sum(len(r.accept_lengths) for r in records),
        output_tokens=sum(r.output_tokens for r in records),
        wall_seconds=sum(r.wall_seconds for r in records),
        tau=tau(records),
        tokens_per_s=tokens_per_second(records),
        stage_ms_per_round={s: 1e3 * v for s, v in per_round.items()},
        round_ms=1e3 * round_seconds(per_round),
        prefill_ms_per_request=1e3 * sum(r.stage_seconds.get("prefill", 0.0) for r in records) / max(1, len(records)),
        overhead_share=overhead_share(per_round),
        outside_rounds_share=outside_rounds_share(records),
        accept_counts=counts,
        accept_fractions=fractions(counts),
        tree_nodes=tree_nodes,
    )


def match_fraction(records: list[RequestRecord], reference: list[RequestRecord]) -> float:
    """Fraction of requests whose output equals the reference's for the same prompt (greedy: lossless)."""
    ref = {r.prompt_id: r.output_ids for r in reference}
    return sum(r.output_ids == ref.get(r.prompt_id) for r in records) / max(1, len(records))


def compare_to_ar(cells: list[CellSummary], verify_ms: Callable[[str, int, float], float]) -> None:
    """Fill speedup, decode speedup and predicted speedup against the ar cell of each group.

    verify_ms(method, nodes, temperature) -> the cost curve's verify time in ms. The curve gives the
    shape (n nodes vs 1, timed on their own); the run gives the scale: T_verify(n) = curve(n) /
    curve(1) x ar's measured verify, and T_ar_step = ar's measured round. Other processes on a
    shared machine slow every stage of the run alike, so anchoring the curve at a measured point
    keeps both sides of the ratio in the same conditions (and ar predicts exactly 1x). Without an
    ar cell in a group the curve is used as measured, T_ar_step = its 1-node verify, and the
    measured speedups stay None.
    """
    ar = {(c.suite, c.temperature): c for c in cells if c.method == "ar"}
    for c in cells:
        base = ar.get((c.suite, c.temperature))
        if base is not None:
            c.speedup = speedup(c.tokens_per_s, base.tokens_per_s)
            c.decode_speedup = decode_speedup(c.tau, c.round_ms, base.round_ms, base.tau)
        if c.tree_nodes is None:  # budget "auto": no single tree size to read off the curve
            continue
        one = verify_ms("ar", 1, c.temperature)
        scale = base.stage_ms_per_round["verify"] / one if base is not None and one > 0 else 1.0
        c.predicted_verify_ms = scale * verify_ms(c.method, c.tree_nodes, c.temperature)
        t_ar = base.round_ms if base is not None else one
        draft = c.stage_ms_per_round["draft"]
        over = c.stage_ms_per_round["tree"] + c.stage_ms_per_round["commit"]
        if c.tau > 0 and t_ar > 0:
            c.predicted_speedup = predicted_speedup(c.tau, t_ar, draft, c.predicted_verify_ms, over)
