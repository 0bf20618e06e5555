"""Acceptance length (tau) of a drafter, measured through the real engine.

tau = tokens emitted per speculative round (bonus included), over all rounds of all prompts:
the number that turns into speed. Measured for the chain (dflash) and for DDTree at several
budgets on the same prompts, at temperature 0 unless asked otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

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


def runs(cfg: EvalConfig) -> list[tuple[str, int]]:
    out = []
    for m in cfg.methods:
        out += [(m, b) for b in cfg.budgets] if m == "ddtree" else [(m, cfg.budgets[0] if cfg.budgets else 64)]
    return out


def label(method: str, budget: int) -> str:
    return f"ddtree@{budget}" if method == "ddtree" else method


def evaluate(cfg: EvalConfig, verbose: bool = True) -> dict:
    """{run label: {suite: tau, "all": tau, "tok_s": ...}} for every method/budget."""
    from flashtree import LLM, SamplingParams

    results: dict[str, dict] = {}
    for method, budget in runs(cfg):
        llm = LLM(target=cfg.target, drafter=cfg.drafter, method=method, budget=budget, device=cfg.device,
                  dtype=cfg.dtype, max_batch=cfg.max_batch, tensor_parallel_size=cfg.tensor_parallel_size)
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
