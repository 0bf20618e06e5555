"""budget="auto" on workloads it was never tuned on: auto against every fixed method, per
(temperature, batch) cell, with batches that fill at once and batches that fill gradually.

The policy's constants were set on the bench suites (flashtree/bench/prompts: held-out stdlib
files, `flashtree bench --policy-grid`). This benchmark's prompts come from elsewhere: Python
files of packages installed beside flashtree (tqdm, click, uvicorn, pydantic, huggingface_hub),
cut at function definitions (code) and docstrings (prose), each with its own output length from
32 to 512 tokens (ignore_eos, seeded). Nothing here was looked at while setting the policy.

Per cell, every engine (ar, dflash, ddtree at 4-64 nodes, auto, and a second `ar`, the twin)
shares the loaded weights and runs the same requests:
- at once: all the cell's requests added together, max_batch = the batch (LLM.generate's shape);
- gradual: one request arrives every few engine steps until all have (a server's shape).
The engines run at the same time, in turns of about 50 ms of their own steps in a new random
order each turn (policy_grid.run_interleaved), so the box's drift falls on all alike: run one
after another, a cell's engines met different minutes of the machine, and identical work came
out up to 40% apart. A label's rate is its tokens over its own steps' CPU seconds (the
process's; run it with one thread), all passes together: CPU time leaves out the time the
process waited for its core while other jobs ran, which wall time charged to whichever engine
was stepping; auto starts fresh in every cell and keeps what it learned from pass to pass, as a
server does, so its learning is in the number. Its cost tables are measured afresh for each run, in
a cache directory of the run's own (an earlier run's refinements, learned beside whatever it ran
with, would price this one). The twin shows the spread of identical engines.

    OMP_NUM_THREADS=1 python benchmarks/policy_heldout.py --out heldout.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from flashtree.bench.policy_grid import TWIN, GridCell, run_interleaved  # noqa: E402

PACKAGES = ("tqdm", "click", "uvicorn", "pydantic", "huggingface_hub")
LENGTHS = (32, 64, 128, 256, 512)
LABELS = ["ar", "dflash", "ddtree-4", "ddtree-8", "ddtree-16", "ddtree-32", "ddtree-64", "auto"]


def heldout_prompts(n: int, seed: int = 0, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """n prompts of 200-400 characters, half code (ending at a def line), half prose (ending
    inside a docstring), from the installed packages' sources, in a seeded order."""
    import importlib.util

    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"policy_heldout: {name!r} is not an installed package; pick others with --packages")
        files += sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py"))
    code, prose = [], []
    for f in files:
        text = f.read_text(errors="ignore")
        for m in re.finditer(r"\n(?:    )?def [^\n]*\n", text):
            if m.end() > 300:
                code.append(text[m.end() - 300 : m.end()])
        for m in re.finditer(r'"""[A-Za-z]', text):
            if m.start() > 200:
                prose.append(text[m.start() - 200 : m.start() + 100])
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    return [p for pair in zip(code, prose) for p in pair][:n]


def engine(label: str, batch: int, base: LLMEngine | None, drafter: str | None, device: str | None = None,
           capture: bool = False) -> LLMEngine:
    method, budget = ("ddtree", "auto") if label.startswith("auto") else ("ar" if label == TWIN else label, 64)
    capture = capture or label == "auto-captured"  # auto's rounds captured, beside eager auto
    if label.startswith("ddtree-"):
        method, budget = "ddtree", int(label.split("-")[1])
    cfg = EngineConfig(drafter=drafter, method=method, budget=budget, max_budget=64, max_batch=batch,
                       max_model_len=1024, prefix_cache=False, device=device, capture=capture)
    return LLMEngine(cfg, share_weights=base)


class Arrivals:
    """One engine's run of a cell's requests: all added at the first step (every = 0) or one
    every `every` of its steps; only the engine's own steps count as its time, by `clock` (the
    process's CPU seconds on the CPU; wall seconds on a GPU, whose work the CPU does not do)
    (run_interleaved's protocol: step() is False once every request has finished)."""

    def __init__(self, eng: LLMEngine, ids: list[list[int]], params: list[SamplingParams], cell: GridCell,
                 every: int, clock=time.process_time) -> None:
        self.eng, self.pending, self.cell, self.every, self.clock = eng, list(zip(ids, params)), cell, every, clock
        self.reqs: list = []
        self.steps = 0

    def step(self) -> bool:
        t0 = self.clock()
        if self.pending and (not self.every or self.steps % self.every == 0):
            arriving = self.pending if not self.every else self.pending[:1]
            self.reqs += [self.eng.add_request(p, sp) for p, sp in arriving]
            self.pending = self.pending[len(arriving):]
        if self.eng.has_unfinished:
            self.eng.step()
        self.steps += 1
        self.cell.seconds += self.clock() - t0
        if self.pending or self.eng.has_unfinished:
            return True
        self.cell.tokens += sum(len(r.output_ids) for r in self.reqs)
        self.cell.outputs.append([t for r in self.reqs for t in r.output_ids])
        return False


