"""Kernels per layer of one eager bf16 AR step, counted as CUDA launches them (views free, F.rms_norm
one kernel: flashtree/bench/kernels.py), for the demo Qwen3 target, the demo DFlash2 drafter (in
a chain round) and a tiny random Qwen3.5 hybrid target (GDN and gated attention layers).

    python benchmarks/kernel_counts.py            # a markdown table, one row per layer kind
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from flashtree.bench.kernels import count_layer_ops  # noqa: E402


def one_round(config: EngineConfig, modules) -> dict[str, Counter]:
    engine = LLMEngine(replace(config, pack_weights=False))  # counted as on CUDA, which never packs
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=32, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return count_layer_ops(engine.step, modules(engine))


def main() -> None:
    from tests.test_qwen3_5 import make_qwen35

    rows = []
    ops = one_round(EngineConfig(method="ar", dtype="bfloat16"), lambda e: {"dense": e.target.layers[0]})
    rows.append(("demo Qwen3 target, decoder layer (AR step)", ops["dense"]))
    ops = one_round(EngineConfig(method="dflash", dtype="bfloat16"), lambda e: {"drafter": e.drafter.layers[0]})
    rows.append(("demo DFlash2 drafter layer (chain round)", ops["drafter"]))
    with tempfile.TemporaryDirectory() as tmp:
        target, _ = make_qwen35(Path(tmp) / "hybrid")
        layers = lambda e: {("gdn" if b.linear else "attn"): b for b in e.target.layers}  # noqa: E731
        ops = one_round(EngineConfig(target=str(target), method="ar", dtype="bfloat16"), layers)
    rows.append(("tiny Qwen3.5: Gated DeltaNet layer (AR step)", ops["gdn"]))
    rows.append(("tiny Qwen3.5: gated attention layer (AR step)", ops["attn"]))
    print("| layer | kernels | by op |\n|---|---|---|")
    for label, counter in rows:
        detail = ", ".join(f"{name} {n}" for name, n in counter.most_common())
        print(f"| {label} | {sum(counter.values())} | {detail} |")


if __name__ == "__main__":
    main()
