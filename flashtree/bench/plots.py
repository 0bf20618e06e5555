"""PNG plots of a bench run (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flashtree.bench.grid import BenchResult  # noqa: E402
from flashtree.bench.metrics import CellSummary  # noqa: E402

PLOTS = ("speedup", "tau", "accept_hist", "cost_curve", "stages")


def _by_temperature(result: BenchResult):
    fig, axes = plt.subplots(1, len(result.spec.temperatures), figsize=(5.5 * len(result.spec.temperatures), 4),
                             squeeze=False, sharey=True)
    return fig, list(zip(result.spec.temperatures, axes[0]))


def _suites(result: BenchResult) -> list[str]:
    return list(result.suites) + (["all"] if len(result.suites) > 1 else [])


def _cells(result: BenchResult, suite: str, t: float, method: str) -> list[CellSummary]:
    return [c for c in result.cells if c.suite == suite and c.temperature == t and c.method == method]


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _vs_budget(result: BenchResult, path: Path, value, predicted=None, ylabel: str = "", baseline: float | None = None):
    """One panel per temperature: ddtree over budgets per suite, dflash as a flat dotted line."""
    fig, axes = _by_temperature(result)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for t, ax in axes:
        for i, suite in enumerate(_suites(result)):
            color = colors[i % len(colors)]
            tree = [c for c in _cells(result, suite, t, "ddtree") if c.budget != "auto"]
            for c in _cells(result, suite, t, "ddtree"):
                if c.budget == "auto" and value(c) is not None:
                    ax.axhline(value(c), color=color, ls="-.", lw=1, label=f"{suite} ddtree auto")
            if tree:
                xs = [c.budget for c in tree]
                ax.plot(xs, [_nan(value(c)) for c in tree], "o-", color=color, label=f"{suite} ddtree")
                if predicted is not None:
                    ax.plot(xs, [_nan(predicted(c)) for c in tree], "x--", color=color, alpha=0.6,
                            label=f"{suite} predicted")
            for c in _cells(result, suite, t, "dflash"):
                if value(c) is not None:
                    ax.axhline(value(c), color=color, ls=":", label=f"{suite} dflash")
        if baseline is not None:
            ax.axhline(baseline, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTree budget (drafted nodes)")
        ax.set_title(f"temperature {t:g}")
        ax.grid(alpha=0.3)
    axes[0][1].set_ylabel(ylabel)
    axes[-1][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accept_hist(result: BenchResult, path: Path) -> None:
    """Pooled over suites: dflash, auto, and at most three fixed budgets (smallest, fastest, largest)."""
    suite = "all" if len(result.suites) > 1 else result.suites[0]
    fig, axes = _by_temperature(result)
    for t, ax in axes:
        chosen = _cells(result, suite, t, "dflash")
        tree = [c for c in _cells(result, suite, t, "ddtree") if c.budget != "auto"]
        if len(tree) > 3:
            best = max(range(len(tree)), key=lambda i: tree[i].speedup or tree[i].tokens_per_s)
            tree = [tree[i] for i in sorted({0, best, len(tree) - 1})]
        chosen += tree + [c for c in _cells(result, suite, t, "ddtree") if c.budget == "auto"]
        width = 0.8 / max(1, len(chosen))
        for j, c in enumerate(chosen):
            xs = [k + 1 + (j - (len(chosen) - 1) / 2) * width for k in range(len(c.accept_fractions))]
            ax.bar(xs, c.accept_fractions, width=width, label=f"{c.label} (tau {c.tau:.2f})")
        ax.set_xlabel("tokens per round (accepted + bonus)")
        ax.set_title(f"{suite}, temperature {t:g}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    axes[0][1].set_ylabel("fraction of rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cost_curve(result: BenchResult, path: Path) -> None:
    cost = result.cost
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for t in result.spec.temperatures:
        ax.plot([p.nodes for p in cost.tree], [p.verify_ms(t) for p in cost.tree], "o-", ms=3,
                label=f"tree verify, T={t:g}")
    chain = [p for p in cost.chain if p.nodes > 1]
    if chain:
        ax.plot([p.nodes for p in chain], [p.verify_ms(0.0) for p in chain], "s", color="k", label="chain verify (dflash)")
    ar = [c for c in result.cells if c.method == "ar" and c.suite == _suites(result)[-1]]
    for c in ar[:1]:
        ax.axhline(c.round_ms, color="gray", ls=":", label=f"ar round, measured ({c.round_ms:.2f} ms)")
    drafts = [c.stage_ms_per_round["draft"] for c in result.cells if c.method != "ar"]
    if drafts:
        d = sum(drafts) / len(drafts)
        ax.axhline(d, color="tab:red", ls="--", lw=0.8, label=f"draft, measured ({d:.2f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes verified (budget + root)")
    ax.set_ylabel("ms per target verify (fastest of repeats)")
    ax.set_title(f"target verify cost at context {cost.context_len}")
    # Right axis: the same cost in 1-node verifies, the yardstick tau has to beat.
    t1 = cost.tree[0].verify_ms(0.0)
    if t1 > 0:
        right = ax.secondary_yaxis("right", functions=(lambda y: y / t1, lambda r: r * t1))
        right.set_ylabel("x one-node verify")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stages(result: BenchResult, path: Path) -> None:
    """Where one round's time goes, per cell: each stage's share of the round, with the round's
    ms on top (absolute bars would be flattened by the largest budgets)."""
    suite = _suites(result)[-1]
    fig, axes = _by_temperature(result)
    stages = ("draft", "tree", "verify", "commit")
    for t, ax in axes:
        cells = [c for c in result.cells if c.suite == suite and c.temperature == t]
        bottom = [0.0] * len(cells)
        for s in stages:
            vals = [100 * c.stage_ms_per_round[s] / c.round_ms if c.round_ms else 0.0 for c in cells]
            ax.bar(range(len(cells)), vals, bottom=bottom, label=s)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, c in enumerate(cells):
            ax.text(i, 101, f"{c.round_ms:.3g}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(range(len(cells)), [c.label.replace("ddtree-", "B=") for c in cells], rotation=60, fontsize=7)
        ax.set_ylim(0, 125)
        ax.set_title(f"{suite}, temperature {t:g} (ms per round on top)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][1].set_ylabel("% of round time")
    fig.legend(*axes[0][1].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: BenchResult, out: Path, prefix: str = "") -> list[Path]:
    paths = {name: out / f"{prefix}{name}.png" for name in PLOTS}
    _vs_budget(result, paths["speedup"], lambda c: c.speedup, lambda c: c.predicted_speedup,
               "speedup vs ar (tokens/s)", baseline=1.0)
    _vs_budget(result, paths["tau"], lambda c: c.tau, None, "tau (tokens per round)")
    plot_accept_hist(result, paths["accept_hist"])
    plot_cost_curve(result, paths["cost_curve"])
    plot_stages(result, paths["stages"])
    return list(paths.values())
