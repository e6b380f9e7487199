#!/usr/bin/env bash
# README command 1 on a fresh machine: set up .venv, train the tiny BST (configs/train/tiny.yaml) on the embedded
# books, evaluate it at two lengths, generate a sample, save/export the model, and print where everything went.
# Extra arguments go to the trainer, e.g.  bash scripts/main_job.sh --max_steps 50 [--output_dir outputs/x]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
# torch first and pinned: a looser spec would pull a multi-GB CUDA build. pip shows what it fetches (without -q: a
# fresh machine's install took 78 s with nothing on screen).
if ! python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    echo "== 0/4 install torch 2.13.0 (CPU) into .venv"
    pip install --progress-bar on torch==2.13.0
fi
if ! python -c "import modeling_bst, training, accelerate, datasets, tokenizers, matplotlib" 2>/dev/null; then
    echo "== 0/4 install this package with the train extra into .venv"
    pip install --progress-bar on -e ".[train]"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# --output_dir (if given) moves every step's outputs; the other arguments go to the trainer.
OUT=outputs/tiny
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --output_dir) OUT="$2"; shift 2 ;;
        --output_dir=*) OUT="${1#*=}"; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
start=$(date +%s)
echo "== 1/4 train configs/train/tiny.yaml -> $OUT"
python -m training.train --config configs/train/tiny.yaml --output_dir "$OUT" ${ARGS[@]+"${ARGS[@]}"}
echo "== 2/4 evaluate on the held-out book (Northanger Abbey, first 32k tokens) at L = 512 and 4096"
python -m training.evaluate --model "$OUT/final" --lengths 512 4096 --dataset embedded --split validation \
    --max_tokens_per_doc 32768 --output "$OUT/eval.json" --plot "$OUT/eval.png"
echo "== 3/4 generate a sample"
python - "$OUT" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_bst  # noqa: F401

out = sys.argv[1]
tok = AutoTokenizer.from_pretrained(f"{out}/final")
model = AutoModelForCausalLM.from_pretrained(f"{out}/final").eval()
prompt = "It is a truth universally acknowledged, that"
ids = tok(prompt, return_tensors="pt")["input_ids"]  # <s> first, as every training document
torch.manual_seed(0)
gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, do_sample=True, top_p=0.9,
                     pad_token_id=tok.pad_token_id)
text = tok.decode(gen[0, 1:], skip_special_tokens=True)
open(f"{out}/sample.txt", "w").write(text + "\n")
print(text)
PY
echo "== 4/4 save / export"
if [ -f training/export.py ]; then
    python -m training.export --model "$OUT/final" --out "$OUT/hub" --eval_json "$OUT/eval.json" --dataset embedded
    EXPORT="$OUT/hub (Hub-ready folder)"
else
    EXPORT="$OUT/final (save_pretrained folder; training/export.py not present)"
fi
python - "$OUT" <<'PY'
import json
import sys

out = sys.argv[1]
s = json.load(open(f"{out}/train_summary.json"))
e = json.load(open(f"{out}/eval.json"))
losses = s["losses"]
trend = f"first {losses[0]:.3f} -> last {losses[-1]:.3f}" if losses else "none logged (fewer steps than logging_steps)"
print(f"train: {len(losses)} logged losses, {trend}; "
      f"eval_loss {s['metrics'].get('eval_loss', float('nan')):.3f}; {s['wall_seconds']:.0f} s")
for r in e["models"][0]["results"]:
    if "ppl_token" in r:
        print(f"eval L={r['length']:>5}: token ppl {r['ppl_token']:.2f}, bits/byte {r['bits_per_byte']:.3f}")
PY
cat <<MSG

Done in $(( $(date +%s) - start )) s. Everything is under $OUT/:
  model + tokenizer : $OUT/final   (AutoModelForCausalLM / AutoTokenizer.from_pretrained("$OUT/final") after
                      "import modeling_bst", or with trust_remote_code=True)
  checkpoints       : $OUT/checkpoint-*   (resume: --resume_from_checkpoint true)
  training log      : $OUT/log_history.json, $OUT/train_summary.json
  evaluation        : $OUT/eval.json, plot $OUT/eval.png
  sample            : $OUT/sample.txt
  export            : $EXPORT
MSG
