"""Prompt-side features on the demo pair, engine-level (no HTTP), each comparison interleaved.

    python benchmarks/prefill.py gap       # worst inter-token gap of 8 running streams while an
                                           # 1,800-token prompt is admitted: one-piece vs chunked
    python benchmarks/prefill.py prefix    # TTFT with a 1,000-token shared system prompt, reuse off/on
    python benchmarks/prefill.py samples   # one n=4 request vs 4 separate requests of one prompt
    python benchmarks/prefill.py logprobs  # max |logprob - HF transformers| per method

Engines of one comparison share the loaded weights (LLMEngine(share_weights=...)) and take
turns trial by trial, so a busy machine slows both alike; the reported numbers are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from flashtree.bench.suites import load_suite


def corpus_ids(engine: LLMEngine, n: int, offset: int = 0) -> list[int]:
    """n token ids of the code + prose suites' text (repeated as needed), from token `offset`."""
    text = "\n".join(p.text for s in ("code", "prose") for p in load_suite(s) if p.text)
    ids = engine.encode(text)
    while len(ids) < n + offset:
        ids = ids + ids
    return ids[offset:offset + n]


def engines(args, variants: dict[str, dict]) -> dict[str, LLMEngine]:
    base = dict(method=args.method, budget=args.budget, device=args.device, max_batch=args.max_batch)
    out: dict[str, LLMEngine] = {}
    for name, extra in variants.items():
        first = next(iter(out.values()), None)
        out[name] = LLMEngine(EngineConfig(**{**base, **extra}), share_weights=first)
    return out


