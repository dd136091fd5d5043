#!/usr/bin/env bash
# bench/gpu_wheels.sh [DIR]: download (here, where PyPI is reachable) the wheels bench/gpu_demo.sh installs on the
# GPU machine, into DIR (default .whl/, git-ignored); prints each wheel and their total size.
#
# The GPU machine (nvidia-h200: Python 3.12 at /opt/torch/.venv/bin/python3, x86-64, no network) already holds
# torch 2.11+cu130, accelerate 1.15.0, safetensors 0.8.0, tokenizers 0.23.2, huggingface_hub 1.33.0, numpy,
# pyyaml, tqdm, matplotlib, jinja2, regex, typer, httpx, anyio, h11, click, typing-extensions, annotated-doc and
# prometheus-client (the device README's KINDS.md). What is missing there, or there in a version draftsmith
# does not run on, is pinned below to the versions the test suite runs against (one version each: two stop pip):
#   transformers 5.24.0   the image's 5.17.0 has no cache= argument (inference/cache.py passes it; 5.17-5.23 put
#                         it in **kwargs, so the runtime decodes without a KV cache); needs huggingface_hub>=1.31
#   fastapi stack         for the demo's serve check (pipeline.serve_check): fastapi, starlette, pydantic,
#                         pydantic-core (compiled: cp312 manylinux), annotated-types, typing-inspection,
#                         opentelemetry-api (fastapi 0.165 imports it), uvicorn
# datasets is not needed: data_pipeline imports it only for Hub or parquet sources, not reference:train.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
PURE=(transformers==5.24.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 annotated-types==0.8.0
      typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0)
COMPILED=(pydantic-core==2.50.5)
PLATFORMS=(--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl                              # one version of each: nothing left from an earlier pin
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$DEST" "${PURE[@]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]}" -d "$DEST" \
    "${COMPILED[@]}"
if [[ $DEST != /* ]] && ! git check-ignore -q "$DEST/x.whl" 2>/dev/null; then
    echo "/$DEST/" >>"$(git rev-parse --git-path info/exclude)"   # wheels travel with carry, never in a commit
fi
count=$(ls "$DEST"/*.whl | wc -l)
if [[ $count -ne $((${#PURE[@]} + ${#COMPILED[@]})) ]]; then
    echo "gpu_wheels.sh: expected $((${#PURE[@]} + ${#COMPILED[@]})) wheels in $DEST, found $count" >&2
    exit 1
fi
ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "total %.1f MiB in %d wheels\n", $1 / 1048576, '"$count"'}'
