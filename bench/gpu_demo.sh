#!/usr/bin/env bash
# bench/gpu_demo.sh [gpu_demo.py ARGS]: on a CUDA machine without network, make draftsmith importable from
# this checkout, then run bench/gpu_demo.py (the demo's job under a time budget; one table naming the GPU).
#
#   bash bench/gpu_wheels.sh                  # first, on a machine with PyPI: fills .whl/
#   bash bench/gpu_demo.sh                    # then on the GPU machine, from the checkout (with .whl/ beside it)
#
# Install, without network and without setuptools: bench/gpu_env.sh. Output goes to $OUT (else runs/gpu-demo), the
# log there too (gpu_demo.log).
set -euo pipefail
T0=$(date +%s.%N)                               # the budget (--budget-s) counts the install too
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-runs/gpu-demo}
BUDGET=420
for ((i = 1; i <= $#; i++)); do                 # the hard stop below follows --budget-s
    if [[ ${!i} == --budget-s ]]; then j=$((i + 1)); BUDGET=${!j}; fi
    if [[ ${!i} == --budget-s=* ]]; then BUDGET=${!i#--budget-s=}; fi
done

source bench/gpu_env.sh
mkdir -p "$OUTDIR"
echo "[gpu_demo.sh] installed in $(awk -v t0="$T0" -v t1="$(date +%s.%N)" 'BEGIN {printf "%.1f", t1 - t0}') s;" \
     "draftsmith from $("$PY" -c 'import draftsmith, os; print(os.path.dirname(draftsmith.__file__))')"
# gpu_demo.py keeps its own deadlines; timeout is the last resort (SIGTERM 45 s past the budget, SIGKILL 10 s later)
timeout -k 10 "$(awk -v b="$BUDGET" 'BEGIN {printf "%d", b + 45}')" \
    "$PY" bench/gpu_demo.py --started-at "$T0" --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_demo.log"
