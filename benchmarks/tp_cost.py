"""Per-round time with the target split over 2 ranks (tensor parallelism) against 1, on the CPU.

    python benchmarks/tp_cost.py --threads 1 --reps 5

Runs the demo pair (or --target/--drafter) with tensor_parallel_size 1 and 2 side by side in
one process (rank 0 here, rank 1 a spawned worker), each rank with --threads threads; the two
engines alternate, rep by rep, so drift on a shared machine lands on both. Per-round time =
generate wall time / rounds, per method; the median over reps is reported with the TP=2/TP=1
ratio. Also printed: each rank's target weights in bytes (what it holds in memory) against
the whole target's. On the CPU each rank's share of a matmul shrinks while every decoder
layer adds two all-reduces (plus the embedding's and the LM head's gather) through gloo, so
for a small model TP=2 is slower: this measures by how much.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtree import LLM, SamplingParams


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--methods", default="ar,dflash,ddtree")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="def parse_args(argv):\n    ")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"torch {torch.__version__}, {args.threads} thread(s) per rank, {args.max_tokens} tokens, "
          f"median of {args.reps} alternating reps\n")
    print("| method | tau | round ms TP=1 | round ms TP=2 | TP=2 / TP=1 |")
    print("|---|---|---|---|---|")
    sizes = None
    for method in args.methods.split(","):
        llms = {tp: LLM(args.target, args.drafter, method=method, budget=args.budget, device="cpu",
                        dtype="float32", max_batch=1, tensor_parallel_size=tp) for tp in (1, 2)}
        if sizes is None:
            sizes = {tp: weight_bytes(llm.engine.target) for tp, llm in llms.items()}
        per_round: dict[int, list[float]] = {1: [], 2: []}
        tokens: dict[int, list[int]] = {}
        for rep in range(args.reps + 1):  # the first rep warms up and is not counted
            for tp in ((1, 2) if rep % 2 else (2, 1)):
                t0 = time.perf_counter()
                out = llms[tp].generate([args.prompt], params)[0]
                seconds = time.perf_counter() - t0
                tokens[tp] = out.token_ids
                if rep:
                    per_round[tp].append(1e3 * seconds / out.stats.rounds)
        assert tokens[1] == tokens[2], f"{method}: TP=2 emitted other tokens than TP=1"
        tau = out.stats.mean_accept_length
        ms = {tp: statistics.median(v) for tp, v in per_round.items()}
        print(f"| {method} | {tau:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | {ms[2] / ms[1]:.2f}x |", flush=True)
        del llms
    print(f"\ntarget weights: {sizes[1] / 2**20:.1f} MiB whole, {sizes[2] / 2**20:.1f} MiB on rank 0 of 2 "
          f"({sizes[2] / sizes[1]:.2f}; embeddings and LM head split too, norms replicated)")


if __name__ == "__main__":
    main()
