"""Time per round split by stage, and the non-model overhead share, on a random demo-sized pair,
eager and (with --capture) captured, the modes' passes interleaved.

    OMP_NUM_THREADS=1 python benchmarks/round_overhead.py --budgets 16 64 --capture [--demo]

Non-model overhead = tree build + ancestor mask + accept walk + commit (the drafter context
append is drafter model work and counts under draft). Compile time is paid in a warm-up pass and
reported separately; the engine leaves it out of stage times anyway.
"""

from __future__ import annotations

import argparse
import json
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

STAGES = ("draft", "tree", "verify", "commit")


def median_ms(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def run_once(engine: LLMEngine, prompt: list[int], max_tokens: int):
    req = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    return req.stats


def alone_ms(engine: LLMEngine, method: str, budget: int, args) -> tuple[float, float]:
    """Mask (the verify context: ancestor table + mask) and walk, timed alone on a round's shapes."""
    vocab = engine.target.vocab_size
    logits = torch.randn(1, args.block - 1, vocab)
    spec = build_chain(torch.tensor([1]), logits) if method == "dflash" else build_tree(torch.tensor([1]), logits, budget)
    cache = engine.runner.cache
    cache.set_length(0, args.prompt_len)
    key_len = engine.runner.key_len(ForwardContext.verify(cache, [0], spec).batch, spec.num_nodes)
    context = lambda s, b: ForwardContext.verify(cache, b, s, key_len).attn_bias  # noqa: E731
    batch = ForwardContext.verify(cache, [0], spec).batch
    picks = torch.randint(0, vocab, (1, spec.num_nodes))
    walk = accept_walk
    mask_ms, walk_ms = median_ms(lambda: context(spec, batch)), median_ms(lambda: walk(spec, picks))
    cache.set_length(0, 0)
    return mask_ms, walk_ms


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--capture", action="store_true",
                    help="also run engines with captured rounds (capture=True), interleaved with eager")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per engine (after one warm-up pass)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--demo", action="store_true",
                    help="the shipped demo pair (trained, so drafts get accepted) instead of random weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.demo:
        from flashtree.config import DEMO_DRAFTER, DEMO_TARGET

        target, drafter = DEMO_TARGET, DEMO_DRAFTER
        text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        ids = LLMEngine(EngineConfig(method="ar", device="cpu")).encode(text)
        prompt = (ids * (args.prompt_len // len(ids) + 1))[: args.prompt_len]
        args.block = json.loads((DEMO_DRAFTER / "config.json").read_text()).get("block_size", args.block)
        shape = "the demo pair"
    else:
        root = Path(tempfile.mkdtemp())
        target = make_target(root / "t", vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4,
                             kv_heads=2, logit_scale=3.0)
        drafter = make_drafter(root / "d", target_layers=args.layers, vocab=args.vocab, hidden=args.hidden,
                               layers=1, block_size=args.block)
        prompt = [(7 * i) % (args.vocab - 2) for i in range(args.prompt_len)]
        shape = f"random target {args.layers}x{args.hidden} V={args.vocab}, drafter 1 layer"
    print(f"torch {torch.__version__}, threads {args.threads}, {shape}, block {args.block}, prompt {args.prompt_len}, "
          f"{args.max_tokens} new tokens, {args.passes} interleaved passes\n")
    modes = [False, True] if args.capture else [False]
    engines = {}
    for compiled in modes:
        for method, budget in [("dflash", 1)] + [("ddtree", b) for b in args.budgets]:
            engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method=method, budget=budget,
                                            device="cpu", dtype="float32", max_batch=1, max_model_len=1024,
                                            capture=compiled))
            t0 = time.perf_counter()
            run_once(engine, prompt, args.max_tokens)  # warm-up: a user's first request
            engines[compiled, method, budget] = (engine, time.perf_counter() - t0)
    stats = {k: [] for k in engines}
    for _ in range(args.passes):  # interleaved, so a change in machine load hits every engine alike
        for key, (engine, _) in engines.items():
            stats[key].append(run_once(engine, prompt, args.max_tokens))

    print("| mode | method | tau | round ms | draft | tree | verify | commit | mask* | walk* | overhead share | "
          "warm-up s (capture s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (compiled, method, budget), (engine, warm) in engines.items():
        runs = stats[compiled, method, budget]
        rounds = sum(s.rounds for s in runs)
        ms = {k: 1000 * sum(s.stage_seconds[k] for s in runs) / rounds for k in STAGES}
        tau = sum(s.mean_accept_length * s.rounds for s in runs) / rounds
        mask_ms, walk_ms = alone_ms(engine, method, budget, args)
        total = sum(ms.values())
        overhead = ms["tree"] + mask_ms + ms["commit"]
        label = "dflash (chain)" if method == "dflash" else f"ddtree {budget}"
        print(f"| {'captured' if compiled else 'eager'} | {label} | {tau:.2f} | {total:.2f} | {ms['draft']:.2f} | "
              f"{ms['tree']:.2f} | {ms['verify']:.2f} | {ms['commit']:.2f} | {mask_ms:.2f} | {walk_ms:.2f} | "
              f"{100 * overhead / total:.1f}% | {warm:.0f} ({engine.capture_seconds:.1f}) |")
    print("\n*mask (the verify context: ancestor table + mask) is part of verify, walk part of commit; "
          "both also timed alone on the same shapes.")


if __name__ == "__main__":
    main()
