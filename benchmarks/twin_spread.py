"""How far apart identical engines come out in the policy grid's measurement, and where auto sits
among them: one (temperature, concurrency) cell of `flashtree bench --policy-grid`, with several
copies of each label, stepped in the grid's interleaved turns on the grid's streams.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/twin_spread.py --temperatures 0,0.7 \
        --concurrency 1 --labels ar,ar#2,ar#3,auto,auto#2 --passes 3 [--turn-ms 250]

Prints each engine's tokens per second over all streams and its ratio to the fastest, and per
stream the ratios to that stream's fastest (the rms of their shortfall is the per-stream noise).
The grid's 0.97 goal is read against this spread: a cell's ratio carries it either way.
"""

from __future__ import annotations

import argparse
import math

import torch

from flashtree.bench.policy_grid import (SLICE, GridCell, PolicyGridSpec, Stream, cell_engine, cell_streams,
                                         grid_prompts, run_interleaved)


def spread(spec: PolicyGridSpec, engines: dict, ids: list[list[int]], t: float, c: int, turn_ms: float) -> None:
    """One cell's streams on every engine, interleaved; print the spread."""
    labels = list(engines)
    cells = {label: GridCell(t, c, label) for label in labels}
    shortfall = []
    for w, prompts, params, _ in cell_streams(spec, ids, t, c):
        seen = {label: (cells[label].tokens, cells[label].seconds) for label in labels}
        run_interleaved([Stream(engines[label], prompts, params, GridCell(t, c, label) if w < 0 else cells[label], c,
                                keep=False) for label in labels],
                        slice_seconds=turn_ms / 1e3, seed=0 if w < 0 else spec.seed + 1 + w)
        if w < 0:
            continue
        rate = {x: (cells[x].tokens - seen[x][0]) / (cells[x].seconds - seen[x][1]) for x in labels}
        top = max(rate.values())
        shortfall += [1.0 - r / top for r in rate.values()]
        print(f"stream {w + 1:3d}  " + "  ".join(f"{x} {rate[x] / top:.3f}" for x in labels), flush=True)
    top = max(cell.tokens_per_s for cell in cells.values())
    print(f"T = {t:g}, c = {c}, turns of {turn_ms:g} ms; per-stream rms shortfall "
          f"{math.sqrt(sum(x * x for x in shortfall) / len(shortfall)):.3f}")
    for x in labels:
        modes = cells[x].modes
        mix = "/".join(f"{100 * modes.get(m, 0) / max(1, sum(modes.values())):.0f}%" for m in ("ar", "chain", "tree"))
        print(f"  {x:12s} {cells[x].tokens_per_s:8.1f} tok/s  {cells[x].tokens_per_s / top:.3f}x the fastest"
              f"  rounds ar/chain/tree {mix}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperatures", default="0", help="comma-separated, run in order on the same engines (as the grid)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--labels", default="ar,ar#2,ar#3,ar#4",
                    help="comma-separated grid labels (ar, dflash, ddtree-B, auto), '#n' for copies")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--turn-ms", type=float, default=SLICE * 1e3, help="a turn's length (the grid's default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    labels = [x for x in args.labels.split(",") if x]
    if len(set(labels)) != len(labels):
        raise SystemExit("flashtree: each label must be distinct; add '#2', '#3' to copies")
    try:
        temps = [float(x) for x in args.temperatures.split(",")]
    except ValueError:
        raise SystemExit(f"flashtree: --temperatures takes numbers separated by commas, got {args.temperatures!r}")
    c = args.concurrency
    spec = PolicyGridSpec(temperatures=temps, concurrency=[c], num_prompts=args.num_prompts, passes=args.passes)
    base, ids, need = grid_prompts(spec)
    engines = {label: cell_engine(spec, label, c, need, base) for label in labels}
    for t in temps:
        spread(spec, engines, ids, t, c, args.turn_ms)


if __name__ == "__main__":
    main()
