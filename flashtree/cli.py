"""`flashtree generate | serve | bench | train ...` (also `python -m flashtree`).

Each subsystem registers its own subcommand (`register(subparsers)` in its `cli.py`), so
this file wires them up, checks the flags every command shares (device, threads, model
paths), and turns FlashtreeError into a one-line message.

Nothing heavy is imported to parse the command line: `--version` and `--help` answer at
once, and a command says what it is loading before torch and the models take their seconds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time
from pathlib import Path

from flashtree import __version__
from flashtree.config import METHODS, looks_like_hub_id
from flashtree.errors import FlashtreeError

SUBSYSTEMS = ("flashtree.server.cli", "flashtree.bench.cli", "flashtree.train.cli")
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


class Parser(argparse.ArgumentParser):
    """Usage mistakes end with one line too, like every other error (subcommands inherit this)."""

    def error(self, message: str):
        self.exit(2, f"flashtree: error: {message} (see `{self.prog} --help`)\n")


def parse_budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def unescape(text: str) -> str:
    r"""`--stop '\n'` means a newline: \n, \t, \r and \\ are read as escapes, anything else as is."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once (Linux); else the CPU count."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        return os.cpu_count() or 1
    cores, cpu, key = set(), None, {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = (part.strip() for part in line.partition(":"))
            if name == "processor":
                cpu, key = int(value), {}
            elif name in ("physical id", "core id"):
                key[name] = value
                if len(key) == 2 and cpu in allowed:
                    cores.add((key["physical id"], key["core id"]))
    except (OSError, ValueError):
        pass
    return len(cores) or len(allowed)


def default_threads() -> int:
    """What torch would pick (it honours OMP_NUM_THREADS), capped at the physical cores."""
    import torch

    return max(1, min(torch.get_num_threads(), physical_cores()))


def busy_cores_warning(threads: int) -> str | None:
    """One line when `threads` exceeds the cores other jobs leave free (by the 1-minute load
    average): torch's threads then wait on each other at every op, and a run can take many
    times what one thread takes."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = physical_cores()
    free = max(0, round(cores - load))
    if threads <= 1 or threads <= free:
        return None
    return (f"flashtree: warning: torch will use {threads} threads, but only {free} of this machine's {cores} cores "
            f"are free (load average {load:.1f}); oversubscribed threads can make every round many times slower: "
            "use --threads 1")


def check_device(name: str | None) -> None:
    """A one-line error for a device this torch cannot use, before anything is loaded."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise FlashtreeError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise FlashtreeError(f"--device {name}: this torch ({torch.__version__}) was built without CUDA; "
                                 "install a CUDA build of torch, or use --device cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise FlashtreeError(f"--device {name}: no CUDA device is visible (check the driver and "
                                 "CUDA_VISIBLE_DEVICES), or use --device cpu")
        if device.index is not None and device.index >= count:
            raise FlashtreeError(f"--device {name}: there is no such GPU; this machine has {count} (cuda:0.."
                                 f"cuda:{count - 1})")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise FlashtreeError(f"--device {name}: Apple's MPS backend is not available on this machine; "
                                 "use --device cpu")
    elif device.type != "cpu":
        raise FlashtreeError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")


def check_model_path(flag: str, name: str | None) -> None:
    """Name a missing local directory (the engine would first complain about something else)."""
    if name is None or Path(name).expanduser().is_dir() or looks_like_hub_id(name):
        return
    raise FlashtreeError(f"no such model directory: {name} (given as {flag}); pass an existing path or "
                         "a hub id like Qwen/Qwen3-8B")


def check_hub_id(name: str | None) -> None:
    """An unreachable hub id (offline, or no connection) is the first thing said about it, before
    anything else can complain (a missing drafter, say); fetches its config.json alone."""
    if name is None or Path(name).expanduser().is_dir():
        return
    from flashtree.models.loader import fetch_from_hub

    fetch_from_hub(name, ["config.json"])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, method and machine flags every command shares."""
    p.add_argument("--target", help="HF checkpoint dir or hub id (default: the embedded demo target)")
    p.add_argument("--drafter", help="DFlash drafter dir or hub id (default: the demo drafter)")
    p.add_argument("--method", default="ddtree", help=f"one of {', '.join(METHODS)} (default ddtree)")
    p.add_argument("--budget", type=parse_budget, default="auto",
                   help="ddtree: 'auto' (default) picks AR, the chain or a tree size per request and round from "
                        "measured costs and calibrated acceptance; an integer fixes the tree nodes per round")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16, float16, float64 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--compile", action="store_true",
                   help="prepare every shape at start-up: on cuda, capture the rounds (auto's too) as CUDA graphs; "
                        "on cpu, compile a dense target's and the DFlash drafter's layers with inductor (every method, "
                        "auto included)")
    p.add_argument("--tensor-parallel-size", "--tp", type=positive_int, default=1,
                   help="split the target over N ranks: N GPUs from --device on, or N CPU processes (default 1)")
    p.add_argument("--threads", type=positive_int,
                   help="torch CPU threads (default: what torch picks, OMP_NUM_THREADS included, capped at "
                        "the physical cores; use 1 on a shared machine)")
    p.add_argument("--no-pack-weights", action="store_true",
                   help="cpu: multiply with PyTorch's F.linear rather than oneDNN's packed copies of the "
                        "linear weights (which double their memory; by default made when they fit in half the free memory)")
    p.add_argument("--no-selector", action="store_true",
                   help="with a DFlash2 drafter, build the tree from its marginals, not its candidate selector")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3,
                   help="method mtp: tokens the MTP head drafts per round, recursively (default 3)")
    p.add_argument("--mtp-head", help="method mtp: an MTP head dir (from `flashtree train train --mtp`) or a "
                                      "checkpoint with mtp.* tensors (default: the target's own)")


def add_length_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=positive_int,
                   help="prompt + output tokens (default: min(target limit, 4096)); at most the target's "
                        "max_position_embeddings")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="allow --max-model-len above the target's max_position_embeddings (positions it was not "
                        "trained for)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(target=args.target, drafter=args.drafter, method=args.method, budget=args.budget,
                device=args.device, dtype=args.dtype, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                use_selector=False if getattr(args, "no_selector", False) else None,
                pack_weights=False if getattr(args, "no_pack_weights", False) else None,
                compile=getattr(args, "compile", False), num_speculative_tokens=args.num_speculative_tokens,
                mtp_head=args.mtp_head)


def read_prompt(text: str) -> str:
    """`-` reads the prompt from stdin (as is: a trailing newline stays part of it)."""
    if text != "-":
        return text
    if sys.stdin is None or sys.stdin.isatty():
        raise FlashtreeError("the prompt '-' reads from stdin, but nothing is piped in; e.g. "
                             "`cat prompt.txt | flashtree generate -`")
    return sys.stdin.read()


def generate(args: argparse.Namespace) -> None:
    from flashtree import LLM, SamplingParams

    prompt = read_prompt(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=[unescape(s) for s in args.stop or []])
    llm = LLM(**engine_kwargs(args), max_batch=1, max_model_len=args.max_model_len,
              allow_long_max_model_len=args.allow_long_max_model_len)
    if args.chat:
        prompt = llm.engine.encode_chat([{"role": "user", "content": prompt}])
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - t0
    print(out.text)
    print(stats_line(args.method, out, seconds, llm.engine.capture_seconds), file=sys.stderr)


def stats_line(method: str, out, seconds: float, captured: float) -> str:
    """generate's line on stderr. tok/s is over the generate call alone; the rounds --compile
    captures are captured at start-up (`captured` seconds), shown apart and never counted."""
    import torch

    s = out.stats
    line = (f"[{method}] tokens={len(out.token_ids)} tau={s.mean_accept_length:.2f} rounds={s.rounds} "
            f"tok/s={len(out.token_ids) / seconds:.1f} threads={torch.get_num_threads()} finish={out.finish_reason}")
    return line + (f" capture_s={captured:.1f} (at start-up, not in tok/s)" if captured else "")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flashtree", description="Lossless DFlash + DDTree speculative decoding")
    parser.add_argument("--version", action="version", version=f"flashtree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    add_engine_args(g)
    add_sampling_args(g)
    add_length_args(g)
    g.add_argument("--stop", action="append", help=r"stop string (repeatable; \n and \t are escapes)")
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


def announce(args: argparse.Namespace) -> None:
    """The command's first line, within a second of starting: torch and the models take seconds.
    Under torchrun (`train`), rank 0 alone says it."""
    if os.environ.get("RANK", "0") != "0":
        return
    if hasattr(args, "target"):
        what = f"loading {args.target or 'the embedded demo pair'}"
        what += f" and the drafter {args.drafter}" if getattr(args, "drafter", None) else ""
    else:
        what = "starting"
    print(f"flashtree {args.command}: {what} ...", file=sys.stderr, flush=True)


def prepare(args: argparse.Namespace) -> None:
    """Checks and settings for the shared flags, before any model is loaded."""
    for flag in ("target", "drafter", "mtp_head"):
        check_hub_id(getattr(args, flag, None))
    check_device(getattr(args, "device", None))
    if hasattr(args, "threads"):
        import torch

        torch.set_num_threads(args.threads or default_threads())
        if (line := busy_cores_warning(torch.get_num_threads())) is not None:
            print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag in ("target", "drafter", "mtp_head"):  # instant checks first: bad input gets its line alone
            check_model_path(f"--{flag.replace('_', '-')}", getattr(args, flag, None))
        announce(args)
        prepare(args)
        args.func(args)
    except FlashtreeError as e:
        print(f"flashtree: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
