"""Verify cost of a draft tree vs a causal chain of the same size on a hybrid (GDN + attention) target.

    OMP_NUM_THREADS=1 python benchmarks/hybrid_tree_cost.py --threads 1 2

A small random Qwen3.5-style target (hidden 256, 8 layers, 3 GDN : 1 attention) holds a context of
--context tokens; we then time one target forward over a window of N nodes, either a DDTree-shaped
tree (the exact top-(N-1) tree of random draft logits, depth <= 15) or a plain chain of N tokens,
without committing, so every repeat sees the same state. Prints a markdown table of medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtree.models.context import ForwardContext
from flashtree.models.qwen3_5 import Qwen35, Qwen35Args
from flashtree.tree import build_tree, chain_spec


def small_hybrid(vocab: int, seed: int = 0) -> Qwen35:
    args = Qwen35Args(
        model_type="qwen3_5_text", vocab_size=vocab, hidden_size=256, intermediate_size=768, num_layers=8,
        num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, rope={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(seed)
    model = Qwen35(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model.eval()


def median_ms(fns: list, repeats: int, warmup: int) -> list[float]:
    """Median wall time of each fn, run in alternation so a change in machine load hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in times]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--depth", type=int, default=15, help="draft depth of the trees (block size - 1)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    model = small_hybrid(args.vocab)
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(1, args.context + max(args.sizes) + 1)
    cache.set_length(0, 0)
    prompt = torch.randint(args.vocab, (1, args.context), generator=gen)
    ctx = ForwardContext.prefill(cache, [0], args.context)
    model(prompt, ctx)
    cache.commit(ctx, [args.context])

    def run(spec):  # the context (mask, tree lookups) is built inside: it is part of a verify's cost
        return lambda: model(spec.tokens.clamp(min=0), ForwardContext.verify(cache, [0], spec))

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.sizes:
            # A confident drafter: one clear favourite per depth, so the trees grow deep as well as wide.
            logits = torch.randn(1, args.depth, args.vocab, generator=gen)
            logits[0, torch.arange(args.depth), torch.randint(args.vocab, (args.depth,), generator=gen)] += 9.0
            tree = build_tree(torch.tensor([1]), logits, n - 1) if n > 1 else chain_spec(torch.tensor([[1]]))
            chain = chain_spec(torch.randint(args.vocab, (1, n), generator=gen))
            t_chain, t_tree = median_ms([run(chain), run(tree)], args.repeats, args.warmup)
            rows.append((threads, n, int(tree.depths.max()), t_chain, t_tree))
            print(f"threads {threads} N {n:4d}: chain {t_chain:7.2f} ms  tree {t_tree:7.2f} ms", flush=True)

    print(f"\ncontext {args.context}, vocab {args.vocab}, median of {args.repeats}\n")
    print("| threads | N (nodes) | tree depth | chain ms | tree ms | tree / chain | tree ms / chain ms at N=1 |")
    print("|---|---|---|---|---|---|---|")
    for threads, n, depth, t_chain, t_tree in rows:
        base = next(c for th, m, _, c, _ in rows if th == threads and m == min(args.sizes))
        print(f"| {threads} | {n} | {depth} | {t_chain:.2f} | {t_tree:.2f} | {t_tree / t_chain:.2f} | "
              f"{t_tree / base:.2f} |")


if __name__ == "__main__":
    main()
