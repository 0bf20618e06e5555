"""`flashtree serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from flashtree.cli import add_engine_args, engine_kwargs


def serve(args: argparse.Namespace) -> None:
    from flashtree import EngineConfig, LLMEngine
    from flashtree.server.app import build_app
    from flashtree.server.graceful import GracefulServer

    config = EngineConfig(**engine_kwargs(args), max_batch=args.max_batch, max_model_len=args.max_model_len,
                          max_queue=args.max_queue, max_round_tokens=args.max_round_tokens)
    engine = LLMEngine(config)
    app = build_app(engine, model_name=args.served_model_name)
    # SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to
    # --shutdown-timeout seconds, then end the rest with an error and exit.
    GracefulServer(app, args.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level).run()


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together: cache slots (default 8)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens (default: min(target limit, 4096))")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before a 429 (default 256)")
    p.add_argument("--max-round-tokens", type=int, default=4096,
                   help="cap on all trees' nodes in one verify (default 4096); "
                   "per-request budget = min(budget, this // batch - 1)")
    p.add_argument("--served-model-name", help="the `model` clients send (default: flashtree-demo or the dir name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=serve)
