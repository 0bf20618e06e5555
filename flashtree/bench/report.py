"""Bench output: the Markdown table for stdout, and the JSON that keeps every number and the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from flashtree.bench.cost import CostCurve, CostPoint
from flashtree.bench.grid import BenchResult, BenchSpec
from flashtree.bench.metrics import CellSummary

REPO_DIR = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict:
    """The checkout's commit and whether tracked files differ from it; None outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO_DIR), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if commit is None or dirty is None else bool(dirty)}


def environment(device: str, dtype: str) -> dict:
    import transformers

    import flashtree

    dev = torch.device(device)
    return {
        "flashtree": flashtree.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "git": git_commit(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _f(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def cell_row(c: CellSummary) -> list[str]:
    st = c.stage_ms_per_round
    return [c.suite, f"{c.temperature:g}", c.method, "" if c.budget is None else str(c.budget), _f(c.tau),
            _f(c.tokens_per_s, 1), _f(c.speedup, 2, "x"), _f(c.predicted_speedup, 2, "x"),
            _f(st["draft"]), _f(st["tree"]), _f(st["verify"]), _f(st["commit"]), _f(100 * c.overhead_share, 1, "%"),
            "" if c.matches_ar is None else f"{100 * c.matches_ar:.0f}%"]


HEADER = ["suite", "T", "method", "B", "tau", "tok/s", "speedup", "predicted", "draft ms", "tree ms", "verify ms",
          "commit ms", "overhead", "= ar"]


def markdown_table(cells: list[CellSummary]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" if i < 3 else "--:" for i in range(len(HEADER))) + "|"]
    lines += ["| " + " | ".join(cell_row(c)) + " |" for c in cells]
    return "\n".join(lines)


def cost_table(result: BenchResult) -> str:
    cost = result.cost
    temps = [str(float(t)) for t in result.spec.temperatures]
    head = ["nodes", "forward ms"] + [f"verify ms (T={float(t):g})" for t in temps]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("--:" for _ in head) + "|"]
    for kind, points in (("tree", cost.tree), ("chain", cost.chain)):
        for p in points:
            name = f"{p.nodes}" if kind == "tree" else f"{p.nodes} (chain)"
            lines.append("| " + " | ".join([name, _f(p.forward_ms, 3)] + [_f(p.verify_ms(float(t)), 3) for t in temps]) + " |")
    return "\n".join(lines)


def best_budgets(cells: list[CellSummary]) -> list[str]:
    """Per (suite, temperature): the ddtree budget with the highest measured and predicted speedup."""
    lines = []
    groups: dict[tuple[str, float], list[CellSummary]] = {}
    for c in cells:
        if c.method == "ddtree":
            groups.setdefault((c.suite, c.temperature), []).append(c)
    for (suite, t), cs in groups.items():
        meas = max(cs, key=lambda c: c.speedup if c.speedup is not None else c.tokens_per_s)
        fixed = [c for c in cs if c.predicted_speedup is not None]
        if not fixed:
            continue
        pred = max(fixed, key=lambda c: c.predicted_speedup)
        lines.append(f"{suite} T={t:g}: best measured B={meas.budget} ({_f(meas.speedup, 2, 'x')}, tau {meas.tau:.2f}); "
                     f"best predicted B={pred.budget} ({_f(pred.predicted_speedup, 2, 'x')})")
    return lines


def markdown_report(result: BenchResult, env: dict) -> str:
    spec = result.spec
    lengths = [n for ns in result.prompt_tokens.values() for n in ns]
    ar = [c for c in result.cells if c.method == "ar"]
    head = (f"flashtree bench: {env['device_name']} ({result.device}, {result.dtype}, {env['torch_threads']} threads), "
            f"{len(lengths)} prompts ({min(lengths)}-{max(lengths)} tokens), max_tokens {spec.max_tokens}, "
            f"block {result.block_size}, {result.seconds:.0f} s")
    names = ", ".join(f"{k} {Path(v['path']).name if v['path'] else '?'} ({(v['sha256'] or '?')[:8]})"
                      for k, v in result.models.items())
    parts = [head, f"models: {names}" if names else "", "", markdown_table(result.cells), ""]
    if ar:
        parts.append("T_ar_step (measured ar round): " + ", ".join(f"{c.suite} T={c.temperature:g}: {c.round_ms:.2f} ms"
                                                                    for c in ar))
    parts += [f"Cost curve at context {result.cost.context_len} (fastest of {result.cost.repeats}):", "",
              cost_table(result), ""]
    parts += best_budgets(result.cells)
    return "\n".join(parts)


def to_json(result: BenchResult, env: dict, argv: list[str] | None = None) -> dict:
    records = [
        {"suite": s, "temperature": t, "cell": label, **{k: v for k, v in asdict(r).items()}}
        for (s, t, label), recs in result.records.items() for r in recs
    ]
    return {
        "schema": 1,
        "argv": argv,
        "spec": asdict(result.spec),
        "environment": env,
        "block_size": result.block_size,
        "seconds": result.seconds,
        "load_average_start": result.load_average_start,
        "models": result.models,
        "prompt_tokens": result.prompt_tokens,
        "cells": [{"label": c.label, **asdict(c)} for c in result.cells],
        "cost_curve": result.cost.as_dict(),
        "requests": records,
    }


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def result_from_json(data: dict) -> BenchResult:
    """A BenchResult back from results.json (summaries and cost curve; per-request records are left
    out), so tables and plots can be redrawn without measuring again."""
    fields = set(CellSummary.__dataclass_fields__)
    cells = [CellSummary(**{k: v for k, v in c.items() if k in fields}) for c in data["cells"]]
    cc = data["cost_curve"]

    def points(rows: list[dict]) -> list[CostPoint]:
        return [CostPoint(r["nodes"], r["forward_ms"], r.get("forward_median_ms", r["forward_ms"]), r["pick_ms"])
                for r in rows]

    cost = CostCurve(cc["context_len"], cc["repeats"], cc["depth"], points(cc["tree"]), points(cc["chain"]))
    suites = list(dict.fromkeys(c.suite for c in cells if c.suite != "all"))
    return BenchResult(BenchSpec(**data["spec"]), suites, cells, {}, cost, data["block_size"],
                       data["prompt_tokens"], data["environment"]["device"], data["environment"]["dtype"],
                       data["seconds"], data.get("load_average_start"), data.get("models") or {})
