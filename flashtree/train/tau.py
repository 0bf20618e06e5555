"""Acceptance length (tau) of a drafter, measured through the real engine.

tau = tokens emitted per speculative round (bonus included), over all rounds of all prompts:
the number that turns into speed. Measured for the chain (dflash), for DDTree at several
budgets and for an MTP head at several k on the same prompts, at temperature 0 unless asked
otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from flashtree.errors import FlashtreeError
from flashtree.train.data import read_jsonl
from flashtree.train.responses import encode_prompt

PROMPT_DIR = Path(__file__).resolve().parents[1] / "bench" / "prompts"


@dataclass
class EvalConfig:
    target: str | None = None
    drafter: str | None = None
    prompts: list[str] = field(default_factory=lambda: [str(PROMPT_DIR / "code.jsonl"), str(PROMPT_DIR / "prose.jsonl")])
    methods: list[str] = field(default_factory=lambda: ["dflash", "ddtree"])
    budgets: list[int] = field(default_factory=lambda: [16, 64, 256])
    max_tokens: int = 128
    temperature: float = 0.0
    chat_template: bool = False
    limit: int | None = None  # prompts per file
    max_batch: int = 8
    device: str | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    use_selector: bool | None = None  # DFlash2 drafters: False measures the marginal tree
    mtp_head: str | None = None  # method mtp: None = the target's own head
    num_speculative_tokens: list[int] = field(default_factory=lambda: [3])  # method mtp: one run per k


def runs(cfg: EvalConfig) -> list[tuple[str, int]]:
    out = []
    for m in cfg.methods:
        if m == "ddtree":
            out += [(m, b) for b in cfg.budgets]
        elif m == "mtp":
            out += [(m, k) for k in cfg.num_speculative_tokens]
        else:
            out += [(m, cfg.budgets[0] if cfg.budgets else 64)]
    return out


def label(method: str, budget: int) -> str:
    return f"{method}@{budget}" if method in ("ddtree", "mtp") else method


def evaluate(cfg: EvalConfig, verbose: bool = True) -> dict:
    """{run label: {suite: tau, "all": tau, "tok_s": ...}} for every method/budget."""
    from flashtree import LLM, SamplingParams

    results: dict[str, dict] = {}
    for method, budget in runs(cfg):
        mtp = method == "mtp"
        llm = LLM(target=cfg.target, drafter=None if mtp else cfg.drafter, method=method,
                  budget=64 if mtp else budget, num_speculative_tokens=budget if mtp else 3, mtp_head=cfg.mtp_head,
                  device=cfg.device, dtype=cfg.dtype, max_batch=cfg.max_batch,
                  tensor_parallel_size=cfg.tensor_parallel_size, use_selector=cfg.use_selector)
        row: dict[str, float] = {}
        rounds = emitted = 0
        t0 = time.perf_counter()
        for path in cfg.prompts:
            recs = [rec for _, rec in read_jsonl(path)][: cfg.limit]
            prompts = [encode_prompt(r, llm.tokenizer, cfg.chat_template) for r in recs]
            params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=0)
            outs = llm.generate(prompts, params)
            r = sum(o.stats.rounds for o in outs)
            e = sum(sum(o.stats.accept_lengths) for o in outs)
            row[Path(path).stem] = e / max(1, r)
            rounds, emitted = rounds + r, emitted + e
        row["all"] = emitted / max(1, rounds)
        row["tok_s"] = emitted / (time.perf_counter() - t0)
        results[label(method, budget)] = row
        if verbose:
            parts = " ".join(f"{k}={v:.2f}" for k, v in row.items())
            print(f"{label(method, budget):>12}: tau {parts}", flush=True)
    return results


def table(results: dict) -> str:
    """A markdown table of tau per run and suite."""
    suites = [k for k in next(iter(results.values())) if k != "tok_s"]
    lines = ["| method | " + " | ".join(f"tau {s}" for s in suites) + " |",
             "|---|" + "---|" * len(suites)]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.2f}" for s in suites) + " |")
    return "\n".join(lines)


@dataclass
class CompareConfig:
    """Several drafters (or ar) on the same prompts, interleaved chunk by chunk, so a shared
    machine's load falls on all of them alike."""

    variants: list[str]  # "ar", "PATH" or "PATH:no-selector"
    target: str | None = None
    prompts: list[str] = field(default_factory=lambda: [str(PROMPT_DIR / "code.jsonl"), str(PROMPT_DIR / "prose.jsonl")])
    method: str = "ddtree"
    budget: int = 16
    max_tokens: int = 128
    temperature: float = 0.0
    limit: int | None = None
    max_batch: int = 8
    dtype: str | None = None


