#!/usr/bin/env bash
# Reproduce the runs in docs/benchmarks.md on the embedded demo pair, and refresh its figures.
#
#   benchmarks/bench_docs.sh            # quick + default grid (CPU: about 1 + 30 minutes)
#   benchmarks/bench_docs.sh quick      # only the quick run
#   METHODS=ar benchmarks/bench_docs.sh # e.g. before the demo drafter exists
#
# Results land in $OUT_ROOT/{quick,default}/ (default OUT_ROOT=runs/bench: results.json,
# results.md, PNGs); the PNGs are copied to docs/figures/bench_{quick,default}_*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
which="${1:-all}"
root="${OUT_ROOT:-runs/bench}"
extra=()
[[ -n "${METHODS:-}" ]] && extra+=(--methods "$METHODS")

run() {  # name, flags...
  local name=$1; shift
  python -m flashtree.cli bench "$@" "${extra[@]}" --out "$root/$name"
  mkdir -p docs/figures
  for png in "$root/$name"/*.png; do
    cp "$png" "docs/figures/bench_${name}_$(basename "$png")"
  done
}

if [[ $which == all || $which == quick ]]; then run quick --quick; fi
if [[ $which == all || $which == default ]]; then run default; fi
