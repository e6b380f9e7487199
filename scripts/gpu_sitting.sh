#!/usr/bin/env bash
# One time-limited GPU sitting (issue #35, item 3): on one H100 or H200, within ~12 minutes of device time, in this
# order, each part under its own timeout and only if it fits in the time left:
#   (a) train        first (issue #44): BST:SH:S4, Slide and HF Llama trained in one process per row, most important
#                    rows first: 60m L = 4k batch 1 eager and compiled (torch.compile), then L = 16k, then batch 8,
#                    then 200m; bf16 autocast, fused AdamW; tokens/s, MFU, GPU busy fraction and kernels per step
#                    (a short torch.profiler run); the rows that do not fit the budget (240 s) are skipped and
#                    recorded; then a few steps of BST and Llama under torch.profiler (top ops in the report, the
#                    profiler's tables in train/train_profile_<kind>.txt; --no-profile)
#   (b) tests        the `gpu` tests (benchmarks/gpu_suite.sh --parts tests)
#   (c) decode       decode ms/token at 1k..64k, batch 1 and batched, eager and with CUDA graphs
#                    (torch.compile reduce-overhead; `cudagraph_skips` must be 0) against compiled Llama StaticCache
#   (d) quality:M-sS the accelerator LM protocol's next runs (research/gpu_quality.sh), two models at a time
#                    sharing the GPU (~7-8 minutes a pair): BST:MF:S4 with independent filters, BRecT, Transformer-XL,
#                    GSS-Hybrid (Slide and BST:SH:S4 seeds 0-2 are in research/results/lm_long_gpu already)
#   (e) layer_speed  paper Fig. 3 layer speed (the layer contenders of benchmarks/gpu_suite.py)
# Resumable: the parts finished in earlier sittings are listed in docs/results/gpu_sitting_state.txt (committed; one
# line per part: name, UTC time, source commit, device, note); this sitting skips them and starts where the last one
# stopped. A part that does not fit waits for the next sitting. Results are written under $OUT as they come (one
# folder per part; a sitting stopped from outside still brings back what its finished parts wrote):
#   $OUT/plan.txt, env.txt, sitting.log; $OUT/<part>/ (gpu_suite.json/.md, logs, partial rows); $OUT/quality-*.log;
#   $OUT/gpu_sitting_state.txt: the state file with this sitting's finished parts added; $OUT/results.tgz at the end
#   (the LM records, report and logs) and $OUT/parts.tgz (the parts' folders and logs, which then leave $OUT: the
#   device tool brings back 8 files at most). Here, after the sitting: copy $OUT/gpu_sitting_state.txt over
#   docs/results/gpu_sitting_state.txt, unpack results.tgz in the repository, the parts' reports from parts.tgz into
#   docs/results/gpu_<card>/, and commit them.
#
#   bash scripts/gpu_sitting.sh --prepare     here, once (network: PyPI): wheels of this package's pinned transformers
#       and of datasets (and what datasets needs that such an image may lack) into .whl/, and the `allbooks` corpus
#       and tokenizer into runs/lm_quality/{data,tokenizers}. Send .whl, runs/lm_quality/data and
#       runs/lm_quality/tokenizers along (ignored paths, ~40 MB).
#   bash scripts/gpu_sitting.sh [--total 660] [--parts "train tests decode quality layer_speed"]
#       [--models "bst-mf-s4-indep brect-fixed-skip trsf-xl gss-hybrid"] [--seeds 0] [--deadline 480]
#       [--redo "decode"] [--no-profile]     there: the sitting. --total: seconds for all of it (the device tool's
#       machine start is not in it); --deadline: seconds a quality pair may take (a run unfinished then is lost: its
#       checkpoints are too large to bring back); --redo: parts to run again although the state file lists them.
#       Set BST_SOURCE_COMMIT to the commit the tree was sent from (it goes into the state lines).
#   bash scripts/gpu_sitting.sh --plan        print the plan (what runs, in which order, with which budget, what is
#       done already and what waits) and exit; needs neither a GPU nor torch.
#   bash scripts/gpu_sitting.sh --dry-run     the plan, then the same sitting on the CPU with every part's own dry run
#       (tiny sizes); the state goes to $OUT only (the repository's state file is read, never written).
#   bash scripts/gpu_sitting.sh --mqar 8      instead: the GPU MQAR grid (research/gpu_quality.sh --mqar) for 8
#       minutes beside the `gpu` tests. Runs stopped at the deadline keep their state in
#       research/results/mqar_gpu/*.ckpt.safetensors; they come back as mqar_ckpt.tgz.part-NN (split below the device
#       tool's 16 MiB per file; here: `cat mqar_ckpt.tgz.part-* | tar xzf -` in the repository), the records, report
#       and plot inside results.tgz. Commit both: the next sitting's same command continues every stopped run.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
STATE="docs/results/gpu_sitting_state.txt"
ALL_PARTS="train tests decode quality layer_speed"
parts="$ALL_PARTS" models="bst-mf-s4-indep brect-fixed-skip trsf-xl gss-hybrid" seeds="0" deadline=480 total=660
redo="" profile=(--profile) prepare=0 plan_only=0 dry=() mqar=""
while [ $# -gt 0 ]; do
    case "$1" in
        --parts) parts="$2"; shift 2 ;;
        --models) models="$2"; shift 2 ;;
        --seeds) seeds="$2"; shift 2 ;;
        --deadline) deadline="$2"; shift 2 ;;
        --total) total="$2"; shift 2 ;;
        --redo) redo="$2"; shift 2 ;;
        --state) STATE="$2"; shift 2 ;;
        --no-profile) profile=(); shift ;;
        --prepare) prepare=1; shift ;;
        --plan) plan_only=1; shift ;;
        --mqar) mqar="$2"; shift 2 ;;
        --dry-run) dry=(--dry-run); shift ;;
        *) echo "gpu_sitting.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
