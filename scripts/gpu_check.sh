#!/usr/bin/env bash
# One command for a machine with one GPU, torch installed, no network, and perhaps no
# flash-attn or deepspeed: local kernels vs float64, every mode on 4 processes sharing the
# GPU, a few training steps (if deepspeed imports), PyTorch's context_parallel example
# (scripts/cp_example.py, 2 ranks sharing the GPU), attention against raw SDPA at 8K/32K
# tokens, and transformers / ALST / ulysses_cp training one Llama side by side (model).
# Results: $OUT/gpu_check.json (OUT defaults to gpu_check_results). Exit 1 if a check failed.
#   bash scripts/gpu_check.sh              # on the GPU machine (estimated 7-9 minutes, below)
#   bash scripts/gpu_check.sh --dry-run    # on a CPU: the same code, small, GPU parts skipped
#   bash scripts/gpu_check.sh --only model attention      # some sections
# Estimated seconds on one H200 (not yet measured for this script as a whole): kernels and
# modes 60-120 together, training 60-90, torch_native 20-40, attention 10-20, model 150-240
# (its 4-layer part ~120, the 32-layer part ~60; --model-parts shallow leaves the latter
# out). The whole run stops after GPU_CHECK_TIMEOUT_S (default 570) seconds.
# Missing pure-Python packages can be installed from carried wheels first, e.g. deepspeed
# (a wheel built elsewhere with DS_BUILD_OPS=0) with hjson, pydantic, pydantic-core,
# annotated-types, typing-inspection and typing-extensions, or einops:
#   GPU_CHECK_WHEELS=.whl bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site "$GPU_CHECK_WHEELS"/*.whl || exit 2
  export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
# deepspeed runs the training section and the model section's ALST rows: say where from
"$PY" -c "import deepspeed; print('gpu_check.sh: deepspeed', deepspeed.__version__, \
'imports from', deepspeed.__path__[0])" 2>/dev/null ||
  echo "gpu_check.sh: deepspeed does not import: training and ALST rows will be skipped"
exec timeout "${GPU_CHECK_TIMEOUT_S:-570}" "$PY" scripts/gpu_check.py --out "${OUT:-gpu_check_results}" "$@"