def compare(cfg: CompareConfig, verbose: bool = True) -> dict:
    """{variant: {suite: tau, "all": tau, "tok_s": output tokens per second}}; each chunk of
    max_batch prompts runs every variant once, in an order that rotates from chunk to chunk."""
    from flashtree import LLM, SamplingParams

    llms = {}
    for v in cfg.variants:
        if v == "ar":
            llms[v] = LLM(target=cfg.target, method="ar", dtype=cfg.dtype, max_batch=cfg.max_batch)
            continue
        path, _, option = v.partition(":")
        if option not in ("", "no-selector"):
            raise FlashtreeError(f"variant {v!r}: the only option is ':no-selector'")
        llms[v] = LLM(target=cfg.target, drafter=path, method=cfg.method, budget=cfg.budget, dtype=cfg.dtype,
                      max_batch=cfg.max_batch, use_selector=False if option else None)
    stats = {v: {"rounds": 0, "emitted": 0, "tokens": 0, "seconds": 0.0} for v in llms}
    suites = {v: {} for v in llms}
    turn = 0
    for path in cfg.prompts:
        tok = next(iter(llms.values())).tokenizer
        prompts = [encode_prompt(r, tok, False) for _, r in read_jsonl(path)][: cfg.limit]
        per = {v: [0, 0] for v in llms}
        for c in range(0, len(prompts), cfg.max_batch):
            chunk = prompts[c : c + cfg.max_batch]
            order = list(llms)[turn % len(llms):] + list(llms)[: turn % len(llms)]
            turn += 1
            for v in order:
                params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=c)
                t0 = time.perf_counter()
                outs = llms[v].generate(chunk, params)
                st = stats[v]
                st["seconds"] += time.perf_counter() - t0
                st["tokens"] += sum(len(o.token_ids) for o in outs)
                r, e = sum(o.stats.rounds for o in outs), sum(sum(o.stats.accept_lengths) for o in outs)
                st["rounds"], st["emitted"] = st["rounds"] + r, st["emitted"] + e
                per[v][0], per[v][1] = per[v][0] + r, per[v][1] + e
        for v in llms:
            suites[v][Path(path).stem] = per[v][1] / max(1, per[v][0])
    results = {}
    for v, st in stats.items():
        results[v] = suites[v] | {"all": st["emitted"] / max(1, st["rounds"]), "tok_s": st["tokens"] / st["seconds"]}
        if verbose:
            print(f"{v}: " + " ".join(f"{k}={x:.2f}" for k, x in results[v].items()), flush=True)
    return results


@dataclass
class BranchConfig:
    """Sibling-branch acceptance of greedy DDTree, replayed on the target's own greedy outputs."""

    target: str | None = None
    drafter: str | None = None
    prompts: list[str] = field(default_factory=lambda: [str(PROMPT_DIR / "code.jsonl"), str(PROMPT_DIR / "prose.jsonl")])
    budget: int = 16
    max_tokens: int = 128
    use_selector: bool | None = None
    limit: int | None = None
    dtype: str | None = "float32"


