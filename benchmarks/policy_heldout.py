"""budget="auto" on workloads it was never tuned on: auto against every fixed method, per
(temperature, batch) cell, with batches that fill at once and batches that fill gradually.

The policy's constants were set on the bench suites (flashtree/bench/prompts: held-out stdlib
files, `flashtree bench --policy-grid`). This benchmark's prompts come from elsewhere: Python
files of packages installed beside flashtree (tqdm, click, uvicorn, pydantic, huggingface_hub),
cut at function definitions (code) and docstrings (prose), each with its own output length from
32 to 512 tokens (ignore_eos, seeded). Nothing here was looked at while setting the policy.

Per cell, every engine (ar, dflash, ddtree at 4-64 nodes, auto) shares the loaded weights and
runs the same requests, in a shuffled order each pass, best of the passes:
- at once: all the cell's requests added together, max_batch = the batch (LLM.generate's shape);
- gradual: one request arrives every few engine steps until all have (a server's shape).
Auto keeps what it learned from one pass to the next, as a server does.

    OMP_NUM_THREADS=1 python benchmarks/policy_heldout.py --out heldout.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

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


def engine(label: str, batch: int, base: LLMEngine | None, drafter: str | None) -> LLMEngine:
    method, budget = ("ddtree", "auto") if label == "auto" else (label, 64)
    if label.startswith("ddtree-"):
        method, budget = "ddtree", int(label.split("-")[1])
    cfg = EngineConfig(drafter=drafter, method=method, budget=budget, max_budget=64, max_batch=batch,
                       max_model_len=1024, prefix_cache=False)
    return LLMEngine(cfg, share_weights=base)


def run(eng: LLMEngine, ids: list[list[int]], params: list[SamplingParams], gradual: int) -> tuple[int, float]:
    """Output tokens and wall seconds of one workload: all at once (gradual = 0) or one request
    every `gradual` steps."""
    pending = list(zip(ids, params))
    reqs, steps = [], 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished:
        if pending and (not gradual or steps % gradual == 0):
            for p, sp in (pending if not gradual else pending[:1]):
                reqs.append(eng.add_request(p, sp))
            pending = [] if not gradual else pending[1:]
        eng.step()
        steps += 1
    return sum(len(r.output_ids) for r in reqs), time.perf_counter() - t0


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
    ap.add_argument("--labels", nargs="+", default=LABELS, help="engines to compare; auto is always one")
    ap.add_argument("--drafter", default=None, help="default: the demo's DFlash2 drafter")
    ap.add_argument("--out")
    args = ap.parse_args()
    labels = list(dict.fromkeys([*args.labels, "auto"]))
    base = engine("ar", 1, None, args.drafter)
    texts = heldout_prompts(max(8, args.per_batch * max(args.batches)) * 2, packages=tuple(args.packages))
    rows = []
    for t in args.temperatures:
        for b in args.batches:
            for shape in args.shapes:
                n = max(8, args.per_batch * b)
                ids = [base.encode(x)[-400:] for x in texts[:n]]
                params = [SamplingParams(temperature=t, max_tokens=LENGTHS[i % len(LENGTHS)], ignore_eos=True,
                                         seed=1000 + i) for i in range(n)]
                engines = {label: engine(label, b, base, args.drafter) for label in labels}
                best: dict[str, float] = {}
                outputs: dict[str, int] = {}
                rng = random.Random(hash((t, b, shape)) & 0xFFFF)
                for _ in range(args.passes):
                    order = labels[:]
                    rng.shuffle(order)
                    for label in order:
                        tokens, seconds = run(engines[label], ids, params, 0 if shape == "at-once" else 2)
                        best[label] = max(best.get(label, 0.0), tokens / seconds)
                        outputs[label] = tokens
                fixed = {k: v for k, v in best.items() if k != "auto"}
                top = max(fixed, key=fixed.get)
                row = {"temperature": t, "batch": b, "shape": shape, "requests": n, "tok_s": best,
                       "best_fixed": top, "auto_x_best": best["auto"] / fixed[top], "auto_x_ar": best["auto"] / best["ar"],
                       "same_token_counts": len(set(outputs.values())) == 1}
                rows.append(row)
                print(f"T={t} batch={b} {shape:8s} auto {best['auto']:7.1f} tok/s | best {top} {fixed[top]:7.1f} | "
                      f"auto/best {row['auto_x_best']:.3f} auto/ar {row['auto_x_ar']:.3f}", flush=True)
    worst_best = min(rows, key=lambda r: r["auto_x_best"])
    worst_ar = min(rows, key=lambda r: r["auto_x_ar"])
    print(f"\nworst auto/best: {worst_best['auto_x_best']:.3f} (T={worst_best['temperature']}, batch "
          f"{worst_best['batch']}, {worst_best['shape']}); worst auto/ar: {worst_ar['auto_x_ar']:.3f} "
          f"(T={worst_ar['temperature']}, batch {worst_ar['batch']}, {worst_ar['shape']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
