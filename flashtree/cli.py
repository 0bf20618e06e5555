"""`flashtree generate | serve | bench | train ...`

Each subsystem registers its own subcommand (`register(subparsers)` in its `cli.py`), so
this file only wires them up and turns FlashtreeError into a one-line message.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from flashtree.config import METHODS
from flashtree.errors import FlashtreeError

SUBSYSTEMS = ("flashtree.server.cli", "flashtree.bench.cli", "flashtree.train.cli")


def parse_budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and method flags every command shares."""
    p.add_argument("--target", help="HF checkpoint dir or hub id (default: the embedded demo target)")
    p.add_argument("--drafter", help="DFlash drafter dir or hub id (default: the demo drafter)")
    p.add_argument("--method", default="ddtree", help=f"one of {', '.join(METHODS)} (default ddtree)")
    p.add_argument("--budget", type=parse_budget, default=64,
                   help="tree nodes per round for ddtree, or 'auto' to pick each round's size from measured cost (default 64)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16, float16, float64 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--no-selector", action="store_true",
                   help="with a DFlash2 drafter, build the tree from its marginals, not its candidate selector")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(target=args.target, drafter=args.drafter, method=args.method, budget=args.budget,
                device=args.device, dtype=args.dtype, use_selector=False if args.no_selector else None)


def generate(args: argparse.Namespace) -> None:
    from flashtree import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    llm = LLM(**engine_kwargs(args), max_batch=1)
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise FlashtreeError("--chat needs a target tokenizer with a chat template")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - t0
    s = out.stats
    print(out.text)
    print(f"[{args.method}] tokens={len(out.token_ids)} tau={s.mean_accept_length:.2f} rounds={s.rounds} "
          f"tok/s={len(out.token_ids) / seconds:.1f} finish={out.finish_reason}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description="Lossless DFlash + DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.set_defaults(func=generate)
    for name in SUBSYSTEMS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except FlashtreeError as e:
        print(f"flashtree: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
