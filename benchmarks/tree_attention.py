"""One verify layer's tree attention, old (one additive bias over prefix + window, one SDPA) against
new (mask-free prefix + masked tree part, merged by log-sum-exp: flashtree/models/tree_attention.py).

    python benchmarks/tree_attention.py                      # demo target's heads, float32, on the CPU
    python benchmarks/tree_attention.py --shape 8b --dtype bfloat16 --contexts 1024 8192

Per-layer milliseconds (median) and the per-forward mask build, which a forward pays once for all
its layers. `--rows 4 --uneven` gives a batch at different lengths (the new path's padding mask).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flashtree.bench.tree_attention import time_tree_attention  # noqa: E402

SHAPES = {"demo": (4, 2, 64), "8b": (32, 8, 128)}  # heads, kv heads, head dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    heads, kv_heads, head_dim = SHAPES[args.shape]
    print(f"{args.shape} heads {heads}/{kv_heads}x{head_dim}, {args.dtype}, {args.device}, rows {args.rows}"
          f"{' uneven' if args.uneven else ''}, torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print("| context | nodes | old layer ms | new layer ms | new / old | old mask ms | new mask ms | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for nodes in args.nodes:
            r = time_tree_attention(torch.device(args.device), getattr(torch, args.dtype), heads, kv_heads, head_dim,
                                    context, nodes, args.rows, args.uneven, args.repeats)
            print(f"| {context} | {nodes} | {r['old_layer_ms']:.3f} | {r['new_layer_ms']:.3f} | "
                  f"{r['new_layer_ms'] / r['old_layer_ms']:.2f} | {r['old_mask_ms']:.3f} | {r['new_mask_ms']:.3f} | "
                  f"{r['max_abs_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
