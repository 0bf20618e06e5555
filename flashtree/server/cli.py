"""`flashtree serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import math
import sys

from flashtree.cli import add_engine_args, add_length_args, engine_kwargs, positive_int
from flashtree.config import EngineConfig

# Flags that map onto EngineConfig fields; unset ones keep EngineConfig's defaults.
ENGINE_LIMITS = ("max_batch", "max_model_len", "max_queue", "max_round_tokens", "max_prefill_tokens",
                 "allow_long_max_model_len")


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 1..65535, got {value}")
    return value


def bad_seconds(value: float, zero_ok: bool) -> str | None:
    """Why `value` cannot be a timeout in seconds, or None when it can."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        return f"expected a {'non-negative' if zero_ok else 'positive'} finite number of seconds, got {value:g}"
    return None


def seconds(zero_ok: bool):
    """An argparse type for a timeout: positive seconds (or also 0, when zero_ok)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if (why := bad_seconds(value, zero_ok)) is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    return parse


def startup_line(engine, name: str, url: str) -> str:
    import torch

    c = engine.config
    budget = c.budget if c.method == "ddtree" else "-"
    drafter = (c.mtp_head or f"{c.target} mtp.*") + f" k={c.num_speculative_tokens}" if c.method == "mtp" else c.drafter
    return (f"flashtree serve: model={name} ({c.target}) drafter={drafter or '-'} method={c.method} "
            f"budget={budget} device={engine.device} dtype={str(engine.dtype).removeprefix('torch.')} "
            f"threads={torch.get_num_threads()} max_batch={c.max_batch} max_model_len={c.max_model_len} "
            + (f"tensor_parallel_size={c.tensor_parallel_size} " if c.tensor_parallel_size > 1 else "") + f"url={url}")


def serve(args: argparse.Namespace) -> None:
    from flashtree import LLMEngine
    from flashtree.server.app import build_app, default_model_name
    from flashtree.server.graceful import GracefulServer

    limits = {k: getattr(args, k) for k in ENGINE_LIMITS if getattr(args, k) is not None}
    engine = LLMEngine(EngineConfig(**engine_kwargs(args), **limits, prefix_cache=not args.no_prefix_cache))
    name = args.served_model_name or default_model_name(engine.config.target)
    app = build_app(engine, model_name=name, read_timeout=args.read_timeout)
    # SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to
    # --shutdown-timeout seconds, then end the rest with an error and exit. A second one exits at once.
    GracefulServer(app, args.shutdown_timeout, read_timeout=args.read_timeout, host=args.host, port=args.port,
                   log_level=args.log_level, timeout_keep_alive=args.keep_alive_timeout,
                   on_ready=lambda url: print(startup_line(engine, name, url), file=sys.stderr, flush=True)).run()


def register(subparsers) -> None:
    d = EngineConfig
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=port, default=8000, help="1..65535 (default 8000)")
    p.add_argument("--max-batch", type=positive_int, help=f"requests decoded together: cache slots (default {d.max_batch})")
    add_length_args(p)
    p.add_argument("--max-queue", type=positive_int,
                   help=f"requests waiting for a slot (beyond the free ones) before a 429 (default {d.max_queue})")
    p.add_argument("--max-round-tokens", type=positive_int,
                   help=f"cap on all trees' nodes in one verify (default {d.max_round_tokens}); "
                   "per-request budget = min(budget, this // batch - 1)")
    p.add_argument("--max-prefill-tokens", type=positive_int,
                   help=f"prompt tokens prefilled per engine step (default {d.max_prefill_tokens}): a longer prompt "
                   "is prefilled in chunks between decode rounds, so running streams keep going")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="always prefill whole prompts (by default a prompt prefix that a cache slot holds is reused)")
    p.add_argument("--served-model-name", help="the `model` clients send (default: flashtree-demo or the dir name)")
    p.add_argument("--shutdown-timeout", type=seconds(zero_ok=True), default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted (default 30; "
                   "0 aborts them at once); a second SIGTERM exits at once")
    p.add_argument("--read-timeout", type=seconds(zero_ok=False), default=30.0,
                   help="seconds a client gets to send a request's headers, and again its body (default 30)")
    p.add_argument("--keep-alive-timeout", type=positive_int, default=5,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; info adds one access-log line per request (default warning)")
    p.set_defaults(func=serve)
