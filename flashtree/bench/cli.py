"""`flashtree bench`: tau, speedup and where the time goes, as a table, JSON and plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashtree.errors import FlashtreeError

# --quick: about a minute on a laptop CPU with the demo pair; explicit flags still win.
QUICK = dict(budgets=[8, 32, 128, "auto"], temperatures=[0.0, 1.0], suites=["code", "prose"], max_tokens=64,
             num_prompts=3, cost_repeats=5, cost_dense=False)
FULL = dict(budgets=[4, 8, 16, 32, 64, 128, 256, 512, 1024, "auto"], temperatures=[0.0, 1.0], suites=["code", "prose"],
            max_tokens=128, num_prompts=10, cost_repeats=9, cost_dense=True)


def _list(kind, name: str | None = None):
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            what = name or kind.__name__
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}") from None

    return parse


def register(subparsers) -> None:
    from flashtree.bench.suites import suite_names
    from flashtree.cli import add_engine_args, parse_budget

    p = subparsers.add_parser(
        "bench", help="measure tau, speedup and where the time goes", conflict_handler="resolve",
        description="Run methods x budgets over prompt suites and temperatures, one request at a time "
                    "(interleaved per prompt, warmup excluded); print a Markdown table and write "
                    "results.json, results.md and PNG plots to --out.")
    add_engine_args(p)
    # --methods/--budgets replace the single-engine --method/--budget (kept as aliases).
    p.add_argument("--methods", "--method", type=_list(str), default=None,
                   help="default ar,dflash,ddtree; add mtp for the target's MTP head (the demo's trained one)")
    p.add_argument("--budgets", "--budget", type=_list(parse_budget, "integers or 'auto'"), default=None,
                   help="ddtree budgets, integers or 'auto' (default 4,8,...,1024,auto; --quick 8,32,128,auto)")
    p.add_argument("--num-speculative-tokens", type=_list(int, "integers"), default=[3],
                   help="mtp cells: the head's drafted tokens per round, one cell each (default 3)")
    p.add_argument("--temperatures", type=_list(float), default=None, help="default 0,1")
    p.add_argument("--suites", type=_list(str), default=None,
                   help=f"{', '.join(suite_names())}, or a .jsonl path (default code,prose)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 128; --quick 64)")
    p.add_argument("--num-prompts", type=int, default=None, help="per suite (default 10; --quick 3)")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--quick", action="store_true", help="a small grid that runs in about a minute")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests per cell and temperature")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--cost-repeats", type=int, default=None, help="timed forwards per cost-curve point")
    p.add_argument("--cost-context", type=int, default=None,
                   help="context length for the cost curve (default: median prompt + max_tokens/2)")
    p.add_argument("--no-stage-sync", dest="stage_sync", action="store_false",
                   help="on GPUs, do not synchronise between stages (faster, but stage times blur)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--policy-grid", action="store_true",
                   help="throughput of ar, dflash, ddtree at fixed budgets and auto under temperature x "
                        "concurrency (default T 0,0.7,1 x c 1,4,16, budgets 4..64, 16 prompts of 64 tokens)")
    p.add_argument("--concurrency", type=_list(int), default=None, help="--policy-grid: requests in flight (default 1,4,16)")
    p.add_argument("--passes", type=int, default=2, help="--policy-grid: runs of every wave per cell (default 2)")
    p.add_argument("--no-twin", action="store_true",
                   help="--policy-grid: skip the second `ar` cell that shows the spread between identical cells")
    p.set_defaults(func=bench, method=None, budget=None)


def spec_from_args(args: argparse.Namespace):
    from flashtree.bench.grid import BenchSpec
    from flashtree.cli import engine_kwargs

    preset = QUICK if args.quick else FULL
    chosen = {k: getattr(args, k) for k in preset if getattr(args, k, None) is not None}
    kw = {k: v for k, v in engine_kwargs(args).items() if k not in ("method", "budget")}
    return BenchSpec(**kw, **{**preset, **chosen}, methods=args.methods or ["ar", "dflash", "ddtree"],
                     warmup=args.warmup, seed=args.seed, ignore_eos=args.ignore_eos,
                     cost_context=args.cost_context, stage_sync=args.stage_sync)


def policy_grid(args: argparse.Namespace) -> None:
    from flashtree.bench import policy_grid as pg
    from flashtree.bench.report import environment, write_json

    if args.budgets and "auto" in args.budgets:
        raise FlashtreeError("--policy-grid always runs auto; give --budgets as the fixed sizes to compare with")
    if args.methods:
        raise FlashtreeError("--policy-grid runs every method; drop --methods")
    if args.compile:
        raise FlashtreeError("--policy-grid runs its engines eagerly; drop --compile")
    defaults = pg.PolicyGridSpec()
    spec = pg.PolicyGridSpec(
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
        temperatures=args.temperatures or defaults.temperatures, concurrency=args.concurrency or defaults.concurrency,
        budgets=args.budgets or defaults.budgets, suites=args.suites or defaults.suites,
        num_prompts=args.num_prompts or defaults.num_prompts, max_tokens=args.max_tokens or defaults.max_tokens,
        passes=args.passes, seed=args.seed, twin=not args.no_twin,
        pack_weights=False if args.no_pack_weights else None)
    out = Path(args.out if args.out != "runs/bench" else "runs/bench/policy")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlashtreeError(f"cannot create --out {out}: {e.strerror}") from None
    result = pg.run_policy_grid(spec)
    report = pg.markdown(result)
    print(report)
    (out / "results.md").write_text(report + "\n")
    write_json(pg.to_json(result, environment(result["device"], result["dtype"]), sys.argv[1:]), out / "results.json")
    print(f"wrote results.json, results.md to {out}", file=sys.stderr)


def bench(args: argparse.Namespace) -> None:
    if args.policy_grid:
        return policy_grid(args)
    from flashtree.bench.grid import run_bench
    from flashtree.bench.report import environment, markdown_report, to_json, write_json

    spec = spec_from_args(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlashtreeError(f"cannot create --out {out}: {e.strerror}") from None
    result = run_bench(spec)
    env = environment(result.device, result.dtype)
    report = markdown_report(result, env)
    print(report)
    (out / "results.md").write_text(report + "\n")
    write_json(to_json(result, env, sys.argv[1:]), out / "results.json")
    written = ["results.json", "results.md"]
    if args.plots:
        from flashtree.bench.plots import write_plots

        written += [p.name for p in write_plots(result, out)]
    print(f"wrote {', '.join(written)} to {out}", file=sys.stderr)
