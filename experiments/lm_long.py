"""The long-run language-modelling comparison (issue #13): every model family on every public-domain book, 10M tokens.

The same recipe as ``experiments.lm_quality`` (``configs/train/quality-cpu.yaml``: D=128, 4 layers, W=64, L=512, so
L/W = 8 as in the paper; 4 x 512 tokens a step, lr 5e-3 cosine) trained for 5,000 steps = 10.24M tokens on the
``allbooks`` corpus (every book in ``../shared/data/books`` and ``more-books``; held-out whole books for test), with
checkpoints every 500 steps that serve both exact resumption and the learning curve (test bits per byte at the
training length against tokens seen). Transformer-XL trains on segments of its window (256 tokens, 8 a step: the
same tokens per step) with the previous segment's cache detached; BRecT streams 512-token segments.

    python -m experiments.lm_quality prepare --corpora allbooks
    python -m experiments.lm_quality long --models slide bst-sh-s4 --seeds 0 1 --jobs 2
    python -m experiments.lm_quality long-report

A run is a folder ``runs/lm_quality/long/allbooks/<model>-s<seed>`` (gitignored; killed runs resume from their last
complete checkpoint when started again) and, once evaluated, a record ``docs/results/lm_long/<model>-s<seed>.json``
(commands, commit, training curve, learning curve, length generalisation) that the report reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments import lm_quality as Q


ROOT = Q.ROOT
CORPUS = "allbooks"
WORK = Q.WORK / "long" / CORPUS
RESULTS = ROOT / "docs" / "results" / "lm_long"
STEPS = 5000  # x 4 x 512 tokens = 10.24M training tokens
SAVE_EVERY = 500
TOKENS_PER_STEP = 4 * 512
LENGTHS = (64, 512, 2048, 8192)  # 1/8x, 1x, 4x, 16x the training length
CURVE_LENGTH = 512
EVAL_TOKENS = 65536  # scored tokens per test book (the same span at every length)
# Transformer-XL: segments of its window (256) with the previous segment's detached cache, 8 a step (same tokens).
SEGMENT_ARGS = {"trsf-xl": ["--seq_len", "256", "--per_device_train_batch_size", "8"]}
LONG_MODELS = ("slide", "bst-sh-s4", "bst-mf-s4", "brect-fixed-skip", "gss-hybrid", "trsf-xl")


def run_dir(model: str, seed: int) -> Path:
    return WORK / f"{model}-s{seed}"


def record_path(model: str, seed: int) -> Path:
    return RESULTS / f"{model}-s{seed}.json"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "modeling_bst", "training", "experiments"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train_command(model: str, seed: int, steps: int, bf16: bool) -> list[str]:
    preset, extra = Q.MODELS[model]
    data = Q.WORK / "data" / CORPUS
    return [
        sys.executable, "-m", "training.train", "--config", str(Q.RECIPE), "--model_config", preset,
        "--tokenizer", str(Q.WORK / "tokenizers" / CORPUS), "--dataset", Q.KIND[CORPUS], "--dataset_path", str(data),
        "--output_dir", str(run_dir(model, seed)), "--seed", str(seed), "--max_steps", str(steps),
        "--save_strategy", "steps", "--save_steps", str(SAVE_EVERY), "--logging_steps", "100",
        "--resume_from_checkpoint", "true", "--bf16", str(bf16).lower(), *extra, *SEGMENT_ARGS.get(model, []),
    ]  # fmt: skip


def eval_command(model: str, seed: int) -> list[str]:
    d = run_dir(model, seed)
    return [
        sys.executable, "-m", "training.evaluate", "--model", str(d / "final"), "--dataset", Q.KIND[CORPUS],
        "--dataset_path", str(Q.WORK / "data" / CORPUS), "--split", "test", "--max_tokens_per_doc", str(EVAL_TOKENS),
        "--lengths", *map(str, LENGTHS), "--output", str(d / "eval.json"),
    ]  # fmt: skip


def learning_curve(model_dir: Path) -> list[dict]:
    """Test bits per byte / token perplexity at the training length of every checkpoint of a run (cached in
    ``curve.json``, so an interrupted evaluation continues)."""
    import torch

    from modeling_bst import BSTForCausalLM
    from training import data as D
    from training.evaluate import evaluate_model
    from training.train import complete_checkpoints

    torch.set_num_threads(1)
    cache_path = model_dir / "curve.json"
    points = {p["step"]: p for p in json.loads(cache_path.read_text())} if cache_path.exists() else {}
    tokenizer = D.load_tokenizer(str(model_dir / "tokenizer"))
    texts = list(D.texts_of(D.load_documents("pg19", "test", path=str(Q.WORK / "data" / CORPUS))))
    for ckpt in complete_checkpoints(str(model_dir)):
        step = int(re.search(r"checkpoint-(\d+)$", ckpt).group(1))
        if step in points:
            continue
        model = BSTForCausalLM.from_pretrained(ckpt)
        row = evaluate_model(model, tokenizer, texts, [CURVE_LENGTH], max_tokens_per_doc=EVAL_TOKENS)[0]
        points[step] = {"step": step, "tokens": step * TOKENS_PER_STEP, **row}
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps([points[k] for k in sorted(points)], indent=1))
        os.replace(tmp, cache_path)
        print(f"{model_dir.name} step {step}: {row['bits_per_byte']:.4f} bpb", flush=True)
    return [points[k] for k in sorted(points)]


def run_long(model: str, seed: int, steps: int = STEPS, bf16: bool = False) -> Path:
    """Train (resuming), evaluate every checkpoint and the final model, write the record; returns its path."""
    out = record_path(model, seed)
    if out.exists():
        return out
    d = run_dir(model, seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    train_cmd, eval_cmd = train_command(model, seed, steps, bf16), eval_command(model, seed)
    curve_cmd = [sys.executable, "-m", "experiments.lm_long", "curve", str(d)]
    log_dir = Q.WORK / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_dir / f"long-{model}-s{seed}.log", "a") as fh:
        todo = []
        if not (d / "train_summary.json").exists():  # a finished run is not resumed (no extra step)
            todo.append(train_cmd)
        todo += [curve_cmd, eval_cmd]
        for cmd in todo:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, check=True)
    report = json.loads((d / "eval.json").read_text())
    history = json.loads((d / "log_history.json").read_text())
    train_losses = [{"step": h["step"], "loss": h["loss"]} for h in history if "loss" in h]
    runtime = [h for h in history if "train_runtime" in h]
    entry = report["models"][0]
    result = {
        "corpus": CORPUS,
        "model": model,
        "label": Q.LABELS[model],
        "preset": Q.MODELS[model][0],
        "seed": seed,
        "steps": steps,
        "tokens": steps * TOKENS_PER_STEP,
        "bf16": bf16,
        "commit": _commit(),
        "parameters": entry["parameters"],
        "vocab_size": entry["vocab_size"],
        "train_loss": train_losses,
        "final_train_loss": train_losses[-1]["loss"] if train_losses else None,
        "train_runtime_last_leg": runtime[-1]["train_runtime"] if runtime else None,
        "wall_seconds_this_sitting": round(time.time() - t0, 1),
        "commands": [" ".join(c[1:]) for c in (train_cmd, curve_cmd, eval_cmd)],
        "dataset": report["dataset"],
        "learning_curve": json.loads((d / "curve.json").read_text()),
        "results": entry["results"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    return out


def run_all(models, seeds, jobs: int, steps: int, bf16: bool) -> None:
    todo = [(m, s) for s in seeds for m in models if not record_path(m, s).exists()]
    print(f"{len(todo)} long runs to do ({jobs} at a time): {todo}", flush=True)

    def work(item):
        m, s = item
        t0 = time.time()
        try:
            run_long(m, s, steps, bf16)
            print(f"done {m} seed {s} in {time.time() - t0:.0f} s", flush=True)
        except subprocess.CalledProcessError as err:
            print(f"FAILED {m} seed {s}: {err} (log in {Q.WORK / 'logs'})", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))


def load_records(results_dir: Path = RESULTS) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]


def _bpb(record: dict, length: int) -> float | None:
    return Q._at(record, length, "bits_per_byte")


def summarise(records: list[dict]) -> dict[str, dict]:
    """Per model: seeds, mean and spread (max - min) of test bits per byte and token perplexity at every length."""
    by_model: dict[str, list[dict]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    out = {}
    for model, rs in by_model.items():
        row = {"seeds": sorted(r["seed"] for r in rs), "parameters": rs[0]["parameters"], "lengths": {}}
        for n in LENGTHS:
            vals = [v for v in (_bpb(r, n) for r in rs) if v is not None]
            ppls = [v for v in (Q._at(r, n, "ppl_token") for r in rs) if v is not None]
            if vals:
                row["lengths"][n] = {
                    "bpb_mean": sum(vals) / len(vals),
                    "bpb_spread": max(vals) - min(vals),
                    "ppl_mean": math.exp(sum(math.log(p) for p in ppls) / len(ppls)),
                }
        row["final_train_loss"] = sum(r["final_train_loss"] for r in rs) / len(rs)
        out[model] = row
    return out


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {}
    for r in sorted(records, key=lambda r: (r["model"], r["seed"])):
        c = colours.setdefault(r["model"], f"C{len(colours)}")
        style = "-" if r["model"].startswith("bst") else "--"
        label = f"{r['label']} s{r['seed']}"
        pts = [(p["tokens"] / 1e6, p["bits_per_byte"]) for p in r["learning_curve"]]
        ax1.plot(*zip(*pts), style, color=c, marker=".", label=label, alpha=1.0 if r["seed"] == 0 else 0.6)
        gen = [(n, _bpb(r, n)) for n in LENGTHS if _bpb(r, n) is not None]
        ax2.plot(*zip(*gen), style, color=c, marker="o", label=label, alpha=1.0 if r["seed"] == 0 else 0.6)
    ax1.set_xlabel("training tokens (millions)")
    ax1.set_ylabel(f"test bits per byte at L={CURVE_LENGTH}")
    ax1.set_title("learning curves (held-out books)")
    lo = min(p["bits_per_byte"] for r in records for p in r["learning_curve"][len(r["learning_curve"]) // 3 :])
    hi = max(p["bits_per_byte"] for r in records for p in r["learning_curve"][len(r["learning_curve"]) // 3 :])
    ax1.set_ylim(lo - 0.02, hi + 0.05)  # the last two thirds of training, where the models separate
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("evaluation length (tokens; trained at 512)")
    ax2.set_ylabel("test bits per byte")
    ax2.set_title("length generalisation (paper Fig. 5)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results_dir: Path = RESULTS, docs: Path | None = ROOT / "docs" / "results.md") -> str:
    """Table-1-style table (mean and spread over seeds), learning curves and length generalisation (one PNG), written
    into the ``lm_long`` section of ``docs`` (None: only returned)."""
    from benchmarks.docs_section import cpu_name, write_section

    records = load_records(results_dir)
    if not records:
        raise SystemExit(f"no records under {results_dir}; run `python -m experiments.lm_quality long` first")
    docs_dir = (docs or ROOT / "docs" / "results.md").parent
    png = docs_dir / "results" / "lm_long.png"
    if docs is not None:
        plot(records, png)
    summary = summarise(records)
    slide = summary.get("slide")
    head = "| Model | Params | seeds | " + " | ".join(f"bpb L={n}" for n in LENGTHS) + " | ppl L=512 | train loss |"
    lines = [head, "|---|---|---|" + "---|" * len(LENGTHS) + "---|---|"]
    order = [m for m in LONG_MODELS if m in summary] + [m for m in summary if m not in LONG_MODELS]
    for model in order:
        row = summary[model]
        cells = []
        for n in LENGTHS:
            x = row["lengths"].get(n)
            if x is None:
                cells.append("–")
                continue
            cell = f"{x['bpb_mean']:.4f}"
            if len(row["seeds"]) > 1:
                cell += f" ±{x['bpb_spread'] / 2:.4f}"
            if slide is not None and model != "slide" and n in slide["lengths"]:
                cell += f" ({100 * (x['bpb_mean'] / slide['lengths'][n]['bpb_mean'] - 1):+.1f}%)"
            cells.append(cell)
        ppl = row["lengths"].get(512, {}).get("ppl_mean")
        lines.append(
            f"| {Q.LABELS[model]} | {row['parameters'] / 1e6:.2f}M | {','.join(map(str, row['seeds']))} | "
            + " | ".join(cells)
            + f" | {'–' if ppl is None else f'{ppl:.1f}'} | {row['final_train_loss']:.3f} |"
        )
    r0 = records[0]
    text = "\n".join(
        [
            f"Every model trained for {r0['steps']} steps of 4 x 512 tokens ({r0['tokens'] / 1e6:.2f}M tokens) on the "
            f"`{CORPUS}` corpus with `configs/train/quality-cpu.yaml`; test: {r0['dataset'].get('documents', '?')} "
            f"held-out books, first {EVAL_TOKENS} tokens of each, scored in windows of L tokens. Machine: "
            f"{cpu_name()}, one thread per run, two runs at a time. ± is half the spread between seeds; percentages "
            "compare the mean bits per byte with Slide's. Records (commands, commit, curves): "
            "`docs/results/lm_long/*.json`; rerun one with `python -m experiments.lm_quality long --models M --seeds S`.",
            "",
            *lines,
            "",
            f"![learning curves and length generalisation]({png.relative_to(docs_dir).as_posix()})",
        ]
    )
    if docs is not None:
        write_section("lm_long", text.split("\n"), docs)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["curve"])
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    learning_curve(Path(args.run_dir))


if __name__ == "__main__":
    main()
