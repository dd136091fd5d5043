#!/usr/bin/env bash
# bench/gpu_demo.sh [gpu_demo.py ARGS]: on a CUDA machine without network, make draftsmith importable from
# this checkout, then run bench/gpu_demo.py (the demo's job under a time budget; one table naming the GPU).
#
#   bash bench/gpu_wheels.sh                  # first, on a machine with PyPI: fills .whl/
#   bash bench/gpu_demo.sh                    # then on the GPU machine, from the checkout (with .whl/ beside it)
#
# Install, without network and without setuptools: the wheels in .whl/ (only what the GPU image lacks or holds
# in a version draftsmith does not run on) go to $DRAFTSMITH_SITE with pip --no-index --no-deps; the package is
# this checkout's src/ (the src layout needs no install step). Both lead PYTHONPATH. Output goes to $OUT (else runs/gpu-demo), the log there too (gpu_demo.log).
set -euo pipefail
T0=$(date +%s.%N)                               # the budget (--budget-s) counts the install too
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
SITE=${DRAFTSMITH_SITE:-/tmp/draftsmith-site}
OUTDIR=${OUT:-runs/gpu-demo}
BUDGET=420
for ((i = 1; i <= $#; i++)); do                 # the hard stop below follows --budget-s
    if [[ ${!i} == --budget-s ]]; then j=$((i + 1)); BUDGET=${!j}; fi
    if [[ ${!i} == --budget-s=* ]]; then BUDGET=${!i#--budget-s=}; fi
done

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
else
    echo "[gpu_demo.sh] no .whl/ here: using the installed packages as they are (bash bench/gpu_wheels.sh makes it)"
fi
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}  # a short log: progress bars redraw every 15 s
mkdir -p "$OUTDIR"
echo "[gpu_demo.sh] installed in $(awk -v t0="$T0" -v t1="$(date +%s.%N)" 'BEGIN {printf "%.1f", t1 - t0}') s;" \
     "draftsmith from $("$PY" -c 'import draftsmith, os; print(os.path.dirname(draftsmith.__file__))')"
# gpu_demo.py keeps its own deadlines; timeout is the last resort (SIGTERM 45 s past the budget, SIGKILL 10 s later)
timeout -k 10 "$(awk -v b="$BUDGET" 'BEGIN {printf "%d", b + 45}')" \
    "$PY" bench/gpu_demo.py --started-at "$T0" --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_demo.log"