def gap(args) -> None:
    """Each trial: 8 streams decode; after a few rounds the long prompt arrives; the gaps are
    the times between consecutive steps (each emits tokens to every stream) until the long
    prompt's first token."""
    eng = engines(args, {"one piece": dict(max_prefill_tokens=4096, prefix_cache=False),
                         "chunked": dict(max_prefill_tokens=args.max_prefill_tokens, prefix_cache=False)})
    long = corpus_ids(next(iter(eng.values())), args.prompt_len)
    streams = [corpus_ids(next(iter(eng.values())), 32, offset=100 * i) for i in range(8)]
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in eng}
    for _ in range(args.trials):
        for name, e in eng.items():
            running = [e.add_request(p, params) for p in streams]
            for _ in range(4):
                e.step()
            base = []
            for _ in range(4):
                t0 = time.perf_counter()
                e.step()
                base.append(time.perf_counter() - t0)
            req = e.add_request(long, SamplingParams(max_tokens=4, ignore_eos=True))
            gaps, t_add = [], time.perf_counter()
            while not req.output_ids:
                t0 = time.perf_counter()
                e.step()
                gaps.append(time.perf_counter() - t0)
            results[name].append((statistics.median(base), max(gaps), req.stats.first_token - t_add))
            for r in running + [req]:
                e.abort(r)
    print(f"8 streams decoding ({args.method}, budget {args.budget}), a {len(long)}-token prompt admitted; "
          f"median of {args.trials} trials\n")
    print("| prefill | round ms (no admission) | worst gap ms while admitting | long prompt TTFT ms |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        label = name if name == "one piece" else f"chunks of {args.max_prefill_tokens}"
        med = [statistics.median(r[i] for r in rows) * 1000 for i in range(3)]
        print(f"| {label} | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.0f} |")


def prefix(args) -> None:
    """Requests one at a time, each a 1,000-token system prompt + its own 24-token question;
    TTFT = arrival to first token (the prompt's prefill, or its copy + the question's)."""
    eng = engines(args, {"reuse off": dict(prefix_cache=False), "reuse on": dict(prefix_cache=True)})
    e0 = next(iter(eng.values()))
    system = corpus_ids(e0, args.system_len)
    questions = [corpus_ids(e0, 24, offset=3000 + 50 * i) for i in range(args.trials + 1)]
    ttft: dict[str, list[float]] = {k: [] for k in eng}
    cached: dict[str, list[int]] = {k: [] for k in eng}
    for i, q in enumerate(questions):
        for name, e in eng.items():
            req = e.add_request(system + q, SamplingParams(max_tokens=8, ignore_eos=True))
            while not req.finished:
                e.step()
            if i:  # the first request fills the cache
                ttft[name].append(req.stats.first_token - req.stats.arrival)
                cached[name].append(req.stats.cached_tokens)
    print(f"system prompt {len(system)} tokens + a 24-token question, one request at a time; median TTFT over "
          f"{args.trials} requests after a first one\n")
    print("| prefix reuse | TTFT ms | prompt tokens reused |")
    print("|---|---|---|")
    for name in eng:
        print(f"| {name.split()[1]} | {statistics.median(ttft[name]) * 1000:.1f} | {statistics.median(cached[name]):.0f} |")
    off, on = (statistics.median(ttft[k]) for k in eng)
    print(f"\nTTFT ratio off/on: {off / on:.1f}x")


def samples(args) -> None:
    """One prompt, 4 samples (temperature 1, seeded): as one n=4 request (one prefill, copied)
    or as 4 separate requests added together (4 prefills); wall time until all 4 finish."""
    e = next(iter(engines(args, {"": dict(prefix_cache=False)}).values()))
    prompt = corpus_ids(e, args.prompt_len)
    kw = dict(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    prefill: dict[str, list[float]] = {"n=4": [], "4 requests": []}
    for t in range(args.trials):
        for name in times:
            t0 = time.perf_counter()
            if name == "n=4":
                reqs = e.add_group(prompt, SamplingParams(n=4, seed=t, **kw)).samples
            else:
                reqs = [e.add_request(prompt, SamplingParams(seed=t + 1000 * i, **kw)) for i in range(4)]
            while not all(r.finished for r in reqs):
                e.step()
            times[name].append(time.perf_counter() - t0)
            prefill[name].append(sum(r.stats.stage_seconds["prefill"] for r in reqs))
    print(f"{len(prompt)}-token prompt, 4 samples of {args.max_tokens} tokens ({args.method}, budget {args.budget}); "
          f"median of {args.trials}\n")
    print("| as | wall ms | prefill ms (summed over the 4) |")
    print("|---|---|---|")
    for name in times:
        print(f"| {name} | {statistics.median(times[name]) * 1000:.0f} | {statistics.median(prefill[name]) * 1000:.0f} |")


def logprobs(args) -> None:
    """Max |returned logprob - HF transformers' (processed the same way)| over all returned
    output logprobs and top-5 alternatives, per method, greedy and T=0.7/top-k 40/top-p 0.9."""
    import transformers

    from flashtree.config import DEMO_TARGET
    from flashtree.sampler import probabilities

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    eng = engines(args, {m: dict(method=m) for m in ("ar", "dflash", "ddtree")})
    prompt = corpus_ids(next(iter(eng.values())), 64)
    print("| method | sampling | tokens | max abs diff vs HF |")
    print("|---|---|---|---|")
    for label, params in [("greedy", SamplingParams(max_tokens=64, logprobs=5, ignore_eos=True)),
                          ("T=0.7 k=40 p=0.9", SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1,
                                                              max_tokens=64, logprobs=5, ignore_eos=True))]:
        for name, e in eng.items():
            req = e.add_request(prompt, params)
            while not req.finished:
                e.step()
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + req.output_ids])).logits[0]
            ref = torch.log_softmax(logits, -1) if params.greedy else probabilities(logits, params).log()
            worst = 0.0
            for j, lp in enumerate(req.logprobs):
                row = ref[len(prompt) + j - 1]
                worst = max([worst, abs(lp.logprob - row[lp.token].item())] +
                            [abs(v - row[t].item()) for t, v in lp.top])
            print(f"| {name} | {label} | {len(req.logprobs)} | {worst:.1e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["gap", "prefix", "samples", "logprobs"])
    p.add_argument("--method", default="ddtree")
    p.add_argument("--budget", default="auto", type=lambda s: s if s == "auto" else int(s))
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=9)
    p.add_argument("--max-prefill-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=1800)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}")
    {"gap": gap, "prefix": prefix, "samples": samples, "logprobs": logprobs}[args.what](args)


if __name__ == "__main__":
    main()
