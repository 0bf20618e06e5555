"""Cost of build_tree against the floor it cannot beat: log_softmax + topk(B) over the same logits.

    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --vocab 151936 --budgets 16 64 --rows 1 8
    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --vocab 4096 --budgets 16 64 --rows 1 --peak 8

Every repeat times the floor and the builds back to back on the same logits (interleaved, so load
from other jobs hits all alike) and each keeps its best time. `ratio` = build / floor; `build/R`
shows whether the build grows linearly in the number of rows; `static` is build_tree(...,
prune=False), the no-host-read form a compiled caller uses. `--against FILE` also times the
build_tree of another build.py, e.g. an older one from `git show REV:flashtree/tree/build.py`.
`--bf16` rounds the logits to bfloat16 first, as a bf16 LM head would (many exact ties); `--peak P`
adds P to one token per depth, so trees go deep as with a confident drafter. `--demo N` times the
demo drafter's own logits instead (V = 4096): flashtree's engine drafts for N prompts (DFlash-1
drafter, ddtree B = 16, greedy), every drafted row is kept, and a build of R rows takes R of them.

    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --demo 8 --budgets 8 16 32 64 --rows 1 4 8 \\
        --against /tmp/old_build.py
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from flashtree.tree import build_tree

DEMO = Path(__file__).resolve().parents[1] / "flashtree" / "assets" / "demo"


def best_ms(fns: list, reps: int) -> list[float]:
    """Best time of each function over `reps` interleaved rounds (one warm-up call each first)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [1000 * b for b in best]


def demo_logits(prompts: int) -> torch.Tensor:
    """[rows, 15, 4096]: every row the demo DFlash-1 drafter drafted while flashtree's engine generated
    64 tokens for each of `prompts` prompts (code and prose suites, half each)."""
    import flashtree.engine.runner as runner
    from flashtree import LLM, SamplingParams
    from flashtree.bench.suites import load_suite

    rows = []
    build = runner.build_tree

    def keep(roots, logits, budget, **kw):
        rows.append(logits.detach().clone())
        return build(roots, logits, budget, **kw)

    runner.build_tree = keep
    try:
        llm = LLM(drafter=str(DEMO / "drafter-dflash1"), method="ddtree", budget=16, device="cpu", dtype="float32")
        texts = [p.text for s in ("code", "prose") for p in load_suite(s, (prompts + 1) // 2)][:prompts]
        llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=64))
    finally:
        runner.build_tree = build
    return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--scale", type=float, default=3.0, help="logit standard deviation")
    ap.add_argument("--bf16", action="store_true", help="round the logits to bfloat16 (many exact ties)")
    ap.add_argument("--peak", type=float, default=0.0, help="added to token 0 at every depth")
    ap.add_argument("--against", help="another build.py whose build_tree is timed too")
    ap.add_argument("--demo", type=int, metavar="N", help="time the demo drafter's logits from N prompts")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    other = None
    if args.against:
        spec = importlib.util.spec_from_file_location("other_build", args.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)

    demo = demo_logits(args.demo) if args.demo else None
    if demo is not None:
        print(f"demo drafter logits ({demo.shape[0]} drafted rows, D={demo.shape[1]}, V={demo.shape[2]}), "
              f"threads={args.threads} best of {args.reps}")
    else:
        print(f"V={args.vocab} D={args.depth} threads={args.threads} best of {args.reps}, logit std {args.scale}"
              f"{f', peak +{args.peak}' if args.peak else ''}{', bf16-rounded' if args.bf16 else ''}")
    head = "| B | R | log_softmax+topk ms | build_tree ms | ratio | build/R ms | static ms | static ratio |"
    print(head + (" against ms | against ratio |" if other else ""))
    print("|---" * (head.count("|") - 1 + (2 if other else 0)) + "|")
    g = torch.Generator().manual_seed(0)
    for budget in args.budgets:
        for rows in args.rows:
            logits = torch.randn(rows, args.depth, args.vocab, generator=g) * args.scale
            logits[:, :, 0] += args.peak
            if demo is not None:
                logits = demo[torch.randperm(demo.shape[0], generator=g)[:rows]]
            if args.bf16:
                logits = logits.bfloat16()
            roots = torch.zeros(rows, dtype=torch.long)
            fns = [
                lambda: torch.log_softmax(logits.float(), -1).topk(budget, -1),
                lambda: build_tree(roots, logits, budget),
                lambda: build_tree(roots, logits, budget, prune=False),
            ]
            if other:
                fns.append(lambda: other.build_tree(roots, logits, budget))
            with torch.inference_mode():
                t = best_ms(fns, args.reps)
            row = (f"| {budget} | {rows} | {t[0]:.2f} | {t[1]:.2f} | {t[1] / t[0]:.2f} | {t[1] / rows:.2f} "
                   f"| {t[2]:.2f} | {t[2] / t[0]:.2f} |")
            print(row + (f" {t[3]:.2f} | {t[3] / t[0]:.2f} |" if other else ""))


if __name__ == "__main__":
    main()
