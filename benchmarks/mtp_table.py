"""MTP against DFlash and DDTree on the demo pair: tau and tok/s, T x batch, every cell in one run.

    OMP_NUM_THREADS=1 python benchmarks/mtp_table.py --temperatures 0,0.7 --concurrency 1,8

Cells: ar, mtp at each k (the demo target's trained head), dflash (the default DFlash2 drafter's
chain) and ddtree with budget="auto" (the default pair: `LLM()`). They run as the policy grid runs
its cells (flashtree.bench.policy_grid.run_cell): streams of requests kept `c` in flight, every
cell in turns of ~50 ms interleaved in a new random order each pass, one unrecorded warmup stream,
seeded requests run to max_tokens (every cell emits the same tokens; tests check that). A cell's tok/s
is its output tokens over its own steps' wall time; tau is tokens per round, the bonus included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from flashtree.bench.policy_grid import PolicyGridSpec, grid_prompts, run_cell
from flashtree.config import EngineConfig
from flashtree.engine import LLMEngine


FAMILY = {"ar": "ar", "mtp": "mtp", "dflash": "drafter", "ddtree": "drafter"}  # what an engine's weights are


def engines(labels: list[str], concurrency: int, need: int, base: LLMEngine) -> dict[str, LLMEngine]:
    """One engine per label, all on the base engine's target; mtp cells share one head, the
    drafting cells one drafter."""
    out: dict[str, LLMEngine] = {}
    for label in labels:
        method, _, arg = label.partition("-")
        kw = dict(max_batch=concurrency, max_model_len=need, prefix_cache=False)
        if method == "mtp":
            config = EngineConfig(method="mtp", num_speculative_tokens=int(arg), **kw)
        elif method == "ddtree":
            config = EngineConfig(method="ddtree", budget="auto" if arg == "auto" else int(arg), **kw)
        else:
            config = EngineConfig(method=method, **kw)
        family = FAMILY[method]
        kin = next((e for lab, e in out.items() if FAMILY[lab.split("-")[0]] == family), base)
        out[label] = LLMEngine(config, share_weights=kin)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--ks", default="1,3,5")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", help="also write every cell here")
    a = ap.parse_args()
    temps = [float(x) for x in a.temperatures.split(",")]
    conc = [int(x) for x in a.concurrency.split(",")]
    labels = ["ar"] + [f"mtp-{k}" for k in a.ks.split(",")] + ["dflash", "ddtree-auto"]
    spec = PolicyGridSpec(temperatures=temps, concurrency=conc, num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                          passes=a.passes, twin=False)
    base, ids, need = grid_prompts(spec)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows = []
    print(f"demo pair, {len(ids)} prompts x {a.max_tokens} tokens, passes {a.passes}, load {load}", file=sys.stderr)
    print("| T | batch | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for c in conc:
        cell_engines = engines(labels, c, need, base)
        for t in temps:
            cells = run_cell(spec, ids, t, c, cell_engines)
            parts = []
            for label in labels:
                cell = cells[label]
                tau = (cell.accepted + cell.rounds) / max(1, cell.rounds)
                parts.append(f"{tau:.2f} / {cell.tokens_per_s:.0f}")
                rows.append({"temperature": t, "concurrency": c, "label": label, "tau": tau,
                             "tok_s": cell.tokens_per_s, "tokens": cell.tokens, "seconds": cell.seconds,
                             "rounds": cell.rounds})
            print(f"| {t:g} | {c} | " + " | ".join(parts) + " |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "load_average_start": load, "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
