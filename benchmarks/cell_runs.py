"""One cell of `flashtree bench --policy-grid`, run again and again on fresh engines (each run its
own process), optionally alternating between code trees: how auto's ratio to the best fixed
label spreads from run to run, and whether a change moves it past that spread.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/cell_runs.py --temperature 0 --concurrency 4 \
        --labels auto,dflash,ddtree-8 --runs 10 [--code /path/to/worktree-a,/path/to/worktree-b]

Each run builds the labels' engines, runs the grid's streams for that cell in the grid's turns
(one unrecorded stream first) and prints auto's tokens per second over the fastest other
label's, the others' ratios, and auto's rounds by kind. With --code, run i takes each tree in
turn (a `git worktree` of another commit, put first on PYTHONPATH), so drift on the machine
falls on every tree alike; the summary gives each tree's mean, minimum and maximum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import Counter

LINE = "cell_runs:"


def one_run(t: float, c: int, labels: list[str], passes: int, num_prompts: int) -> None:
    """The cell once, in this process; prints one LINE."""
    import torch

    from flashtree.bench.policy_grid import PolicyGridSpec, cell_engine, grid_prompts, run_cell

    torch.set_num_threads(1)
    spec = PolicyGridSpec(temperatures=[t], concurrency=[c], num_prompts=num_prompts, passes=passes)
    base, ids, need = grid_prompts(spec)
    cells = run_cell(spec, ids, t, c, {x: cell_engine(spec, x, c, need, base) for x in labels})
    top = max(cells[x].tokens_per_s for x in labels if x != "auto")
    modes = Counter(cells["auto"].modes)
    total = max(1, sum(modes.values()))
    print(f"{LINE} {cells['auto'].tokens_per_s / top:.4f} "
          + " ".join(f"{x}={cells[x].tokens_per_s / top:.3f}" for x in labels if x != "auto")
          + "  auto's rounds " + "/".join(f"{100 * modes.get(m, 0) / total:.0f}%" for m in ("ar", "chain", "tree"))
          + " (ar/chain/tree)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--labels", default="auto,dflash,ddtree-8",
                    help="comma-separated grid labels, auto among them (ar, dflash, ddtree-B; '#n' for copies)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--code", default="", help="comma-separated source trees to alternate (default: this one)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single run, in this process
    args = ap.parse_args()
    labels = [x for x in args.labels.split(",") if x]
    if "auto" not in labels or len(labels) < 2:
        raise SystemExit("flashtree: --labels needs auto and at least one fixed label, e.g. auto,dflash,ddtree-8")
    if len(set(labels)) != len(labels):
        raise SystemExit("flashtree: each label must be distinct; add '#2', '#3' to copies")
    if args.one:
        one_run(args.temperature, args.concurrency, labels, args.passes, args.num_prompts)
        return
    trees = [x for x in args.code.split(",") if x] or [""]
    for tree in trees:
        if tree and not os.path.isdir(os.path.join(tree, "flashtree")):
            raise SystemExit(f"flashtree: --code {tree!r} holds no flashtree package; pass a checkout's root")
    ratios: dict[str, list[float]] = {tree: [] for tree in trees}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--temperature", str(args.temperature),
           "--concurrency", str(args.concurrency), "--labels", ",".join(labels), "--passes", str(args.passes),
           "--num-prompts", str(args.num_prompts)]
    for i in range(args.runs):
        for tree in trees:
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree)] + [p for p in [env.get("PYTHONPATH")] if p])
            out = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree) if tree else None, capture_output=True,
                                 text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith(LINE)), None)
            if line is None:
                raise SystemExit(f"flashtree: run {i + 1} failed{' on ' + tree if tree else ''}: "
                                 f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}")
            ratios[tree].append(float(line.split()[1]))
            print(f"run {i + 1:2d} {tree or '.'}: auto / best {line[len(LINE):].strip()}", flush=True)
    for tree, xs in ratios.items():
        print(f"{tree or '.'}: auto / best mean {statistics.mean(xs):.3f}, {min(xs):.3f}-{max(xs):.3f} over {len(xs)} runs")


if __name__ == "__main__":
    main()