@dataclass
class CellSettings:
    """What every cell of one run shares: the engines compared and how much each cell runs."""

    labels: list[str]  # engines to compare ("auto" and the twin among them)
    per_batch: int = 2  # requests per cell = max(8, this x batch)
    passes: int = 2
    drafter: str | None = None  # default: the demo's DFlash2 drafter
    device: str | None = None
    max_tokens: int | None = None  # a cap on every request's output length
    capture: bool = False  # every engine's rounds captured at start-up (CUDA graphs on a GPU)


def run_cell(base: LLMEngine, texts: list[str], t: float, b: int, shape: str, run: CellSettings) -> dict:
    """One (temperature, batch, fill) cell: every label's engine on the same requests, interleaved;
    rates, auto against the best fixed method and `ar`, and whether all emitted the same tokens."""
    labels = run.labels
    n = max(8, run.per_batch * b)
    ids = [base.encode(x)[-400:] for x in texts[:n]]
    lengths = [min(LENGTHS[i % len(LENGTHS)], run.max_tokens or LENGTHS[-1]) for i in range(n)]
    params = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=1000 + i) for i, m in enumerate(lengths)]
    engines = {label: engine(label, b, base, run.drafter, run.device, run.capture) for label in labels}
    cells = {label: GridCell(t, b, label) for label in labels}
    clock = time.perf_counter if base.device.type == "cuda" else time.process_time
    for p in range(run.passes):
        run_interleaved([Arrivals(engines[label], ids, params, cells[label], 0 if shape == "at-once" else 2, clock)
                         for label in labels], seed=1000 * p + 10 * b + round(10 * t) + (shape == "gradual"))
    rate = {label: c.tokens_per_s for label, c in cells.items()}
    fixed = {k: v for k, v in rate.items() if not k.startswith("auto") and k != TWIN}
    top = max(fixed, key=fixed.get)
    row = {"temperature": t, "batch": b, "shape": shape, "requests": n, "tok_s": rate,
           "best_fixed": top, "auto_x_best": rate["auto"] / fixed[top], "auto_x_ar": rate["auto"] / rate["ar"],
           "twin_x_ar": rate[TWIN] / rate["ar"],
           "same_tokens": all(c.outputs == cells["ar"].outputs for c in cells.values())}
    print(f"T={t} batch={b} {shape:8s} auto {rate['auto']:7.1f} tok/s | best {top} {fixed[top]:7.1f} | "
          f"auto/best {row['auto_x_best']:.3f} auto/ar {row['auto_x_ar']:.3f} twin/ar {row['twin_x_ar']:.3f}"
          + ("" if row["same_tokens"] else " OUTPUTS DIFFER"), flush=True)
    print("    " + "  ".join(f"{k} {v:.0f}" for k, v in rate.items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=["at-once", "gradual"], choices=["at-once", "gradual"])
    ap.add_argument("--per-batch", type=int, default=2, help="requests per cell = max(8, this x batch)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--packages", nargs="+", default=list(PACKAGES),
                    help="installed packages whose sources give the prompts (a second held-out set: "
                         "starlette anyio httpx jinja2 requests)")
    ap.add_argument("--labels", nargs="+", default=LABELS,
                    help="engines to compare; auto is always one (auto-captured: auto with captured rounds)")
    ap.add_argument("--drafter", default=None, help="default: the demo's DFlash2 drafter")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (cuda: timed by wall clock)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every request's output length")
    ap.add_argument("--capture", action="store_true", help="capture every engine's rounds at start-up")
    ap.add_argument("--cost-cache", default=None,
                    help="directory for auto's cost tables (default: a fresh one for this run, so no earlier "
                         "run's refined prices carry over; 'user': flashtree's usual cache)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cost_cache != "user":  # engines read it from the environment (EngineConfig.cost_cache None)
        os.environ["FLASHTREE_CACHE_DIR"] = args.cost_cache or tempfile.mkdtemp(prefix="flashtree-heldout-")
    labels = list(dict.fromkeys([*args.labels, "auto", TWIN]))
    base = engine("ar", 1, None, args.drafter, args.device)
    texts = heldout_prompts(max(8, args.per_batch * max(args.batches)) * 2, packages=tuple(args.packages))
    run = CellSettings(labels, args.per_batch, args.passes, args.drafter, args.device, args.max_tokens, args.capture)
    rows = [run_cell(base, texts, t, b, shape, run)
            for t in args.temperatures for b in args.batches for shape in args.shapes]
    worst_best = min(rows, key=lambda r: r["auto_x_best"])
    worst_ar = min(rows, key=lambda r: r["auto_x_ar"])
    print(f"\nworst auto/best: {worst_best['auto_x_best']:.3f} (T={worst_best['temperature']}, batch "
          f"{worst_best['batch']}, {worst_best['shape']}); worst auto/ar: {worst_ar['auto_x_ar']:.3f} "
          f"(T={worst_ar['temperature']}, batch {worst_ar['batch']}, {worst_ar['shape']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
