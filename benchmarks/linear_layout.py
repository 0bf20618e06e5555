"""F.linear with the weight in its checkpoint layout (W contiguous) against the layout the loader uses
for float32 on the CPU (W^T contiguous, W its view) and against oneDNN's packed weight (what engines
on the CPU multiply by, flashtree/models/packed.py), over one decoder stack's linears.

Every linear of `--layers` layers of the demo target's shapes runs in turn, so the weights stream
from memory as in a forward; each layout is timed in turn, best of `--repeats`, per window of rows.
With `--engine`, the same comparison end to end: two engines per method on the demo pair (DFlash-1
drafter, float32, batch 1, greedy), one of them with its weights copied back to the checkpoint
layout (or with `--packing`, one built with pack_weights=False), taking turns prompt by prompt and
rated by the CPU seconds of their own turns.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/linear_layout.py --rows 1 16 64 --dtypes float32 bfloat16
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/linear_layout.py --engine ar dflash ddtree --passes 4
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/linear_layout.py --engine ar dflash ddtree --packing --passes 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEMO_LAYER = [(512, 256), (256, 256), (1536, 256), (256, 768)]  # qkv, o, gate_up, down of the demo target


def stack_ms(xs: list[torch.Tensor], weights: list[torch.Tensor], calls: int, product=F.linear) -> float:
    for x, w in zip(xs, weights):
        product(x, w)
    start = time.perf_counter()
    for _ in range(calls):
        for x, w in zip(xs, weights):
            product(x, w)
    return (time.perf_counter() - start) / calls * 1e3


def packed_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from flashtree.models.packed import packed_linear

    return packed_linear(x, w, None, 0, w.shape[0])


def engine_ab(methods: list[str], passes: int, max_tokens: int, packing: bool = False) -> None:
    from flashtree import LLM, SamplingParams
    from flashtree.bench.jobs import take_turns
    from flashtree.bench.suites import load_suite
    from flashtree.config import DEMO_DIR

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [p.text for suite in ("code", "prose") for p in load_suite(suite, 6)]
    runs = {}
    layouts = ("F.linear", "packed") if packing else ("W", "W^T")
    for method in methods:
        for layout in layouts:
            llm = LLM(drafter=None if method == "ar" else str(DEMO_DIR / "drafter-dflash1"), method=method,
                      budget=16, device="cpu", dtype="float32", max_batch=1,
                      pack_weights=None if layout == "packed" else False)
            if layout == "W":
                for model in (llm.engine.target, llm.engine.drafter):
                    for p in model.parameters() if model is not None else ():
                        p.data = p.data.contiguous()
            llm.generate(prompts[:1], params)  # warm-up, as a user's first request
            runs[f"{method} {layout}"] = lambda prompt, llm=llm: [o.token_ids for o in llm.generate([prompt], params)]
    out = take_turns(runs, prompts, passes)
    print(f"{len(prompts)} prompts x {max_tokens} tokens, {passes} passes; tok/s of CPU time")
    for method in methods:
        a, b = out[f"{method} {layouts[0]}"], out[f"{method} {layouts[1]}"]
        rate = [sum(map(len, r["results"])) * passes / r["cpu"] for r in (a, b)]
        print(f"{method:>8}: {layouts[0]} {rate[0]:.1f}  {layouts[1]} {rate[1]:.1f}  "
              f"{layouts[1]} / {layouts[0]} {rate[1] / rate[0]:.3f}  same tokens {a['results'] == b['results']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="window rows (tokens) per matmul")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--engine", nargs="+", choices=["ar", "dflash", "ddtree"], help="the end-to-end A/B instead")
    ap.add_argument("--packing", action="store_true", help="--engine: pack_weights=False against packed weights")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.engine:
        return engine_ab(args.engine, args.passes, args.max_tokens, args.packing)
    torch.manual_seed(0)
    print(f"{args.layers} layers of {DEMO_LAYER}, {torch.get_num_threads()} thread(s); "
          f"ms per stack, best of {args.repeats}")
    print(f"{'dtype':>9} {'rows':>5} {'W':>8} {'W^T':>8} {'packed':>8} {'W / W^T':>8} {'W^T / packed':>12}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for rows in args.rows:
            shapes = DEMO_LAYER * args.layers
            plain = [torch.randn(o, i, dtype=dtype) for o, i in shapes]
            flipped = [w.t().contiguous().t() for w in plain]
            xs = [torch.randn(rows, i, dtype=dtype) for _, i in shapes]
            best = {"W": float("inf"), "W^T": float("inf"), "packed": float("inf")}
            for _ in range(args.repeats):
                for label, weights, product in (("W", plain, F.linear), ("W^T", flipped, F.linear),
                                                ("packed", plain, packed_product)):
                    best[label] = min(best[label], stack_ms(xs, weights, args.calls, product))
            print(f"{name:>9} {rows:>5} {best['W']:>8.3f} {best['W^T']:>8.3f} {best['packed']:>8.3f} "
                  f"{best['W'] / best['W^T']:>8.2f} {best['W^T'] / best['packed']:>12.2f}")


if __name__ == "__main__":
    main()
