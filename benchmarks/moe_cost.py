"""Cost of the three host-sync-free expert paths of flashtree/models/moe.py, by token count.

    OMP_NUM_THREADS=1 python benchmarks/moe_cost.py                  # tiny + Qwen3-30B-A3B/4 shapes
    OMP_NUM_THREADS=1 python benchmarks/moe_cost.py --dtype bfloat16

For each expert shape and T in --tokens, every path runs the same routed batch (random router
logits), interleaved round-robin, and the median ms over --repeats is printed per path. The
paths agree to rounding (checked here too). Qwen3-30B-A3B has E=128, k=8, d=2048, I=768; the
scaled shape keeps E and k and divides d and I by --scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtree.models.moe import Experts, Router, grouped_mm_works


def time_paths(experts: Experts, router: Router, tokens: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=gen).to(dtype)
    index, weight = router(x)
    paths = ["gather", "dense"] + (["grouped"] if grouped_mm_works(x, x.shape[-1], experts.hidden) else [])
    outs = {p: experts(x, index, weight, path=p) for p in paths}  # warm-up, and the agreement check
    ref = outs["dense"].float()
    for p, y in outs.items():
        err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-9)
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), (p, err)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats):
        for p in paths:
            t0 = time.perf_counter()
            experts(x, index, weight, path=p)
            times[p].append((time.perf_counter() - t0) * 1e3)
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--scale", type=int, default=4, help="divide Qwen3-30B-A3B's d and I by this")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    shapes = {"tiny (E=4 k=2 d=32 I=16)": (4, 2, 32, 16),
              f"Qwen3-30B-A3B/{a.scale} (E=128 k=8 d={2048 // a.scale} I={768 // a.scale})":
                  (128, 8, 2048 // a.scale, 768 // a.scale)}
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} dtype={a.dtype}; median ms per layer call")
    for name, (e, k, d, i) in shapes.items():
        with torch.no_grad():
            experts = Experts(e, d, i).to(dtype)
            router = Router(e, d, k, normalize=True).to(dtype)
            router.weight.normal_(0, 1)
            print(f"\n{name}")
            print(f"{'T':>5} {'T*k':>6} " + " ".join(f"{p:>9}" for p in ("gather", "grouped", "dense")) + "  fastest")
            for t in a.tokens:
                ms = time_paths(experts, router, t, a.repeats, dtype)
                cells = " ".join(f"{ms[p]:9.3f}" if p in ms else f"{'-':>9}" for p in ("gather", "grouped", "dense"))
                print(f"{t:5d} {t * k:6d} {cells}  {min(ms, key=ms.get)}")


if __name__ == "__main__":
    main()
