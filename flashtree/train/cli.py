"""`flashtree train regenerate | extract | train | eval | compare | branch | demo`."""

from __future__ import annotations

import argparse
import json


def _ids(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",")] if text else None


def _temperatures(text: str) -> list[float]:
    try:
        temps = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature takes numbers separated by commas, got {text!r}") from None
    if any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise argparse.ArgumentTypeError(f"--temperature values must be distinct and >= 0, got {text!r}")
    return temps


def _regenerate(a: argparse.Namespace) -> None:
    from flashtree.train.responses import RegenerateConfig, regenerate

    cfg = RegenerateConfig(prompts=a.prompts, out=a.out, target=a.target, drafter=a.drafter, method=a.method,
                           budget=a.budget, temperature=a.temperature, each_temperature=a.each_temperature,
                           top_p=a.top_p, max_tokens=a.max_tokens,
                           chat_template=a.chat_template, chunk=a.chunk, max_batch=a.max_batch, limit=a.limit,
                           seed=a.seed, device=a.device, dtype=a.dtype)
    print(json.dumps(regenerate(cfg)))


def _extract(a: argparse.Namespace) -> None:
    from flashtree.train.features import ExtractConfig, extract

    cfg = ExtractConfig(data=a.data, out=a.out, target=a.target, layer_ids=_ids(a.layer_ids),
                        num_draft_layers=a.num_draft_layers, shard_size=a.shard_size, batch_size=a.batch_size,
                        max_len=a.max_len, store_dtype=a.store_dtype, device=a.device, dtype=a.dtype)
    m = extract(cfg)
    print(json.dumps({k: m[k] for k in ("layer_ids", "num_sequences", "complete")} | {"shards": len(m["shards"])}))


def _train(a: argparse.Namespace) -> None:
    if a.mtp:
        return _train_mtp(a)
    from flashtree.train.trainer import TrainConfig, train

    cfg = TrainConfig(out=a.out, data=a.data, sequences=a.sequences, target=a.target, block_size=a.block_size,
                      num_layers=a.num_layers, layer_ids=_ids(a.layer_ids), intermediate_size=a.intermediate_size,
                      mask_token_id=a.mask_token_id, gamma=a.gamma, max_anchors=a.max_anchors,
                      batch_size=a.batch_size, grad_accum=a.grad_accum, steps=a.steps, epochs=a.epochs,
                      minutes=a.minutes, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                      grad_clip=a.grad_clip, seed=a.seed, backend=a.backend, init_from_target=a.init_from_target,
                      max_len=a.max_len, device=a.device, dtype=a.dtype, save_dtype=a.save_dtype,
                      threads=a.threads, log_every=a.log_every, save_every=a.save_every, resume=not a.no_resume,
                      plot=a.plot, selector=a.selector, selector_rank=a.selector_rank, selector_top_k=a.selector_top_k,
                      conv_kernel_size=a.conv_kernel_size, conv_group_size=a.conv_group_size)
    train(cfg)


def _train_mtp(a: argparse.Namespace) -> None:
    from flashtree.train.mtp import MTPTrainConfig, train_mtp

    cfg = MTPTrainConfig(out=a.out, data=a.data, sequences=a.sequences, target=a.target, depth=a.mtp_depth,
                         step_decay=a.mtp_step_decay, intermediate_size=a.intermediate_size,
                         init_from_target=a.init_from_target, batch_size=a.batch_size, steps=a.steps,
                         minutes=a.minutes, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                         grad_clip=a.grad_clip, seed=a.seed, max_len=a.max_len, device=a.device, dtype=a.dtype,
                         save_dtype=a.save_dtype, threads=a.threads, log_every=a.log_every,
                         save_every=a.save_every, resume=not a.no_resume, plot=a.plot)
    train_mtp(cfg)


