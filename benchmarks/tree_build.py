"""Cost of build_tree against the floor it cannot beat: log_softmax + topk(B) over the same logits.

    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --vocab 151936 --budgets 16 64 --rows 1 8
    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --vocab 4096 --budgets 16 64 --rows 1

Every repeat times the floor and the build back to back on the same logits (interleaved, so load
from other jobs hits both alike) and each keeps its best time. `ratio` = build / floor;
`build/R` shows whether the build grows linearly in the number of rows. `--bf16` rounds the
logits to bfloat16 first, as a bf16 LM head would: many exact ties, the case the exact tie rule
exists for.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashtree.tree import build_tree


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--scale", type=float, default=3.0, help="logit standard deviation")
    ap.add_argument("--bf16", action="store_true", help="round the logits to bfloat16 (many exact ties)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    print(f"V={args.vocab} D={args.depth} threads={args.threads} best of {args.reps}"
          f"{' bf16-rounded logits' if args.bf16 else ''}")
    print("| B | R | log_softmax+topk ms | build_tree ms | ratio | build/R ms |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for budget in args.budgets:
        for rows in args.rows:
            logits = torch.randn(rows, args.depth, args.vocab, generator=g) * args.scale
            if args.bf16:
                logits = logits.bfloat16()
            roots = torch.zeros(rows, dtype=torch.long)

            def floor() -> None:
                torch.log_softmax(logits.float(), -1).topk(budget, -1)

            def build() -> None:
                build_tree(roots, logits, budget)

            with torch.inference_mode():
                t_floor, t_build = best_ms([floor, build], args.reps)
            print(f"| {budget} | {rows} | {t_floor:.2f} | {t_build:.2f} | {t_build / t_floor:.2f} "
                  f"| {t_build / rows:.2f} |")


if __name__ == "__main__":
    main()
