"""Benchmark harness: `flashtree bench` measures tau, speedup and where each round's time goes.

run_bench(BenchSpec(...)) -> BenchResult; report.py renders it (Markdown, JSON), plots.py draws it.
"""

from flashtree.bench.grid import BenchResult, BenchSpec, run_bench

__all__ = ["BenchResult", "BenchSpec", "run_bench"]
