#!/usr/bin/env bash
# The wheels a GPU machine without network needs for scripts/gpu_check.sh, made here (with
# access to the package registry): deepspeed built as pure Python (DS_BUILD_OPS=0) and the
# packages such a machine lacked in the first GPU run (hjson, pydantic and its binary core,
# annotated-types, typing-inspection, typing-extensions, einops), for its Python version.
#   bash scripts/gpu_wheels.sh [OUT] [PYVER]     # default .gpu_wheels, 3.12 (about 5 MB)
# then on the GPU machine, in one call:  GPU_CHECK_WHEELS=OUT bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu_wheels}
PYVER=${2:-3.12}
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
mkdir -p "$OUT"
$PIP download -q --only-binary=:all: --python-version "$PYVER" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$OUT" pydantic hjson einops psutil py-cpuinfo tqdm packaging msgpack
DS_BUILD_OPS=0 $PIP wheel -q --no-deps -w "$OUT" deepspeed==0.19.8
ls -1 "$OUT"
