"""One engine label of this working tree against the same label at an earlier git revision, in one
process, interleaved: the A/B behind a change to the policy or the runner, reproducible from its
commit (the old code is `git archive`d into a temporary package, flashtree renamed throughout so
both import side by side, torch.library namespace included).

Per (temperature, batch, fill) cell it runs `ar` and the label from this tree, and the label from
`--rev`, on the same requests (policy_heldout's prompts and lengths, seeded), interleaved as
policy_heldout.py does, rated by each engine's own CPU seconds (wall seconds on a GPU), all passes
together; new / old is the change's ratio, new / ar and old / ar put it in context. Both price rounds
from one cost table measured afresh for the run.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/ab_revision.py --rev f69c3fc~1 \\
        --packages websockets prometheus_client httpcore pluggy markupsafe --temperatures 0 --batches 8 16
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import policy_heldout as H  # noqa: E402
from flashtree import SamplingParams  # noqa: E402
from flashtree.bench.policy_grid import GridCell, run_interleaved  # noqa: E402


def old_package(rev: str, into: Path):
    """flashtree as of `rev`, importable as flashtree_<hash> (every `flashtree` word renamed)."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True)
    if short.returncode != 0:
        raise SystemExit(f"ab_revision: {rev!r} is not a revision of {ROOT}: {short.stderr.strip()}")
    name = f"flashtree_{short.stdout.strip()}"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "flashtree"], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    (into / "flashtree").rename(into / name)
    for f in (into / name).rglob("*.py"):
        f.write_text(re.sub(r"\bflashtree\b", name, f.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def engine(package, label: str, batch: int, base=None, drafter: str | None = None):
    """policy_heldout.engine's configuration, built by `package` (this tree's flashtree or the old one)."""
    method, budget = ("ddtree", "auto") if label == "auto" else (label, 64)
    if label.startswith("ddtree-"):
        method, budget = "ddtree", int(label.split("-")[1])
    config = package.EngineConfig(drafter=drafter, method=method, budget=budget, max_budget=64, max_batch=batch,
                                  max_model_len=1024, prefix_cache=False)
    return package.LLMEngine(config, share_weights=base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare against (e.g. HEAD~1)")
    ap.add_argument("--label", default="auto", help="the engine compared: auto, dflash, ddtree-16, ...")
    ap.add_argument("--packages", nargs="+", default=list(H.PACKAGES), help="as policy_heldout.py")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--shapes", nargs="+", default=["at-once"], choices=["at-once", "gradual"])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="a drafter directory (default: the shipped DFlash2 demo drafter)")
    args = ap.parse_args()
    texts = H.heldout_prompts(64, packages=tuple(args.packages))
    with tempfile.TemporaryDirectory() as tmp:
        # One fresh cost cache for both (the old code reads the same variable): the user's, refined by
        # earlier runs beside other jobs, would price the two differently.
        os.environ["FLASHTREE_CACHE_DIR"] = str(Path(tmp) / "costs")
        old = old_package(args.rev, Path(tmp))
        import flashtree

        base = engine(flashtree, "ar", 1)
        old_base = engine(old, "ar", 1)
        for t in args.temperatures:
            for b in args.batches:
                for shape in args.shapes:
                    n = max(8, b)
                    ids = [base.encode(x)[-400:] for x in texts[:n]]
                    spec = [dict(temperature=t, max_tokens=H.LENGTHS[i % len(H.LENGTHS)], ignore_eos=True,
                                 seed=1000 + i) for i in range(n)]
                    runs = {"ar": (engine(flashtree, "ar", b, base), SamplingParams),
                            "new": (engine(flashtree, args.label, b, base, args.drafter), SamplingParams),
                            "old": (engine(old, args.label, b, old_base, args.drafter), old.SamplingParams)}
                    cells = {k: GridCell(t, b, k) for k in runs}
                    clock = time.perf_counter if base.device.type == "cuda" else time.process_time
                    for p in range(args.passes):
                        run_interleaved([H.Arrivals(eng, ids, [cls(**s) for s in spec], cells[k],
                                                    0 if shape == "at-once" else 2, clock)
                                         for k, (eng, cls) in runs.items()],
                                        seed=1000 * p + 10 * b + round(10 * t) + (shape == "gradual"))
                    r = {k: c.tokens_per_s for k, c in cells.items()}
                    same = all(c.outputs == cells["ar"].outputs for c in cells.values())
                    print(f"T={t} batch={b} {shape}: ar {r['ar']:.0f} new {r['new']:.0f} old {r['old']:.0f} | "
                          f"new/old {r['new'] / r['old']:.3f} new/ar {r['new'] / r['ar']:.3f} "
                          f"old/ar {r['old'] / r['ar']:.3f}" + ("" if same else " OUTPUTS DIFFER"), flush=True)


if __name__ == "__main__":
    main()
