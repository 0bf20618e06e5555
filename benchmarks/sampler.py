"""The batched seed-exact sampler against the per-request one it replaced (adc07cc's pick_tokens).

    OMP_NUM_THREADS=1 python benchmarks/sampler.py [--vocab 4096 151936] [--repeats 5]

One round's logits [R, N, V] (R = 8 requests, N = 65 nodes, depth bound 15, so 16 distinct
positions per row). Per case it alternates old and new, `repeats` times each, and prints the
median seconds and old / new. Cases: all greedy; all T = 0.8 (plain); all T = 0.8, top_p = 0.9
on peaked logits (the nucleus fits in the candidates); and top_p = 0.9 at T = 1.5 on flat logits,
where every node's nucleus is wider than 1024 tokens, so the new sampler falls back to the full sort.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtree.sampler import SamplingBatch, pick  # noqa: E402
from flashtree.sampling import SamplingParams  # noqa: E402


# ---- the old sampler, as it was at adc07cc (a Python loop, a full sort for top-p) ---------------

def old_probabilities(logits, params):
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def old_pick_tokens(logits, params, generators):
    picks = logits.argmax(-1)
    for r, p in enumerate(params):
        if not p.greedy:
            probs = old_probabilities(logits[r], p)
            noise = torch.empty_like(probs).exponential_(generator=generators[r])
            picks[r] = (probs / noise).argmax(-1)
    return picks


def median_seconds(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    R, N, depth = 8, 65, 15
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, R={R} N={N} depth bound {depth}")
    print(f"{'V':>7} {'case':<22} {'old s':>8} {'new s':>8} {'old/new':>8}")
    for V in args.vocab:
        g = torch.Generator().manual_seed(0)
        peaked = torch.randn(R, N, V, generator=g) * 4.0
        flat = torch.randn(R, N, V, generator=g) * 0.5
        depths = torch.randint(1, depth + 1, (R, N), generator=g)
        depths[:, 0] = 0
        positions = torch.arange(R)[:, None] * 7 + 100 + depths + 1
        cases = [
            ("greedy", peaked, SamplingParams()),
            ("T=0.8", peaked, SamplingParams(temperature=0.8)),
            ("T=0.8 top_p=0.9", peaked, SamplingParams(temperature=0.8, top_p=0.9)),
            ("T=1.5 top_p=0.9 flat", flat, SamplingParams(temperature=1.5, top_p=0.9)),
        ]
        for name, logits, p in cases:
            params = [SamplingParams(**{**vars(p), "seed": i}) for i in range(R)]
            gens = [None if q.greedy else torch.Generator().manual_seed(i) for i, q in enumerate(params)]

            def old():
                old_pick_tokens(logits, params, gens)

            def new():
                pick(logits, SamplingBatch.build(params, list(range(R)), cpu), positions, depth + 1)

            old(), new()  # warm up
            t_old, t_new = [], []
            for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
                t_old += median_seconds(old, 1)
                t_new += median_seconds(new, 1)
            a, b = statistics.median(t_old), statistics.median(t_new)
            print(f"{V:>7} {name:<22} {a:>8.4f} {b:>8.4f} {a / b:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