for n in "$total" "$deadline"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_sitting.sh: --total and --deadline take whole seconds, got '$n'" >&2; exit 2; }
done
for p in $parts; do
    [[ " $ALL_PARTS " == *" $p "* ]] || { echo "gpu_sitting.sh: --parts: '$p' is not one of: $ALL_PARTS" >&2; exit 2; }
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
left() { echo $(( total - $(elapsed) )); }
out="${OUT:-$REPO/gpu_sitting}"
[ "$plan_only" = 1 ] && out=$(mktemp -d)  # --plan writes nothing where results go
mkdir -p "$out"
STATE_OUT="$out/gpu_sitting_state.txt"
# The state this sitting starts from: the committed file, or what an earlier call with the same $OUT wrote.
if [ ! -s "$STATE_OUT" ]; then
    if [ -f "$STATE" ]; then cp "$STATE" "$STATE_OUT"; else printf '# part\tutc\tcommit\tdevice\tnote\n' > "$STATE_OUT"; fi
fi
commit="${BST_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

# -- the plan ------------------------------------------------------------------------------------------------------------
# Budgets (seconds of the part itself; gpu_suite parts get GRACE = 20 s more before they are killed, plus start-up) and
# the least time left for which a part is started at all.
declare -A BUDGET=([train]=240 [tests]=120 [decode]=170 [layer_speed]=120)
declare -A NEED=([train]=150 [tests]=60 [decode]=100 [layer_speed]=60)
units=()  # the plan's units in order: train tests decode quality:<model>-s<seed>... layer_speed
for p in $ALL_PARTS; do
    [[ " $parts " == *" $p "* ]] || continue
    if [ "$p" = quality ]; then
        for s in $seeds; do for m in $models; do units+=("quality:$m-s$s"); done; done
    else
        units+=("$p")
    fi