def branch_acceptance(cfg: BranchConfig) -> dict:
    """How often the walk goes one level deeper after accepting the top-1 child of its node (the
    spine) vs a sibling (a non-top-1 child), at temperature 0.

    At T = 0 the accepted path is the target's greedy continuation, so the rounds are replayed
    offline: the target's greedy output once (ar), its features in one causal forward, then per
    round the drafter's tree at the round's root and a walk along the known continuation. A
    node's top-1 child is its best-scored one (the first of its children in the tree's order).
    Returns counts and rates, plus tau of the replay (which the engine's tau matches up to
    float rounding of the context features).
    """
    import torch

    from flashtree import LLM, SamplingParams
    from flashtree.config import DEMO_DRAFTER, DEMO_TARGET
    from flashtree.models.context import ForwardContext
    from flashtree.models.dflash2 import DFlash2Drafter, load_drafter
    from flashtree.models.loader import load_target, parse_dtype
    from flashtree.tree import build_tree
    from flashtree.tree.markov import build_markov_tree

    device = torch.device("cpu")
    dtype = parse_dtype(cfg.dtype, device)
    target_path, drafter_path = cfg.target or str(DEMO_TARGET), cfg.drafter or str(DEMO_DRAFTER)
    ar = LLM(target=target_path, method="ar", dtype=cfg.dtype, max_batch=8)
    prompts = []
    for path in cfg.prompts:
        prompts += [encode_prompt(r, ar.tokenizer, False) for _, r in read_jsonl(path)][: cfg.limit]
    target = load_target(target_path, dtype, device)
    drafter = load_drafter(drafter_path, target, dtype, device)
    # A block's worth past max_tokens: the last rounds' walks look ahead as the engine's do.
    outs = ar.generate(prompts, SamplingParams(max_tokens=cfg.max_tokens + drafter.block_size))
    markov = isinstance(drafter, DFlash2Drafter) and cfg.use_selector is not False
    counts = {"rounds": 0, "emitted": 0, "spine": 0, "spine_next": 0, "sibling": 0, "sibling_next": 0}
    ids_all = [p + o.token_ids for p, o in zip(prompts, outs)]
    layers = tuple(drafter.args.target_layer_ids)
    block_size, mask = drafter.block_size, drafter.args.mask_token_id
    with torch.inference_mode():
        for prompt, ids in zip(prompts, ids_all):
            n = len(ids)
            tokens = torch.tensor([ids])
            feats = target(tokens, ForwardContext.prefill(target.new_cache(1, n), [0], n), layers).features
            dcache = drafter.new_cache(1, n + block_size)
            drafter.add_context(ForwardContext.block(dcache, [0], n), feats)
            p, emitted = len(prompt), 1  # the first round's root: the target's first token
            while emitted < cfg.max_tokens and p < n - 1:  # the engine's rounds, until max_tokens
                dcache.set_length(0, p)  # the drafter sees the features of positions < p
                block = torch.tensor([[ids[p]] + [mask] * (block_size - 1)])
                hidden = drafter(target.embed_tokens(block), ForwardContext.block(dcache, [0], block_size))[:, 1:]
                if isinstance(drafter, DFlash2Drafter):
                    logits = drafter.logits(hidden, target.lm_head)
                else:
                    logits = target.lm_head(hidden)
                root = torch.tensor([ids[p]])
                spec = (build_markov_tree(root, *drafter.transitions(hidden, logits, root), cfg.budget) if markov
                        else build_tree(root, logits, cfg.budget))
                size = int(spec.sizes[0])
                toks, parents = spec.tokens[0, :size].tolist(), spec.parents[0, :size].tolist()
                first_child = {}
                for i in range(1, size):
                    first_child.setdefault(parents[i], i)
                node, depth, path = 0, 0, []
                while p + depth + 1 < n:
                    nxt = next((i for i in range(1, size) if parents[i] == node and toks[i] == ids[p + depth + 1]), None)
                    if nxt is None:
                        break
                    path.append(first_child[node] == nxt)
                    node, depth = nxt, depth + 1
                for d, top1 in enumerate(path):
                    key = "spine" if top1 else "sibling"
                    counts[key] += 1
                    counts[key + "_next"] += d + 1 < len(path)
                counts["rounds"] += 1
                counts["emitted"] += depth + 1
                p, emitted = p + depth + 1, emitted + depth + 1
    counts["tau"] = counts["emitted"] / max(1, counts["rounds"])
    counts["spine_rate"] = counts["spine_next"] / max(1, counts["spine"])
    counts["sibling_rate"] = counts["sibling_next"] / max(1, counts["sibling"])
    return counts
