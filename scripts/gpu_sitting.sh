#!/usr/bin/env bash
# One time-limited GPU sitting of the accelerator protocol (issue #13) and the GPU suite (issue #15), as run on an
# H200 on 2026-11-26: a pair of LM runs side by side on the GPU while the `gpu` tests run, then GPU benchmarks in
# whatever time is left, everything packed into one archive. Made for machines lent for a few minutes, with their own
# PyTorch and no network (the workplace's device tool; see docs/results.md, "Reading of the accelerator run").
#
# Here, once (network: PyPI), to prepare what travels with the tree:
#   bash scripts/gpu_sitting.sh --prepare
#     wheels of this package's pinned transformers and of datasets (and the two packages datasets needs that such an
#     image may lack) into .whl/, and the `allbooks` corpus and tokenizer into runs/lm_quality/{data,tokenizers}.
#     Send .whl, runs/lm_quality/data and runs/lm_quality/tokenizers along (ignored paths, ~40 MB).
# There:
#   bash scripts/gpu_sitting.sh [--models "slide bst-sh-s4"] [--seeds "1"] [--deadline 480] [--bench "train"]
#     --models/--seeds: the LM runs (two at a time; a finished run's record is skipped); --deadline: seconds for
#     them (an unfinished run is lost: its checkpoints are too large to bring back); --bench: gpu_suite parts run after
#     them in the time left of --total (default 545 s). Each finished model's per-token losses on the held-out books
#     (research/token_losses.py, at L and 16L) come back as token_losses.tgz. Results: $OUT/results.tgz (records,
#     report, logs, suite), or
#     gpu_sitting/results.tgz in the repository without $OUT. Set BST_SOURCE_COMMIT to the commit the tree was sent
#     from. --dry-run: the same sitting on the CPU with the scripts' own dry runs (tiny sizes, a temporary folder).
#   bash scripts/gpu_sitting.sh --mqar 8
#     instead of the LM runs and benchmarks: the GPU MQAR grid (research/gpu_quality.sh --mqar, 13 runs at a time)
#     for 8 minutes beside the `gpu` tests. Runs stopped at the deadline keep their state in
#     research/results/mqar_gpu/*.ckpt.safetensors; they come back as mqar_ckpt.tgz.part-NN (split below the device
#     tool's 16 MiB per file; here: `cat mqar_ckpt.tgz.part-* | tar xzf -` in the repository), the records, report and
#     plot inside results.tgz. Commit both: the next sitting's same command continues every stopped run exactly.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
models="slide bst-sh-s4" seeds="0" deadline=480 total=545 bench="layer_speed decode train" prepare=0 dry=() mqar=""
while [ $# -gt 0 ]; do
    case "$1" in
        --models) models="$2"; shift 2 ;;
        --seeds) seeds="$2"; shift 2 ;;
        --deadline) deadline="$2"; shift 2 ;;
        --total) total="$2"; shift 2 ;;
        --bench) bench="$2"; shift 2 ;;
        --prepare) prepare=1; shift ;;
        --mqar) mqar="$2"; shift 2 ;;
        --dry-run) dry=(--dry-run); shift ;;
        *) echo "gpu_sitting.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ "$prepare" = 1 ]; then
    set -e
    [ -x .venv/bin/python ] || bash scripts/setup.sh
    . .venv/bin/activate
    mkdir -p .whl
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        $(python -c 'from importlib.metadata import version as v
print(*(f"{n}=={v(n)}" for n in ("transformers", "datasets", "dill", "multiprocess", "mambapy")))')
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m research.lm_quality prepare --corpora allbooks
    git check-ignore -q .whl || echo "note: .whl is not ignored; add /.whl/ to .git/info/exclude" >&2
    ls -la .whl
    exit 0
fi

if [ -n "$mqar" ] && ! [[ "$mqar" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_sitting.sh: --mqar takes whole minutes (the MQAR runs' deadline), got '$mqar'" >&2
    exit 2
fi
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
out="${OUT:-$REPO/gpu_sitting}"
mkdir -p "$out"
rm -rf /tmp/gpu_sitting_tests /tmp/gpu_sitting_bench  # an earlier sitting's suite output
if [ ${#dry[@]} -eq 0 ] && ls .whl/*.whl >/dev/null 2>&1; then  # the device's python; not for a dry run here
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 3
    export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
pack() {
    cd "$REPO" || return
    tar czf "$out/results.tgz" --exclude='checkpoint-*' --exclude='final' --exclude='*.safetensors' \
        research/results/lm_long_gpu docs/results/lm_long_gpu.png research/results/mqar_gpu docs/results/mqar_gpu.png \
        docs/results.md runs/lm_quality/logs runs/lm_quality/long-gpu /tmp/gpu_sitting_tests /tmp/gpu_sitting_bench \
        2>/dev/null
    [ -d runs/lm_quality/token_losses ] && tar czf "$out/token_losses.tgz" runs/lm_quality/token_losses
    # MQAR runs stopped at their deadline: their checkpoints, in parts below the 16 MiB a returned file may have
    local ckpts=(research/results/mqar_gpu/*.ckpt.safetensors)
    if [ -e "${ckpts[0]}" ]; then
        tar czf - "${ckpts[@]}" | split -b 15M -d - "$out/mqar_ckpt.tgz.part-"
    fi
    ls -la "$out"
}
trap pack EXIT
{
    nvidia-smi -L
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    echo "source commit: ${BST_SOURCE_COMMIT:-unset}"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# timeout runs its command in a process group of its own (its pid) and signals that group at the deadline; what the
# deadline leaves behind is killed through the same group below, nothing else on the machine.
if [ -n "$mqar" ]; then
    # the runs stop themselves at --deadline-minutes (saving their state); timeout is the backstop
    timeout $(( mqar * 60 + 120 )) bash research/gpu_quality.sh --mqar "${dry[@]}" --deadline-minutes "$mqar" \
        > "$out/mqar.log" 2>&1 &
else
    # shellcheck disable=SC2086  # models and seeds are word lists
    timeout "$deadline" bash research/gpu_quality.sh "${dry[@]}" --models $models --seeds $seeds --jobs 2 --threads 6 \
        > "$out/lm.log" 2>&1 &
fi
lm=$!
timeout 200 bash benchmarks/gpu_suite.sh /tmp/gpu_sitting_tests "${dry[@]}" --parts tests --budget tests=170 \
    > "$out/tests.log" 2>&1
echo "tests done at $(elapsed) s"
wait $lm
rc=$?
kill -- "-$lm" 2>/dev/null && sleep 2
if [ -n "$mqar" ]; then
    echo "mqar rc $rc at $(elapsed) s" >> "$out/mqar.log"
    tail -5 "$out/mqar.log"
    echo "sitting done at $(elapsed) s"
    exit 0
fi
echo "lm rc $rc at $(elapsed) s" >> "$out/lm.log"
echo "lm done at $(elapsed) s"
# Every held-out token's loss under each finished model, at the training length and 16x (research/token_losses.py;
# ~0.5 MB a book, where the models themselves are too large to bring back).
# Each dump gets at most 120 s and never more than what --total leaves (less 15 s to pack the results): a sitting
# killed from outside brings nothing back.
for final in runs/lm_quality/long-gpu/allbooks/*/final; do
    [ -d "$final" ] || continue
    name=$(basename "$(dirname "$final")")
    room=$(( total - $(elapsed) - 15 ))
    [ "$room" -gt 120 ] && room=120
    [ "$room" -ge 20 ] || { echo "no time left for token losses of $name" >> "$out/lm.log"; continue; }
    timeout "$room" python3 -m research.token_losses dump "$final" --corpus allbooks --length 1024 16384 --device cuda \
        --out "runs/lm_quality/token_losses/$name-L{length}.safetensors" >> "$out/lm.log" 2>&1
done
echo "token losses done at $(elapsed) s"
tail -5 "$out/lm.log"
left=$(( total - $(elapsed) ))
if [ -n "$bench" ] && [ "$left" -ge 60 ]; then
    read -r -a parts <<< "$bench"
    each=$(( (left - 20) / ${#parts[@]} ))
    budgets=()
    for part in "${parts[@]}"; do budgets+=(--budget "$part=$each"); done
    timeout "$left" bash benchmarks/gpu_suite.sh /tmp/gpu_sitting_bench "${dry[@]}" --parts "${parts[@]}" "${budgets[@]}" \
        > "$out/bench.log" 2>&1
fi
echo "sitting done at $(elapsed) s"
