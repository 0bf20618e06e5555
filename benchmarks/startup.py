"""How soon the CLI answers: seconds until `flashtree --version`, `--help` and `serve --help`
exit, and until `generate` prints its first line on stderr and exits.

    OMP_NUM_THREADS=1 python benchmarks/startup.py --repeats 3

Each command runs as `python -m flashtree ...` in a fresh process (the flashtree on
PYTHONPATH or installed), so torch and the rest are imported as a user's shell would.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [["--version"], ["--help"], ["serve", "--help"]]
GENERATE = ["generate", "def fib(n):", "--method", "ar", "--max-tokens", "8"]


def timed(argv: list[str]) -> tuple[float, float]:
    """(seconds to the first stderr line, or to exit if there is none; seconds to exit)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flashtree", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first = time.perf_counter() - t0 if proc.stderr.readline() else None
    proc.stderr.read()
    proc.wait()
    end = time.perf_counter() - t0
    return (end if first is None else first), end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| command | first line s (median) | exit s (median) |")
    print("|---|---|---|")
    for argv in COMMANDS + [GENERATE]:
        runs = [timed(argv) for _ in range(args.repeats)]
        first = statistics.median(r[0] for r in runs) if argv is GENERATE else None
        shown = f"{first:.2f}" if first is not None else "-"
        print(f"| flashtree {' '.join(argv)} | {shown} | {statistics.median(r[1] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
