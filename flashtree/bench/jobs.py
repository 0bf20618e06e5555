"""One benchmark configuration in its own process, so no engine's threads, caches or compiled
kernels leak into another's numbers (benchmarks/vs_vllm.py, benchmarks/vllm_ddtree.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path


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
