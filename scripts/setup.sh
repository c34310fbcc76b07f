#!/usr/bin/env bash
# Set up a virtual environment in .venv with ulysses_cp and its dependencies.
# Works on a fresh machine with only Python and pip. On a CPU-only machine it installs
# the CPU build of torch 2.13.0; if .venv already has a torch (e.g. a CUDA build you
# installed yourself), it is kept. DeepSpeed is installed without pre-built ops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  .venv/bin/python -m pip install -q torch==2.13.0
fi
echo "setup: installing ulysses_cp[dev] (deepspeed with DS_BUILD_OPS=0, einops, wandb, transformers, datasets, pyarrow, accelerate, trl, peft, pytest, ruff, mypy, mkdocs)"
# the torch in .venv stays as it is (accelerate, peft and trl accept any torch >= 2)
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
.venv/bin/python -c 'import torch; print("torch==" + torch.__version__)' > "$TORCH_PIN"
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -c "$TORCH_PIN" -e ".[dev]"
echo "setup: done ($(.venv/bin/python -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1))"
