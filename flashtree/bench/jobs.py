"""Two ways to run benchmark configurations against each other (benchmarks/vs_vllm.py,
benchmarks/vllm_ddtree.py): each in its own process, so no engine's threads, caches or compiled
kernels leak into another's numbers; or all in one process taking turns, so the box's drift falls
on every configuration alike."""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable


def run_job(python: str, script: str, job: dict, env: dict[str, str], label: str) -> dict:
    """Run `python script --worker JOB OUT` with `job` as JOB's JSON and return OUT's JSON; a
    failed worker stops the benchmark with its last lines, named after `label`."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([python, script, "--worker", str(job_file), str(out_file)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise SystemExit(f"{Path(script).stem}: {label} failed:\n{tail}")
        return json.loads(out_file.read_text())


def take_turns(runs: dict[str, Callable[[object], list]], items: list, passes: int, seed: int = 0) -> dict[str, dict]:
    """Every item through every run, item by item, the runs in a new (seeded) random order each turn.
    Per label: its own turns' process CPU seconds and wall seconds over all passes, and the last pass's
    results (each run returns a list per item, concatenated in item order)."""
    rng = random.Random(seed)
    out = {label: {"cpu": 0.0, "wall": 0.0, "results": []} for label in runs}
    for _ in range(passes):
        for label in runs:
            out[label]["results"] = []
        for item in items:
            order = list(runs)
            rng.shuffle(order)
            for label in order:
                c0, t0 = time.process_time(), time.perf_counter()
                results = runs[label](item)
                out[label]["cpu"] += time.process_time() - c0
                out[label]["wall"] += time.perf_counter() - t0
                out[label]["results"] += results
    return out
