#!/usr/bin/env bash
# The GPU suite (issue #15): the `gpu` tests and the GPU benchmarks (Fig. 3 layer speed, training tokens/s and MFU
# against HF Llama, decode ms/token with CUDA graphs) on one NVIDIA GPU, within 10 minutes on an H100; writes
# OUTDIR/gpu_suite.json, OUTDIR/gpu_suite.md and one log per part. See benchmarks/gpu_suite.py.
#
#   bash benchmarks/gpu_suite.sh OUTDIR               # on a machine with one NVIDIA GPU
#   bash benchmarks/gpu_suite.sh OUTDIR --dry-run     # every part with tiny sizes on the CPU
#   bash benchmarks/gpu_suite.sh OUTDIR --budget train=300 --parts tests train
#
# Uses .venv when present; otherwise the current python if it has torch, transformers and this package's
# dependencies; otherwise creates .venv with scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    . .venv/bin/activate
elif ! python3 -c "import torch, transformers, pytest" 2>/dev/null; then
    bash scripts/setup.sh
    . .venv/bin/activate
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 -m benchmarks.gpu_suite "$@"
