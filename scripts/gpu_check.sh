#!/usr/bin/env bash
# One command for a machine with one GPU, torch installed, no network, and perhaps no
# flash-attn or deepspeed: local kernels vs float64, every mode on 4 processes sharing the
# GPU, a few training steps (if deepspeed imports), PyTorch's context_parallel example
# (scripts/cp_example.py, 2 ranks sharing the GPU), and attention against raw SDPA at 8K/32K tokens.
# Results: $OUT/gpu_check.json (OUT defaults to gpu_check_results). Exit 1 if a check failed.
#   bash scripts/gpu_check.sh              # on the GPU machine (about 3-5 minutes)
#   bash scripts/gpu_check.sh --dry-run    # on a CPU: the same code, small, GPU parts skipped
# Missing pure-Python packages (einops, ...) can be installed from carried wheels first:
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
exec timeout 480 "$PY" scripts/gpu_check.py --out "${OUT:-gpu_check_results}" "$@"
