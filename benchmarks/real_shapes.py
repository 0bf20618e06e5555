"""Round cost at real model shapes: random-weight Qwen3-0.6B / Qwen3-1.7B targets (V = 151,936, the
real hidden, head and layer counts) with a DFlash drafter of z-lab's shape for each.

The demo pair is 5.7M parameters, so fixed per-round costs (tree build, commit, dispatch) look
large there; this measures the same round where the forwards have real weight. Random weights
accept almost nothing, but every round still builds and verifies its full tree, which is what
is timed: milliseconds per round, and per round as a multiple of the AR step, at B in {16, 64,
256} and batch in {1, 8}, eager vs captured (capture=True), float32 and bfloat16.

    OMP_NUM_THREADS=1 python benchmarks/real_shapes.py --models 0.6b --batches 1 --budgets 16 64
    python benchmarks/real_shapes.py --models 0.6b 1.7b --capture both --dtypes float32 bfloat16   # the full grid

On a 2-core CPU the full grid takes hours (a 257-node verify of 1.7B at batch 8 is ~7 TFLOP);
the defaults are the subset this project's CPU box can run. The same functions time the
Qwen3-8B shape on a GPU in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import gpu_check as gc

SHAPES = {
    # The hub configs' hidden, intermediate, layer and head counts; both tie their embeddings.
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["0.6b"], choices=sorted(SHAPES))
    ap.add_argument("--budgets", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--capture", choices=["off", "on", "both"], default="off",
                    help="captured rounds (capture=True), eager, or both")
    ap.add_argument("--drafter-layers", type=int, default=1, help="z-lab ships 1- to 5-layer drafters")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--budget-seconds", type=float, default=3600.0)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    gc.DEVICE = args.device
    deadline = gc.Deadline(args.budget_seconds)
    captures = {"off": [False], "on": [True], "both": [False, True]}[args.capture]
    plan = [(c, b, m, budget) for c in captures for b in args.batches
            for m, budget in [("ar", 1), ("dflash", 16)] + [("ddtree", x) for x in args.budgets]]
    results = {}
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            target, drafter = Path(tmp) / "target", Path(tmp) / "drafter"
            gc.write_qwen3(target, SHAPES[name])
            gc.write_drafter(drafter, SHAPES[name], args.drafter_layers)
            for dtype in args.dtypes:
                rows = gc.round_rows(target, drafter, plan, deadline, dtype, prompt_len=args.prompt_len,
                                     max_tokens=args.max_tokens)
                rows.pop(0)  # weight bytes
                load = rows.pop(0)["load_seconds"]
                results[f"{name} {dtype}"] = rows
                print(f"\n## Qwen3-{name.upper()} shape, random weights, {dtype}, {args.device} "
                      f"(load {load:.1f} s, drafter {args.drafter_layers} layer(s))\n")
                print("\n".join(gc.stage_table(rows)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
