#!/usr/bin/env bash
# bench/gpu_checks.sh HEAD [BUDGET_S]: the runtime's figures on a lent CUDA machine, in one call of the device tool.
#
#   bash bench/gpu_wheels.sh                                   # here, where PyPI is reachable: fills .whl/
#   bash bench/gpu_checks.sh runs/reference-eagle3/head 480    # there (carry .whl and the head)
#
# HEAD is a trained EAGLE-3 head (make demo's). In order, each step under its own time limit, so a step that fails or
# overruns costs only itself; the steps' logs and outputs are packed into $OUT/gpu_checks.tar.gz (the device tool
# brings back 8 files at most) and each log's tail is printed:
#   env         torch, CUDA, the GPU, the CPU cores;
#   dflash_cost bench/dflash_cost.py --device cuda: a DFlash block forward against EAGLE-3's k head steps (k 3 5 7);
#   bench       draftsmith bench --device cuda over concurrency 1 4 16 32: none, ngram, eagle3 (k = 5), 32 prompts x
#               64 tokens: output tokens/s, TTFT, TPOT, speedup, greedy identity (issue 15's scaling bar);
#   gpu_demo    bench/gpu_demo.py (the demo's job: regenerate, train, eval, serve) in the time that is left.
# BUDGET_S (default 480) counts from this script's start, the install included.
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
HEAD=${1:?usage: bench/gpu_checks.sh HEAD [BUDGET_S]}
BUDGET=${2:-480}
DEVICE=${DRAFTSMITH_CHECK_DEVICE:-cuda}     # cpu: a smoke run of this script here
RES=$(mktemp -d /tmp/gpu-checks.XXXXXX)
OUTDIR=${OUT:-runs/gpu-checks}
mkdir -p "$OUTDIR"
source bench/gpu_env.sh

left() { echo $((BUDGET - ($(date +%s) - T0))); }
step() {  # step NAME LIMIT_S COMMAND...: run with a limit (cut to the budget left), log to $RES/NAME.log
    local name=$1 limit=$2 rc
    shift 2
    ((limit > $(left) - 5)) && limit=$(($(left) - 5))
    if ((limit < 15)); then
        echo "== $name: skipped ($(left) s of the budget left)"
        return
    fi
    echo "== $name (limit ${limit} s): $*"
    local t=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$RES/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(($(date +%s) - t)) s$( ((rc == 124)) && echo ' (cut at its limit)')"
    grep -v -e 'Loading weights' -e '|.*it/s' "$RES/$name.log" | tail -45
}

step env 60 "$PY" -c "
import os, platform, torch, transformers
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)
print('cpu', platform.processor() or platform.machine(), 'cores', os.cpu_count())
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
import draftsmith; print('draftsmith', draftsmith.__file__)"
step dflash_cost 120 "$PY" bench/dflash_cost.py --device "$DEVICE" --eagle3 "$HEAD" --k 3 5 7 --layers 1 2 \
    --repeats 100
step bench 300 "$PY" -m draftsmith.cli bench --device "$DEVICE" --methods none ngram eagle3 --head "$HEAD" --k 5 \
    --concurrency 1 4 16 32 --num-prompts 32 --max-tokens 64 --rounds 1 --baseline-every 0 --threads 4 \
    --out "$RES/bench"
step gpu_demo "$(left)" "$PY" bench/gpu_demo.py --device "$DEVICE" --started-at "$(date +%s)" \
    --budget-s $(($(left) - 20)) --out "$RES/gpu_demo"
tar czf "$OUTDIR/gpu_checks.tar.gz" -C "$RES" .
cp "$RES"/*.log "$OUTDIR"/ 2>/dev/null
echo "== done in $(($(date +%s) - T0)) s; results in $OUTDIR/gpu_checks.tar.gz"