done
is_done() {  # listed in the state file (and not to be redone)
    local unit=$1 base=${1%%:*}
    [[ " $redo " == *" $unit "* || " $redo " == *" $base "* ]] && return 1
    cut -f1 "$STATE_OUT" | grep -qxF -- "$unit"
}
mark_done() {  # unit, note
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$(date -u +%Y-%m-%dT%H:%MZ)" "$commit" "${device:-unknown}" "$2" >> "$STATE_OUT"
}
todo=()
for u in "${units[@]}"; do is_done "$u" || todo+=("$u"); done
print_plan() {
    echo "gpu_sitting plan: $total s in all, parts in this order (state: $STATE -> $STATE_OUT)"
    local t=0 u
    for u in "${units[@]}"; do
        if is_done "$u"; then
            echo "  $u: done already ($(grep -P "^\Q$u\E\t" "$STATE_OUT" | tail -1 | cut -f2-3 | tr '\t' ' '))"
        elif [[ "$u" == quality:* ]]; then
            echo "  $u: to run (a pair shares the GPU: --deadline $deadline s for the pair)"
        else
            echo "  $u: to run (budget ${BUDGET[$u]} s, started if >= ${NEED[$u]} s are left)"
        fi
    done
    # What this sitting should get through, if every part takes its whole budget:
    local fits=() waits=() pending=() i=0
    for u in "${todo[@]}"; do
        if [[ "$u" == quality:* ]]; then pending+=("$u"); continue; fi
        if [ "$u" = layer_speed ] && [ ${#pending[@]} -gt 0 ]; then
            # the quality pairs that fit come first
            while [ $i -lt ${#pending[@]} ] && [ $(( total - t - 15 )) -ge $(( deadline + 30 )) ]; do
                fits+=("${pending[@]:$i:2}"); t=$(( t + deadline + 30 )); i=$(( i + 2 ))
            done
        fi
        if [ $(( total - t - 15 )) -ge "${NEED[$u]}" ]; then
            fits+=("$u"); t=$(( t + BUDGET[$u] + 30 ))
        else
            waits+=("$u")
        fi
    done
    while [ $i -lt ${#pending[@]} ]; do
        if [ $(( total - t - 15 )) -ge $(( deadline + 30 )) ]; then
            fits+=("${pending[@]:$i:2}"); t=$(( t + deadline + 30 ))
        else
            waits+=("${pending[@]:$i:2}")
        fi
        i=$(( i + 2 ))
    done
    echo "  expected this sitting (every part using its whole budget): ${fits[*]:-nothing}"
    echo "  expected to wait for the next sitting: ${waits[*]:-nothing}"
}
if [ "$plan_only" = 1 ]; then
    print_plan
    rm -rf "$out"
    exit 0
fi
[ -z "$mqar" ] && print_plan | tee "$out/plan.txt"

rm -rf /tmp/gpu_sitting_tests /tmp/gpu_sitting_bench  # an earlier sitting's suite output (older versions)
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
        docs/results.md runs/lm_quality/logs runs/lm_quality/long-gpu "$out/tests" 2>/dev/null
    [ -d runs/lm_quality/token_losses ] && tar czf "$out/token_losses.tgz" runs/lm_quality/token_losses
    # The device tool brings back at most 8 files, two folders down: the parts' folders and logs go back as one
    # archive, parts.tgz (unpack it anywhere: its paths are the parts' names); on a real sitting they leave $OUT so
    # that the few top-level files are all that is there. A dry run keeps them in place too.
    local extra=() f
    for f in "$out"/*; do
        case "${f##*/}" in
            plan.txt|env.txt|sitting.log|gpu_sitting_state.txt|results.tgz|token_losses.tgz|parts.tgz|mqar_ckpt.tgz.part-*) ;;
            *) extra+=("${f##*/}") ;;
        esac
    done
    if [ ${#extra[@]} -gt 0 ]; then
        tar czf "$out/parts.tgz" -C "$out" "${extra[@]}"
        [ ${#dry[@]} -eq 0 ] && (cd "$out" && rm -rf -- "${extra[@]}")
    fi
    # MQAR runs stopped at their deadline (an --mqar sitting): their checkpoints, in parts below the 16 MiB a
    # returned file may have
    local ckpts=(research/results/mqar_gpu/*.ckpt.safetensors)
    if [ -n "$mqar" ] && [ -e "${ckpts[0]}" ]; then
        tar czf - "${ckpts[@]}" | split -b 15M -d - "$out/mqar_ckpt.tgz.part-"
    fi
    echo "sitting done at $(elapsed) s; state: $STATE_OUT"
    ls -la "$out"
}
trap pack EXIT
{
    nvidia-smi -L
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    echo "source commit: $commit"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if [ ${#dry[@]} -gt 0 ]; then
    device="cpu (dry run)"
else
    device=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>/dev/null | tr '\t' ' ')
fi

if [ -n "$mqar" ]; then
    # the runs stop themselves at --deadline-minutes (saving their state); timeout is the backstop. timeout runs its
    # command in a process group of its own (its pid): what the deadline leaves behind is killed through that group,
    # nothing else on the machine.
    timeout $(( mqar * 60 + 120 )) bash research/gpu_quality.sh --mqar "${dry[@]}" --deadline-minutes "$mqar" \
        > "$out/mqar.log" 2>&1 &
    lm=$!
    timeout 200 bash benchmarks/gpu_suite.sh "$out/tests" "${dry[@]}" --parts tests --budget tests=170 \
        > "$out/tests.log" 2>&1
    echo "tests done at $(elapsed) s"
    wait $lm
    rc=$?
    kill -- "-$lm" 2>/dev/null && sleep 2
    echo "mqar rc $rc at $(elapsed) s" >> "$out/mqar.log"
    tail -5 "$out/mqar.log"
    exit 0
fi

# -- the parts -------------------------------------------------------------------------------------------------------------
suite_part() {  # (a) (b) (c) (e): one gpu_suite part in $out/<part>, finished if its status is ok and it completed
    local part=$1 room budget note
    room=$(( $(left) - 15 ))
    if [ "$room" -lt "${NEED[$part]}" ]; then
        echo "[$(elapsed) s] $part: waits for the next sitting ($room s left, needs ${NEED[$part]})" | tee -a "$out/sitting.log"
        return
    fi
    budget=${BUDGET[$part]}
    [ $(( budget + 45 )) -gt "$room" ] && budget=$(( room - 45 ))
    [ "$budget" -ge 20 ] || budget=20
    echo "[$(elapsed) s] $part: start, budget $budget s" | tee -a "$out/sitting.log"
    local extra=()
    [ "$part" = train ] && extra=("${profile[@]}")
    timeout "$room" bash benchmarks/gpu_suite.sh "$out/$part" "${dry[@]}" --parts "$part" --budget "$part=$budget" \
        "${extra[@]}" > "$out/$part.log" 2>&1
    local rc=$?
    note=$(python3 - "$out/$part/gpu_suite.json" "$part" <<'EOF'
import json, sys
try:
    entry = json.load(open(sys.argv[1]))["parts"][sys.argv[2]]
except (OSError, ValueError, KeyError):
    print("no report")
    raise SystemExit
data = entry.get("data") or {}
if entry["status"] != "ok":
    print(entry["status"])
elif sys.argv[2] == "tests":
    bad = data.get("failures", 1) + data.get("errors", 1)
    print("done" if "tests" in data and bad == 0 else f"{bad} failed/errors")
elif data.get("complete"):
    compiled = data.get("compiled", {})
    skips = sum(r.get("cudagraph_skips", 0) for r in compiled.values())
    extra = f"; cudagraph_skips {skips}" if compiled else ""
    print(f"done; {len(data.get('skipped', []))} skipped, {len(data.get('errors', []))} errors{extra}")
else:
    print("incomplete")
EOF
)
    echo "[$(elapsed) s] $part: rc $rc, $note" | tee -a "$out/sitting.log"
    [[ "$note" == done* ]] && mark_done "$part" "${note#done; }"
}

quality_pair() {  # (d): two runs side by side on the GPU; a run is finished when its record exists
    local a=$1 b=${2:-} room names=() seeds_of=() u log
    room=$(( $(left) - 15 ))
    if [ "$room" -lt $(( deadline + 30 )) ]; then
        echo "[$(elapsed) s] $a ${b}: wait for the next sitting ($room s left, a pair needs $(( deadline + 30 )))" | tee -a "$out/sitting.log"
        return
    fi
    for u in $a $b; do
        u=${u#quality:}
        names+=("${u%-s*}")
        seeds_of+=("${u##*-s}")
    done
    log="$out/quality-${names[*]// /+}.log"
    log="${log// /+}"
    echo "[$(elapsed) s] $a ${b}: start, deadline $deadline s" | tee -a "$out/sitting.log"
    # One call per seed set (the usual case: both seed 0). timeout's own process group holds the runs: the deadline
    # kills them and nothing else on the machine.
    if [ "${seeds_of[0]}" = "${seeds_of[-1]}" ]; then
        timeout "$deadline" bash research/gpu_quality.sh "${dry[@]}" --models "${names[@]}" --seeds "${seeds_of[0]}" \
            --jobs 2 --threads 6 > "$log" 2>&1
    else
        timeout "$deadline" bash research/gpu_quality.sh "${dry[@]}" --models "${names[0]}" --seeds "${seeds_of[0]}" \
            --jobs 1 --threads 6 > "$log" 2>&1 &
        local first=$!
        timeout "$deadline" bash research/gpu_quality.sh "${dry[@]}" --models "${names[1]}" --seeds "${seeds_of[1]}" \
            --jobs 1 --threads 6 > "$log.2" 2>&1
        wait "$first"
    fi
    local rc=$?
    echo "[$(elapsed) s] quality rc $rc" | tee -a "$out/sitting.log" "$log" >/dev/null
    for u in $a $b; do
        local run=${u#quality:}
        if [ ${#dry[@]} -gt 0 ]; then  # a dry run's records go to a temporary folder: its log says it completed
            grep -q "dry run complete" "$log" && mark_done "$u" "dry run"
        elif [ -f "research/results/lm_long_gpu/$run.json" ]; then
            mark_done "$u" "record research/results/lm_long_gpu/$run.json"
            mkdir -p "$out/records" && cp "research/results/lm_long_gpu/$run.json" "$out/records/"
            token_losses "$run"
        else
            echo "[$(elapsed) s] $u: no record (stopped at the deadline or failed; see $log)" | tee -a "$out/sitting.log"
        fi
    done
}

token_losses() {  # every held-out token's loss under a finished model, at L and 16L (research/token_losses.py;
    # ~0.5 MB a book, where the model itself is too large to bring back): at most 120 s, only in time left over
    local final="runs/lm_quality/long-gpu/allbooks/$1/final" room
    [ -d "$final" ] || return 0
    room=$(( $(left) - 15 ))
    [ "$room" -gt 120 ] && room=120
    [ "$room" -ge 20 ] || { echo "no time left for token losses of $1" >> "$out/sitting.log"; return 0; }
    timeout "$room" python3 -m research.token_losses dump "$final" --corpus allbooks --length 1024 16384 \
        --device cuda --out "runs/lm_quality/token_losses/$1-L{length}.safetensors" >> "$out/token_losses.log" 2>&1
}

pending=()
for u in "${todo[@]}"; do
    case "$u" in
        quality:*) pending+=("$u") ;;
        layer_speed)  # (d) before (e): the quality pairs that fit first
            while [ ${#pending[@]} -gt 0 ] && [ $(( $(left) - 15 )) -ge $(( deadline + 30 )) ]; do
                quality_pair "${pending[@]:0:2}"
                pending=("${pending[@]:2}")
            done
            suite_part layer_speed ;;
        *) suite_part "$u" ;;
    esac
done
while [ ${#pending[@]} -gt 0 ]; do
    quality_pair "${pending[@]:0:2}"
    pending=("${pending[@]:2}")
done
echo "[$(elapsed) s] finished parts:" | tee -a "$out/sitting.log"
grep -v '^#' "$STATE_OUT" | tee -a "$out/sitting.log"
