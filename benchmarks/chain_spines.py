"""What the trees' spines say of the chain, against the chain's own rounds: one policy-grid cell at
T = 0, with auto engines each held to one arm (the chain, or a tree of a given size), their
selectors fed as usual.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/chain_spines.py --concurrency 4 --trees 8,16,32

A tree round measures the chain along the tree's spine: exactly where the walk left the spine,
as a lower bound where it reached the spine's end (Selector.chain_tokens). Prints, per engine,
the drafted tokens its own arm walked a row, the chain's Kaplan-Meier estimate from its
measures of the chain (uncut walks), the share of rows whose spine ended under the walk, and
per depth the rows at risk and the share that stopped there. A spine runs deep only where the
drafter is sure, so if the rows whose spine ended are the ones the chain would have lost
soonest, the trees' estimate of the chain comes out above the chain's own walks.
"""

from __future__ import annotations

import argparse

import torch

from flashtree.bench.policy_grid import PolicyGridSpec, cell_engine, grid_prompts, run_cell
from flashtree.engine.selector import CHAIN_ARM


def kaplan_meier(rows: list[tuple[int, bool]], depth: int) -> tuple[float, list[tuple[int, float]]]:
    """Expected walk from (walk, exact) rows, exact=False a lower bound; and per depth the rows at
    risk and the share of them that stopped there."""
    alive, total, table = 1.0, 0.0, []
    for d in range(depth):
        at_risk = sum(1 for r, _ in rows if r >= d)
        if not at_risk:
            break
        stopped = sum(1 for r, exact in rows if r == d and exact) / at_risk
        table.append((at_risk, stopped))
        alive *= 1.0 - stopped
        total += alive
    return total, table


def held(engine, arm: int, record: list) -> None:
    """Hold the engine's selector to one arm, and record what each round measured of the chain."""
    policy = engine.runner.policy
    policy.selector.choose = lambda *a, **k: arm
    policy.selector.kept = lambda *a, **k: None
    observe = policy._observe_arm

    def watch(plan, accepted, room, measured):
        if plan.arm == CHAIN_ARM:
            record.extend((accepted[i], True, accepted[i]) for i in plan.draft_rows)
        else:
            record.extend((run, not spine_end, by[-1]) for by, run, spine_end in measured)
        return observe(plan, accepted, room, measured)

    policy._observe_arm = watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--trees", default="8,16,32", help="comma-separated tree sizes from the policy's grid")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = args.concurrency
    spec = PolicyGridSpec(temperatures=[0.0], concurrency=[c], num_prompts=args.num_prompts, passes=args.passes)
    base, ids, need = grid_prompts(spec)
    engines = {"chain": cell_engine(spec, "auto", c, need, base)}
    grid = [int(b) for b in engines["chain"].runner.policy.grid]
    try:
        sizes = [int(x) for x in args.trees.split(",") if x]
    except ValueError:
        raise SystemExit(f"flashtree: --trees takes sizes separated by commas, got {args.trees!r}")
    if not sizes or any(b not in grid for b in sizes):
        raise SystemExit(f"flashtree: --trees must name sizes of the policy's grid {grid}, got {args.trees!r}")
    arms = {"chain": CHAIN_ARM} | {f"tree {b}": grid.index(b) for b in sizes}
    for name in arms:
        if name not in engines:
            engines[name] = cell_engine(spec, "auto", c, need, base)
    records: dict[str, list] = {name: [] for name in arms}
    for name, arm in arms.items():
        held(engines[name], arm, records[name])
    run_cell(spec, ids, 0.0, c, {name: engines[name] for name in arms})
    depth = engines["chain"].runner.policy.depth
    print(f"T = 0, c = {c}: drafted tokens walked a row (uncut) and the chain's estimate from each arm's rounds")
    for name, rows in records.items():
        own = sum(x for _, _, x in rows) / len(rows)
        km, table = kaplan_meier([(r, exact) for r, exact, _ in rows], depth)
        ended = sum(1 for _, exact, _ in rows if not exact) / len(rows)
        print(f"  {name:8s} rows {len(rows):5d}  own walk {own:.2f}  chain estimate {km:.2f}  spine ended {ended:.2f}")
        print("           stopped per depth: " + " ".join(f"{d}:{s:.2f}({n})" for d, (n, s) in enumerate(table[:12])))


if __name__ == "__main__":
    main()
