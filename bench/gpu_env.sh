# bench/gpu_env.sh: sourced by bench/gpu_demo.sh and bench/gpu_checks.sh on a CUDA machine without network. Makes
# draftsmith importable from this checkout: the wheels in .whl/ ($DRAFTSMITH_WHEELS; bench/gpu_wheels.sh: only what
# the GPU image lacks or holds in a version draftsmith does not run on) go to $DRAFTSMITH_SITE with pip --no-index
# --no-deps; the package is this checkout's src/ (the src layout needs no install step). Both lead PYTHONPATH.
# Expects ROOT (the checkout) and PY (the python); sets SITE and the offline environment.
SITE=${DRAFTSMITH_SITE:-/tmp/draftsmith-site}
WHEELS=${DRAFTSMITH_WHEELS:-$ROOT/.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
else
    echo "[gpu_env.sh] no .whl/ here: using the installed packages as they are (bash bench/gpu_wheels.sh makes it)"
fi
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}  # a short log: progress bars redraw every 15 s
