"""Condense a `flashtree bench` results.json into the tables docs/benchmarks.md shows.

    python benchmarks/bench_tables.py runs/bench/default/results.json [--suite all]

    python benchmarks/bench_tables.py results.json --plots docs/figures --prefix bench_default_

Prints: the environment line, the per-cell table for one suite (default: pooled "all"), the
cost curve at the budgets' window sizes, and per temperature the best budget measured and
predicted. Everything comes from the JSON; nothing is re-measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtree.bench.metrics import CellSummary  # noqa: E402
from flashtree.bench.report import markdown_table  # noqa: E402


def cells_of(data: dict, suite: str) -> list[CellSummary]:
    fields = set(CellSummary.__dataclass_fields__)
    return [CellSummary(**{k: v for k, v in c.items() if k in fields}) for c in data["cells"] if c["suite"] == suite]


def environment_line(data: dict) -> str:
    env, spec = data["environment"], data["spec"]
    git = env.get("git") or {}
    load = data.get("load_average_start")
    return (f"{env['device_name']} ({env['device']}, {env['dtype']}, {env['torch_threads']} thread(s), "
            f"{env['cpu_count']} CPUs), torch {env['torch']}, commit {(git.get('commit') or '?')[:10]}"
            f"{' (dirty tree)' if git.get('dirty') else ''}; load average at start "
            f"{'/'.join(f'{x:.1f}' for x in load) if load else '?'}; "
            f"{spec['num_prompts']} prompts per suite x {spec['max_tokens']} tokens; run took {data['seconds'] / 60:.1f} min")


def cost_rows(data: dict) -> str:
    cost = data["cost_curve"]
    temps = [str(float(t)) for t in data["spec"]["temperatures"]]
    wanted = {1} | {b + 1 for b in data["spec"]["budgets"] if b != "auto"}
    head = ["nodes", "forward ms"] + [f"verify ms, T={float(t):g}" for t in temps] + ["x T(1)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("--:" for _ in head) + "|"]
    base = cost["tree"][0]["forward_ms"]
    for kind in ("tree", "chain"):
        for p in cost[kind]:
            if kind == "tree" and p["nodes"] not in wanted:
                continue
            if kind == "chain" and p["nodes"] == 1:
                continue
            name = str(p["nodes"]) + (" (chain)" if kind == "chain" else "")
            verify = [f"{p['forward_ms'] + p['pick_ms'].get(t, 0.0):.2f}" for t in temps]
            lines.append("| " + " | ".join([name, f"{p['forward_ms']:.2f}", *verify, f"{p['forward_ms'] / base:.1f}"]) + " |")
    return "\n".join(lines)


def best_rows(cells: list[CellSummary]) -> list[str]:
    out = []
    for t in sorted({c.temperature for c in cells}):
        cs = [c for c in cells if c.temperature == t and c.method != "ar" and c.speedup is not None]
        if not cs:
            continue
        best = max(cs, key=lambda c: c.speedup)
        fixed = [c for c in cs if c.predicted_speedup is not None and c.method == "ddtree"]
        pred = max(fixed, key=lambda c: c.predicted_speedup) if fixed else None
        line = f"- T={t:g}: fastest measured {best.label} ({best.speedup:.2f}x, tau {best.tau:.2f})"
        if pred is not None:
            line += f"; best ddtree budget by the cost model: B={pred.budget} ({pred.predicted_speedup:.2f}x predicted)"
        out.append(line)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--suite", default="all")
    p.add_argument("--plots", metavar="DIR", help="also redraw the PNGs into DIR (from the JSON, no re-measuring)")
    p.add_argument("--prefix", default="", help="file name prefix for --plots, e.g. bench_default_")
    args = p.parse_args()
    data = json.loads(Path(args.results).read_text())
    if args.plots:
        from flashtree.bench.plots import write_plots
        from flashtree.bench.report import result_from_json

        write_plots(result_from_json(data), Path(args.plots), args.prefix)
    suite = args.suite if any(c["suite"] == args.suite for c in data["cells"]) else data["cells"][0]["suite"]
    cells = cells_of(data, suite)
    print(environment_line(data))
    for k, v in (data.get("models") or {}).items():
        print(f"{k}: {v['path']} (weights sha256 {v['sha256']})")
    print()
    print(f"Suite: {suite}\n")
    print(markdown_table(cells), "\n")
    print(f"Cost curve at context {data['cost_curve']['context_len']} (fastest of {data['cost_curve']['repeats']}):\n")
    print(cost_rows(data), "\n")
    print("\n".join(best_rows(cells)))


if __name__ == "__main__":
    main()
