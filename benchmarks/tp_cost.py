"""Per-round time with the target split over 2 ranks (tensor parallelism) against 1, on the CPU.

    python benchmarks/tp_cost.py --threads 1 --reps 5
    python benchmarks/tp_cost.py --rss-mb 1024          # also: peak host RSS of loading one rank

Runs the demo pair (or --target/--drafter) with tensor_parallel_size 1 and 2 side by side in
one process (rank 0 here, rank 1 a spawned worker), each rank with --threads threads; the two
engines alternate, rep by rep, so drift on a shared machine lands on both. Per-round time =
generate wall time / rounds, per method; the median over reps is reported with the TP=2/TP=1
ratio. Also printed: each rank's target weights in bytes (what it holds in memory) against
the whole target's. On the CPU each rank's share of a matmul shrinks while every decoder
layer adds two all-reduces (plus the embedding's and the LM head's gather) through gloo, so
for a small model TP=2 is slower: this measures by how much.

--rss-mb writes a random Qwen3-shaped float32 checkpoint of that size (load_memory.py's) and
loads it in a fresh process per rank, as a tensor-parallel rank does (load_target with
tp=TensorParallel(rank, 2): no process group is needed to load), reporting each one's peak
RSS above its post-import baseline next to the whole model's (Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams


CHILD = r"""
import json, sys, torch
import transformers  # the engine imports it anyway: not the loader's cost
from flashtree.models.loader import load_target
from flashtree.parallel import TensorParallel

def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024

rank, world = int(sys.argv[2]), int(sys.argv[3])
with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current RSS
    f.write("5")
base = hwm()
cpu = torch.device("cpu")
model = load_target(sys.argv[1], torch.float32, cpu, tp=TensorParallel(rank, world, cpu) if world > 1 else None)
print(json.dumps({"rss": hwm() - base, "weights": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def load_rss(size_mb: float) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from load_memory import write_checkpoint

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(Path(tmp) / "ckpt", size_mb)
        print(f"\nloading a {total / 1e6:.0f} MB float32 checkpoint (4 shards), a fresh process each:\n")
        print("| ranks | rank | peak RSS delta MB | x checkpoint | weights held MB |")
        print("|---|---|---|---|---|")
        for world, rank in [(1, 0), (2, 0), (2, 1)]:
            env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
            run = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / "ckpt"), str(rank), str(world)],
                                 env=env, capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"| {world} | {rank} | {r['rss'] / 1e6:.0f} | {r['rss'] / total:.2f} | {r['weights'] / 1e6:.0f} |",
                  flush=True)


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
    ap.add_argument("--rss-mb", type=float, help="also measure loading one rank of a checkpoint this big")
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
    if args.rss_mb:
        load_rss(args.rss_mb)


if __name__ == "__main__":
    main()