def _report(results: dict, json_path: str | None) -> None:
    """Print the tau table; also write the results as JSON when asked."""
    from flashtree.train.tau import table

    print(table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def _eval(a: argparse.Namespace) -> None:
    from flashtree.train.tau import EvalConfig, evaluate

    kw = {"prompts": a.prompts} if a.prompts else {}
    cfg = EvalConfig(target=a.target, drafter=a.drafter, methods=a.methods.split(","),
                     budgets=_ids(a.budgets), max_tokens=a.max_tokens, temperature=a.temperature,
                     chat_template=a.chat_template, limit=a.limit, max_batch=a.max_batch, device=a.device,
                     dtype=a.dtype, tensor_parallel_size=a.tensor_parallel_size,
                     use_selector=False if a.no_selector else None, mtp_head=a.mtp_head,
                     num_speculative_tokens=_ids(a.num_speculative_tokens), **kw)
    _report(evaluate(cfg), a.json)


def _compare(a: argparse.Namespace) -> None:
    from flashtree.train.tau import CompareConfig, compare

    kw = {"prompts": a.prompts} if a.prompts else {}
    cfg = CompareConfig(variants=a.variants.split(","), target=a.target, method=a.method, budget=a.budget,
                        max_tokens=a.max_tokens, temperature=a.temperature, limit=a.limit, max_batch=a.max_batch,
                        dtype=a.dtype, **kw)
    _report(compare(cfg), a.json)


def _branch(a: argparse.Namespace) -> None:
    from flashtree.train.tau import BranchConfig, branch_acceptance

    kw = {"prompts": a.prompts} if a.prompts else {}
    cfg = BranchConfig(target=a.target, drafter=a.drafter, budget=a.budget, max_tokens=a.max_tokens, limit=a.limit,
                       use_selector=False if a.no_selector else None, dtype=a.dtype or "float32", **kw)
    print(json.dumps(branch_acceptance(cfg)))


def _demo(a: argparse.Namespace) -> None:
    from flashtree.train.demo import DemoConfig, build_demo

    kw = {"drafter_out": a.drafter_out} if a.drafter_out else {}
    if a.plot:
        kw["plot"] = a.plot
    if a.regen_drafter:
        kw |= {"regen_method": "ddtree", "regen_drafter": a.regen_drafter, "regen_budget": a.regen_budget}
    cfg = DemoConfig(work=a.work, build_target=not a.skip_target, target_minutes=a.target_minutes,
                     prompts=a.prompts, train_minutes=a.minutes, train_steps=None if a.minutes else a.steps,
                     threads=a.threads, seed=a.seed, temperatures=a.temperature, selector=a.selector, mtp=a.mtp, **kw)
    build_demo(cfg)


def _model_args(p: argparse.ArgumentParser, drafter: bool = False) -> None:
    p.add_argument("--target", help="HF target dir or hub id (default: the embedded demo target)")
    if drafter:
        p.add_argument("--drafter", help="DFlash drafter dir or hub id")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", help="the target's compute dtype (default: bf16 on cuda, fp32 on cpu)")


def register(subparsers) -> None:
    t = subparsers.add_parser("train", help="drafter training pipeline: regenerate, extract, train, eval, demo")
    sub = t.add_subparsers(dest="train_command", required=True)

    p = sub.add_parser("regenerate", help="write the target's own responses to a prompt JSONL")
    p.add_argument("prompts", help='JSONL: {"messages": [...]}, {"prompt": "..."} or {"prompt_ids": [...]}')
    p.add_argument("--out", required=True, help="output JSONL (rerun to resume)")
    _model_args(p, drafter=True)
    p.add_argument("--method", default="ddtree", help="ddtree (needs --drafter), dflash or ar")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--temperature", type=_temperatures, default=[0.0],
                   help="sampling temperature, or a comma-separated mix (e.g. 0,0.7,1): prompt n is "
                        "answered at the (n mod k)-th")
    p.add_argument("--each-temperature", action="store_true",
                   help="with a mix: answer every prompt at every temperature (ids suffixed @tT)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chat-template", action="store_true", help="wrap prompts in the target's chat template")
    p.add_argument("--chunk", type=int, default=64, help="prompts per generate call / append")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--limit", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_regenerate)

    p = sub.add_parser("extract", help="target features -> safetensors shards + manifest (resumable)")
    p.add_argument("data", help="regenerated JSONL")
    p.add_argument("--out", required=True, help="shard directory")
    _model_args(p)
    p.add_argument("--layer-ids", help="comma-separated target layers (default: DFlash's spacing)")
    p.add_argument("--num-draft-layers", type=int, default=1, help="picks the default layer ids")
    p.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--store-dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.set_defaults(func=_extract)

    p = sub.add_parser("train", help="train a DFlash drafter or (--mtp) an MTP head (torchrun for DDP)")
    p.add_argument("--out", required=True, help="drafter directory (z-lab format) + checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="feature shard directory (offline)")
    src.add_argument("--sequences", help="regenerated JSONL (online: the target runs in the trainer)")
    _model_args(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--layer-ids", help="online mode: comma-separated target layers")
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--mask-token-id", type=int)
    p.add_argument("--gamma", type=float, help="loss decay (default 7 * block_size / 16)")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch and rank")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int)
    p.add_argument("--epochs", type=float)
    p.add_argument("--minutes", type=float, help="time budget (the step count is fixed after 10 steps)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="auto, flex, split or dense")
    p.add_argument("--init-from-target", action="store_true")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--save-dtype", default="float32")
    p.add_argument("--threads", type=int)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--plot", help="loss-curve PNG (default OUT/loss.png)")
    p.add_argument("--selector", action="store_true",
                   help="train a DFlash2 drafter: block convolutions + a candidate selector (Markov drafts)")
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--selector-top-k", type=int, default=16, help="candidates per depth the selector rescores")
    p.add_argument("--conv-kernel-size", type=int, default=4)
    p.add_argument("--conv-group-size", type=int, help="channels sharing a predicted tap (default min(32, hidden))")
    p.add_argument("--mtp", action="store_true",
                   help="train an MTP head (one decoder layer + fc and norms, Qwen3.5's mtp.* layout) from the "
                        "target's last-layer features instead of a DFlash drafter")
    p.add_argument("--mtp-depth", type=int, default=3, help="--mtp: recursive draft steps trained (default 3)")
    p.add_argument("--mtp-step-decay", type=float, default=0.8, help="--mtp: step s weighs decay^(s-1)")
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="tau of a drafter for dflash and ddtree at several budgets (or an MTP head)")
    _model_args(p, drafter=True)
    p.add_argument("--mtp-head", help="--methods mtp: the head (default: the target's own)")
    p.add_argument("--num-speculative-tokens", default="3", help="--methods mtp: comma-separated k (default 3)")
    p.add_argument("--prompts", action="append", help="prompt JSONL (repeatable; default: the bench suites)")
    p.add_argument("--methods", default="dflash,ddtree")
    p.add_argument("--budgets", default="16,64,256")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--limit", type=int, help="prompts per file")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--no-selector", action="store_true", help="DFlash2 drafters: measure the marginal tree")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="split the target over N ranks")
    p.set_defaults(func=_eval)

    p = sub.add_parser("compare", help="drafters (and ar) interleaved on the same prompts: tau and tok/s")
    p.add_argument("variants", help='comma-separated: "ar", a drafter dir, or DIR:no-selector')
    p.add_argument("--target", help="HF target dir or hub id (default: the embedded demo target)")
    p.add_argument("--dtype", help="compute dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--prompts", action="append", help="prompt JSONL (repeatable; default: the bench suites)")
    p.add_argument("--method", default="ddtree")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, help="prompts per file")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=_compare)

    p = sub.add_parser("branch", help="greedy ddtree's acceptance one level below an accepted top-1 child vs sibling")
    _model_args(p, drafter=True)
    p.add_argument("--prompts", action="append", help="prompt JSONL (repeatable; default: the bench suites)")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="prompts per file")
    p.add_argument("--no-selector", action="store_true", help="DFlash2 drafters: the marginal tree")
    p.set_defaults(func=_branch)

    p = sub.add_parser("demo", help="rebuild the embedded demo target + drafter from the stdlib")
    p.add_argument("--work", default="runs/demo")
    p.add_argument("--skip-target", action="store_true", help="reuse the demo target already built")
    p.add_argument("--target-minutes", type=float, default=35.0)
    p.add_argument("--prompts", type=int, default=5000, help="training prompts cut from the corpus train split")
    p.add_argument("--steps", type=int, default=1200, help="drafter optimizer steps (the shipped drafter: 1200)")
    p.add_argument("--minutes", type=float, help="drafter time budget instead of --steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--selector", action=argparse.BooleanOptionalAction, default=True,
                   help="a DFlash2 drafter, as shipped (see train --selector); --no-selector: DFlash-1")
    p.add_argument("--temperature", type=_temperatures, default=[0.0, 0.7, 1.0],
                   help="regeneration temperature(s), taken in turn over prompts (default 0,0.7,1, as "
                        "shipped; the DFlash-1 demo drafter used 0)")
    p.add_argument("--regen-drafter", help="regenerate with ddtree and this drafter (default: ar)")
    p.add_argument("--regen-budget", type=int, default=16)
    p.add_argument("--drafter-out", help="where the drafter goes (default: the embedded demo drafter)")
    p.add_argument("--mtp", action="store_true",
                   help="train the demo target's MTP head on the same data instead of a drafter "
                        "(flashtree/assets/demo/mtp; see its recipe.json)")
    p.add_argument("--plot", help="loss-curve PNG (default docs/figures/demo_drafter_loss.png)")
    p.set_defaults(func=_demo)
