"""Benchmark harness: `flashtree bench` measures tau, speedup and where each round's time goes.

run_bench(BenchSpec(...)) -> BenchResult; report.py renders it (Markdown, JSON), plots.py draws it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtree.lazy import lazy_exports

if TYPE_CHECKING:
    from flashtree.bench.grid import BenchResult, BenchSpec, run_bench

__all__ = ["BenchResult", "BenchSpec", "run_bench"]
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "flashtree.bench.grid"))
