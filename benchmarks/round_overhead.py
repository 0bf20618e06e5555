"""Time per round split by stage, and the non-model overhead share, on a random pair.

    python benchmarks/round_overhead.py --budgets 16 64 256 --threads 1

Non-model overhead = tree build + ancestor mask + accept walk + commit (cache compaction and
drafter context append are model-side work and are reported separately).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from flashtree.models.context import ForwardContext  # noqa: E402
from flashtree.tree import accept_walk, build_chain, build_tree  # noqa: E402
from tiny import make_drafter, make_target  # noqa: E402


def median_ms(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    target = make_target(root / "t", vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                         logit_scale=3.0)
    drafter = make_drafter(root / "d", target_layers=args.layers, vocab=args.vocab, hidden=args.hidden, layers=1,
                           block_size=args.block)
    prompt = [(7 * i) % (args.vocab - 2) for i in range(args.prompt_len)]
    print(f"torch {torch.__version__}, threads {args.threads}, target {args.layers}x{args.hidden} V={args.vocab}, "
          f"drafter 1 layer, block {args.block}, prompt {args.prompt_len}, {args.max_tokens} new tokens\n")
    print("| method | tau | round ms | draft | tree | verify | commit | mask* | walk* | overhead share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, budget in [("dflash", 1)] + [("ddtree", b) for b in args.budgets]:
        engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method=method, budget=budget,
                                        device="cpu", dtype="float32", max_batch=1, max_model_len=1024))
        for _ in range(2):  # the first run warms up
            req = engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
            while engine.has_unfinished:
                engine.step()
        s = req.stats
        rounds = s.rounds
        ms = {k: 1000 * v / rounds for k, v in s.stage_seconds.items() if k != "prefill"}
        # Mask and walk run inside verify/commit; time them alone on the same shapes.
        logits = torch.randn(1, args.block - 1, args.vocab)
        spec = build_chain(torch.tensor([1]), logits) if method == "dflash" else build_tree(torch.tensor([1]), logits, budget)
        mask_ms = median_ms(lambda: ForwardContext.verify(engine.runner.cache, [0], spec))
        picks = torch.randint(0, args.vocab, (1, spec.num_nodes))
        walk_ms = median_ms(lambda: accept_walk(spec, picks))
        total = sum(ms.values())
        commit_non_model = max(0.0, ms["commit"])  # walk + host read + K/V compaction + drafter append
        overhead = ms["tree"] + mask_ms + commit_non_model
        label = "dflash (chain)" if method == "dflash" else f"ddtree {budget}"
        print(f"| {label} | {s.mean_accept_length:.2f} | {total:.2f} | {ms['draft']:.2f} | {ms['tree']:.2f} | {ms['verify']:.2f} | "
              f"{ms['commit']:.2f} | {mask_ms:.2f} | {walk_ms:.2f} | {100 * overhead / total:.1f}% |")
    print("\n*mask is part of verify, walk part of commit; both timed alone on the same shapes.")


if __name__ == "__main__":
    main()
