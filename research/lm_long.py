"""The long-run language-modelling comparison (issue #13): every model family on every public-domain book, 10M tokens.

The same recipe as ``research.lm_quality`` (``configs/train/quality-cpu.yaml``: D=128, 4 layers, W=64, L=512, so
L/W = 8 as in the paper; 4 x 512 tokens a step, lr 5e-3 cosine) trained for 5,000 steps = 10.24M tokens on the
``allbooks`` corpus (every book in ``../shared/data/books`` and ``more-books``; held-out whole books for test), with
checkpoints every 500 steps that serve both exact resumption and the learning curve (test bits per byte at the
training length against tokens seen). Transformer-XL trains on segments of its window (256 tokens, 8 a step: the
same tokens per step) with the previous segment's cache detached; BRecT streams 512-token segments.

    python -m research.lm_quality prepare --corpora allbooks
    python -m research.lm_quality long --models slide bst-sh-s4 --seeds 0 1 --jobs 2
    python -m research.lm_quality long-report
    python -m research.lm_quality long-select   # early stopping + per-book scores for records made before them

A run is a folder ``runs/lm_quality/long/allbooks/<model>-s<seed>`` (gitignored; killed runs resume from their last
complete checkpoint when started again) and, once evaluated, a record ``research/results/lm_long/<model>-s<seed>.json``
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
from dataclasses import dataclass, field
from pathlib import Path

from research import common
from research import lm_common as LM


ROOT = common.ROOT
CORPUS = "allbooks"
# bst-mf-s4-indep is the paper's BST:MF with one change, one SSM per filter (mf_independent_filters=True): at CPU
# scale two of its three seeds beat Slide and the third trailed it (docs/results.md, issue #13); the accelerator
# protocol runs it beside the paper's MF, two seeds, to see whether the gain holds at ~27M parameters.
LONG_MODELS = ("slide", "bst-sh-s4", "bst-mf-s4", "bst-mf-s4-indep", "brect-fixed-skip", "gss-hybrid", "trsf-xl")
LAYER_INDEX_FIELDS = ("bst_layer_indices", "recurrent_layer_indices", "gss_layer_indices")


@dataclass(frozen=True)
class Protocol:
    """One scale of the comparison: the model sizes, the tokens, the evaluation; every model gets the same."""

    name: str
    steps: int
    seq_len: int
    batch: int
    save_every: int
    lengths: tuple[int, ...]  # 1/8x, 1x, 4x, 16x the training length
    eval_tokens: int  # scored tokens per test book (the same span at every length)
    learning_rate: float | None = None  # None: the recipe's
    warmup_steps: int | None = None
    size: dict = field(default_factory=dict)  # config overrides applied to every tiny preset
    layer_stride: int = 1  # layer i of a 4-layer tiny preset becomes layer i * stride
    xl_window: int = 256  # Transformer-XL trains on segments of its window (its block_len)
    description: str = ""
    out: Path | None = None  # somewhere else than the repository's research/results/, docs/ and runs/ (dry runs)
    corpus: str = CORPUS  # "books" (without the Treasury of David): the corpus ablation

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def curve_length(self) -> int:
        return self.seq_len

    @property
    def results(self) -> Path:
        return (self.out if self.out is not None else ROOT) / "research" / "results" / self.section

    @property
    def docs(self) -> Path:
        return self.out / "docs" / "results.md" if self.out is not None else common.DOCS

    @property
    def work(self) -> Path:
        work = self.out / "runs" if self.out is not None else LM.WORK
        return work / ("long" if self.name == "cpu" else f"long-{self.name}") / self.corpus

    @property
    def section(self) -> str:
        name = "lm_long" if self.name == "cpu" else f"lm_long_{self.name}"
        return name if self.corpus == CORPUS else f"{name}_{self.corpus}"

    def model_overrides(self, model: str) -> dict:
        """Config overrides turning the model's tiny preset into this scale's model."""
        if not self.size and model != "trsf-xl":
            return {}
        preset = json.loads((ROOT / "training" / "presets" / f"{LM.MODELS[model][0]}.json").read_text())
        out = dict(self.size)
        n = out.get("num_hidden_layers", preset["num_hidden_layers"])
        for key in LAYER_INDEX_FIELDS:
            if preset.get(key):
                out[key] = [i * self.layer_stride for i in preset[key]]
        if "layer_types" in preset:
            types = ["block"] * n
            for i, kind in enumerate(preset["layer_types"]):
                types[i * self.layer_stride] = kind
            out["layer_types"] = types
        if model == "trsf-xl":
            out["block_len"] = self.xl_window
            out["max_position_embeddings"] = self.xl_window
        return out


# The CPU protocol: the tiny presets (D=128, 4 layers, W=64) at L=512 (L/W = 8 as in the paper), 4 x 512 tokens a
# step, 5,000 steps = 10.24M tokens; its records are research/results/lm_long/*.json.
CPU = Protocol(
    name="cpu",
    steps=5000,
    seq_len=512,
    batch=4,
    save_every=500,
    lengths=(64, 512, 2048, 8192),
    eval_tokens=65536,
    xl_window=256,
    description="tiny presets (D=128, 4 layers, W=64, ~1.1-1.5M parameters), L=512, 4 x 512 tokens a step",
)
# The accelerator protocol (issue #13 part 3): D=512, 8 layers, W=128 (~25-30M parameters with the 4,096-token BPE),
# L=1024 (L/W = 8), 16 x 1024 tokens a step, 2,000 steps = 33M tokens (~5 passes over the 6.3M-token training split),
# bf16; Transformer-XL with a 512-token window. Its records are research/results/lm_long_gpu/*.json.
GPU = Protocol(
    name="gpu",
    steps=2000,
    seq_len=1024,
    batch=16,
    save_every=250,
    lengths=(128, 1024, 4096, 16384),
    eval_tokens=65536,
    learning_rate=1.0e-3,
    warmup_steps=300,
    size={
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2048,
        "block_len": 128,
        "max_position_embeddings": 16384,
    },
    layer_stride=2,
    xl_window=512,
    description="D=512, 8 layers, W=128 (~25-30M parameters), L=1024, 16 x 1024 tokens a step",
)
PROTOCOLS = {"cpu": CPU, "gpu": GPU}
# Kept for readers of the CPU records.
STEPS, SAVE_EVERY, TOKENS_PER_STEP, LENGTHS = CPU.steps, CPU.save_every, CPU.tokens_per_step, CPU.lengths
CURVE_LENGTH, EVAL_TOKENS, RESULTS, WORK = CPU.curve_length, CPU.eval_tokens, CPU.results, CPU.work


def label(model: str, proto: Protocol = CPU) -> str:
    """The model's name in tables, with this protocol's depth (the tiny presets' Slide:4L is Slide:8L at GPU scale)."""
    layers = proto.size.get("num_hidden_layers")
    return LM.LABELS[model].replace(":4L", f":{layers}L") if layers else LM.LABELS[model]


def run_dir(model: str, seed: int, proto: Protocol = CPU) -> Path:
    return proto.work / f"{model}-s{seed}"


def record_path(model: str, seed: int, proto: Protocol = CPU) -> Path:
    return proto.results / f"{model}-s{seed}.json"


def _cpu() -> str:
    from reporting import cpu_name

    return cpu_name()


def train_command(
    model: str, seed: int, steps: int, bf16: bool, proto: Protocol = CPU, device: str | None = None
) -> list[str]:
    preset, extra = LM.MODELS[model]
    extra = list(extra)
    for flag in ("--seq_len", "--per_device_train_batch_size"):  # this protocol sets the segment shape
        if flag in extra:
            i = extra.index(flag)
            del extra[i : i + 2]
    overrides = proto.model_overrides(model)
    if overrides:
        if "--model_overrides" in extra:
            i = extra.index("--model_overrides")
            overrides = {**json.loads(extra[i + 1]), **overrides}
            del extra[i : i + 2]
        extra += ["--model_overrides", json.dumps(overrides)]
    if model == "trsf-xl":  # segments of its window, the same tokens a step
        seq_len, batch = proto.xl_window, proto.tokens_per_step // proto.xl_window
    else:
        seq_len, batch = proto.seq_len, proto.batch
    cmd = [
        sys.executable, "-m", "training.train", "--config", str(LM.RECIPE), "--model_config", preset,
        "--tokenizer", str(LM.WORK / "tokenizers" / proto.corpus), "--dataset", LM.KIND[proto.corpus],
        "--dataset_path", str(LM.WORK / "data" / proto.corpus), "--output_dir", str(run_dir(model, seed, proto)),
        "--seed", str(seed), "--max_steps", str(steps), "--seq_len", str(seq_len),
        "--per_device_train_batch_size", str(batch), "--save_strategy", "steps",
        "--save_steps", str(min(proto.save_every, steps)), "--logging_steps", str(min(100, steps)),
        "--resume_from_checkpoint", "true", "--bf16", str(bf16).lower(), *extra,
    ]  # fmt: skip
    if proto.learning_rate is not None:
        cmd += ["--learning_rate", str(proto.learning_rate)]
    if proto.warmup_steps is not None:
        cmd += ["--warmup_steps", str(min(proto.warmup_steps, steps))]
    if device == "cpu":
        cmd += ["--use_cpu", "true"]
    return cmd


def eval_command(
    model: str,
    seed: int,
    proto: Protocol = CPU,
    device: str | None = None,
    eval_tokens=None,
    checkpoint: Path | None = None,
    output: str = "eval.json",
    run: Path | None = None,
) -> list:
    """Test evaluation at every length of the run's final model (or of ``checkpoint``) into ``<run>/<output>``."""
    d = run or run_dir(model, seed, proto)
    cmd = [
        sys.executable, "-m", "training.evaluate", "--model", str(checkpoint or d / "final"),
        "--dataset", LM.KIND[proto.corpus], "--dataset_path", str(LM.WORK / "data" / proto.corpus), "--split", "test",
        "--max_tokens_per_doc", str(eval_tokens or proto.eval_tokens), "--lengths", *map(str, proto.lengths),
        "--output", str(d / output),
    ]  # fmt: skip
    if device is not None:
        cmd += ["--device", device]
    return cmd


def learning_curve(
    model_dir: Path,
    length: int = CPU.curve_length,
    eval_tokens: int = CPU.eval_tokens,
    device: str = "cpu",
    corpus: str = CORPUS,
    split: str = "test",
) -> list[dict]:
    """Bits per byte / token perplexity on ``split`` at the training length of every checkpoint of a run (cached in
    ``curve.json`` for test, ``curve_<split>.json`` otherwise, so an interrupted evaluation continues)."""
    import torch

    from modeling_bst import BSTForCausalLM
    from training import data as D
    from training.evaluate import evaluate_model
    from training.train import complete_checkpoints

    torch.set_num_threads(1)
    cache_path = model_dir / ("curve.json" if split == "test" else f"curve_{split}.json")
    points = {p["step"]: p for p in json.loads(cache_path.read_text())} if cache_path.exists() else {}
    texts = list(D.texts_of(D.load_documents("pg19", split, path=str(LM.WORK / "data" / corpus))))
    summary = json.loads((model_dir / "train_summary.json").read_text())
    tokens_per_step = summary["seq_len"] * summary["train_batch_size"]
    for ckpt in complete_checkpoints(str(model_dir)):
        step = int(re.search(r"checkpoint-(\d+)$", ckpt).group(1))
        if step in points:
            continue
        tokenizer = D.load_tokenizer(ckpt)  # the Trainer saves it with every checkpoint
        model = BSTForCausalLM.from_pretrained(ckpt).to(device)
        row = evaluate_model(model, tokenizer, texts, [length], max_tokens_per_doc=eval_tokens)[0]
        # row["tokens"] counts the scored test tokens; train_tokens the training tokens seen at this checkpoint
        points[step] = {**row, "step": step, "train_tokens": step * tokens_per_step}
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps([points[k] for k in sorted(points)], indent=1))
        os.replace(tmp, cache_path)
        print(f"{model_dir.name} step {step}: {row['bits_per_byte']:.4f} bpb ({split})", flush=True)
    return [points[k] for k in sorted(points)]


# Checkpoint selection (early stopping) and the held-out books one by one. Each record also scores on test the
# checkpoint with the lowest validation bits per byte (the held-out validation book at the training length, every
# saved checkpoint): the usual early-stopping protocol, chosen without looking at the test books. On the CPU protocol
# every validation curve falls to the end, so it keeps every final model; the accelerator protocol's ~5 passes over
# the data may not. The selected checkpoint is then scored on each held-out book alone (``per_book``): with two test
# books, one of them unlike every training book, the aggregate can hide that one book decides a gap.
VALIDATION_FACTOR = 2  # one validation book scored over twice the tokens of each of the two test books: as many tokens


def validation_tokens(eval_tokens: int) -> int:
    """Scored validation tokens for a test span (per book) of ``eval_tokens``: 131072 at the CPU protocol's 65536,
    the whole of Northanger Abbey (~115k tokens)."""
    return VALIDATION_FACTOR * int(eval_tokens)


def best_checkpoint(curve: list[dict]) -> dict:
    """The point of a validation curve with the lowest bits per byte (the later one on a tie)."""
    if not curve:
        raise ValueError("no complete checkpoint to select from (empty validation curve)")
    return min(curve, key=lambda p: (p["bits_per_byte"], -p["step"]))


def same_model(a: Path, b: Path) -> bool:
    """Whether two saved model folders score alike: the same config (but ``use_cache``, which the training run writes
    as False into checkpoints and True into ``final``, and which the evaluation sets per call) and bit-equal weights.
    False where either folder lacks a readable ``config.json`` or single-file ``model.safetensors``."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def config(folder: Path) -> dict:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("use_cache", None)
        return cfg

    try:
        if config(a) != config(b):
            return False
        wa, wb = (load_file(str(folder / "model.safetensors")) for folder in (a, b))
    except (OSError, ValueError, SafetensorError):
        return False
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def reuse_final_evaluation(run: Path, ckpt: Path, out: Path, eval_tokens: int, lengths, device: str) -> bool:
    """Write ``out`` from the final model's test evaluation (``<run>/eval.json``) when ``ckpt`` is that model (the
    usual case: the last checkpoint is selected) and that evaluation scored the same span at the same lengths on the
    same device; True if it did. Saves scoring the same model twice (~25 s a run on an H200, minutes on a CPU thread)."""
    final_eval = run / "eval.json"
    if not final_eval.exists() or not same_model(ckpt, run / "final"):
        return False
    report = json.loads(final_eval.read_text())
    entry = report["models"][0]
    settings = report.get("settings", {})
    if (report["dataset"].get("max_tokens_per_doc"), settings.get("lengths"), settings.get("device")) != (
        eval_tokens,
        list(lengths),
        device,
    ):
        return False
    entry["path"] = str(ckpt)
    report["reused"] = f"{final_eval.name}: {ckpt.name} has the final model's config and weights"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    return True


def select_checkpoint(
    model: str,
    seed: int,
    proto: Protocol = CPU,
    device: str = "cpu",
    eval_tokens: int | None = None,
    run: Path | None = None,
    env: dict | None = None,
    log=None,
) -> dict:
    """Validation curve of every checkpoint, then the test evaluation (every length) of the best one and its scores
    book by book; returns the record fields ``validation_curve``, ``selected_step``, ``selected_results``,
    ``per_book``, ``selection_commands`` and ``selection_commit``. Each step is cached in the run folder."""
    d = run or run_dir(model, seed, proto)
    n_val = validation_tokens(eval_tokens or proto.eval_tokens)
    curve_cmd = [sys.executable, "-m", "research.lm_long", "curve", str(d), "--split", "validation",
                 "--length", str(proto.curve_length), "--eval_tokens", str(n_val), "--device", device,
                 "--corpus", proto.corpus]  # fmt: skip

    def call(cmd):
        if log is not None:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT if log else None, check=True)

    call(curve_cmd)
    curve = json.loads((d / "curve_validation.json").read_text())
    best = best_checkpoint(curve)
    ckpt = d / f"checkpoint-{best['step']}"
    eval_cmd = eval_command(
        model, seed, proto, device, eval_tokens, checkpoint=ckpt, output="eval_selected.json", run=d
    )
    out = d / "eval_selected.json"
    previous = json.loads(out.read_text()) if out.exists() else None
    if previous is None or previous["models"][0]["path"] != str(ckpt):
        if not reuse_final_evaluation(d, ckpt, out, eval_tokens or proto.eval_tokens, proto.lengths, device):
            call(eval_cmd)
    entry = json.loads(out.read_text())["models"][0]
    books_out = d / "per_book.json"
    books_cmd = [sys.executable, "-m", "research.lm_long", "books", str(ckpt), "--output", str(books_out),
                 "--lengths", str(proto.seq_len), str(max(proto.lengths)), "--eval_tokens",
                 str(eval_tokens or proto.eval_tokens), "--device", device, "--corpus", proto.corpus]  # fmt: skip
    call(books_cmd)  # scores only the books that per_book.json lacks for this checkpoint
    return {
        "validation_curve": curve,
        "selected_step": best["step"],
        "selected_results": entry["results"],
        "per_book": json.loads(books_out.read_text())["books"],
        "selection_commands": [" ".join(c[1:]) for c in (curve_cmd, eval_cmd, books_cmd)],
        "selection_commit": common.source_commit(),
    }


# Books that a corpus leaves out although the project's data holds them, scored book by book as split "unseen": no run
# on that corpus trained on them or selected a checkpoint with them. `books` drops the Treasury of David (a Psalms
# commentary, in the training split of `allbooks`), so it is a second book unlike the training books beside
# Sherlock Holmes. corpus -> (corpus whose prepared data holds them, its split, titles).
UNSEEN_BOOKS = {"books": ("allbooks", "train", ("treasury-of-david",))}


def _scored_books(corpus: str):
    """``(split, title, text)`` of every book that ``held_out_books`` scores for a run on ``corpus``."""
    from training import data as D

    def rows(name: str, split: str):
        path = LM.WORK / "data" / name
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is missing: build it with `python -m research.lm_quality prepare --corpora {name}`"
            )
        for row in D.load_documents("pg19", split, path=str(path)):
            yield row.get("title") or row.get("short_book_title"), row["text"]

    for split in ("test", "validation"):
        for title, text in rows(corpus, split):
            yield split, title, text
    if corpus in UNSEEN_BOOKS:
        source, split, titles = UNSEEN_BOOKS[corpus]
        found = {title: text for title, text in rows(source, split) if title in titles}
        for title in titles:
            if title not in found:
                raise ValueError(f"unseen book {title!r} is not in the {split} split of {source!r}")
            yield "unseen", title, found[title]


def held_out_books(
    model_dir: Path, corpus: str, lengths, eval_tokens: int, device: str = "cpu", output: Path | None = None
) -> list[dict]:
    """Bits per byte of ``model_dir`` on each held-out book alone (the test books, the validation book and the corpus's
    ``UNSEEN_BOOKS``, first ``eval_tokens`` tokens of each, windows of every length): the spread between books shows
    how much of a gap between two models one book decides. Written to ``output`` as ``{"model", "books": [{title,
    split, results}]}``; a book that ``output`` already holds for the same model, lengths and tokens is kept."""
    import torch

    from modeling_bst import BSTForCausalLM
    from training import data as D
    from training.evaluate import evaluate_model

    torch.set_num_threads(1)
    cached = {}
    if output is not None and output.exists():
        previous = json.loads(output.read_text())
        if previous["model"] == str(model_dir) and previous.get("eval_tokens") == eval_tokens:
            cached = {(b["title"], b["split"]): b for b in previous["books"]}
    model = tokenizer = None
    books = []
    for split, title, text in _scored_books(corpus):
        old = cached.get((title, split))
        if old is not None and [r["length"] for r in old["results"]] == list(lengths):
            books.append(old)
            continue
        if model is None:
            model = BSTForCausalLM.from_pretrained(model_dir).to(device)
            tokenizer = D.load_tokenizer(str(model_dir))
        results = evaluate_model(model, tokenizer, [text], list(lengths), max_tokens_per_doc=eval_tokens)
        books.append({"title": title, "split": split, "results": results})
        print(f"{model_dir} {title}: " + ", ".join(
            f"L={r['length']} {r['bits_per_byte']:.4f}" for r in results), flush=True)  # fmt: skip
    if output is not None:
        tmp = output.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": str(model_dir), "eval_tokens": eval_tokens, "books": books}, indent=1))
        os.replace(tmp, output)
    return books


def add_selection(proto: Protocol = CPU, runs: Path | None = None, device: str = "cpu", force: bool = False) -> list:
    """Adds the checkpoint selection and the per-book scores ([`select_checkpoint`]) to every record of ``proto`` that
    lacks them (``runs``: the folder that holds the run folders, when they live elsewhere than this checkout's
    ``runs/``; ``force``: redo every record). Returns the updated record paths."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = []
    for path in sorted(proto.results.glob("*.json")):
        record = json.loads(path.read_text())
        if "selected_results" in record and "per_book" in record and not force:
            continue
        d = (Path(runs) if runs else proto.work) / f"{record['model']}-s{record['seed']}"
        if not any(d.glob("checkpoint-*")):
            print(f"{path.name}: no checkpoints under {d}; skipped", flush=True)
            continue
        record.update(select_checkpoint(record["model"], record["seed"], proto, device, run=d, env=env))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
        print(f"{path.name}: selected step {record['selected_step']}", flush=True)
        done.append(path)
    return done


def run_long(
    model: str,
    seed: int,
    steps: int | None = None,
    bf16: bool = False,
    proto: Protocol = CPU,
    device: str | None = None,
    eval_tokens: int | None = None,
    threads: int | None = 1,
    train_args: list[str] | None = None,
) -> Path:
    """Train (resuming), evaluate every checkpoint and the final model, write the record; returns its path."""
    out = record_path(model, seed, proto)
    if out.exists():
        return out
    import torch

    steps = steps or proto.steps
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    d = run_dir(model, seed, proto)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    train_cmd = train_command(model, seed, steps, bf16, proto, device) + list(train_args or [])
    eval_cmd = eval_command(model, seed, proto, device, eval_tokens)
    curve_cmd = [sys.executable, "-m", "research.lm_long", "curve", str(d), "--length", str(proto.curve_length),
                 "--eval_tokens", str(eval_tokens or proto.eval_tokens), "--device", device, "--corpus", proto.corpus]  # fmt: skip
    log_dir = proto.work.parent.parent / "logs"
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
        selection = select_checkpoint(model, seed, proto, device, eval_tokens, env=env, log=fh)
    report = json.loads((d / "eval.json").read_text())
    history = json.loads((d / "log_history.json").read_text())
    train_losses = [{"step": h["step"], "loss": h["loss"]} for h in history if "loss" in h]
    runtime = [h for h in history if "train_runtime" in h]
    entry = report["models"][0]
    result = {
        "corpus": proto.corpus,
        "model": model,
        "label": label(model, proto),
        "preset": LM.MODELS[model][0],
        "seed": seed,
        "protocol": proto.name,
        "steps": steps,
        "tokens": steps * proto.tokens_per_step,
        "bf16": bf16,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({_cpu()})",
        "commit": common.source_commit(),
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
        **selection,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    return out


def run_all(models, seeds, jobs: int, steps: int | None, bf16: bool, proto: Protocol = CPU, **kw) -> list:
    todo = [(m, s) for s in seeds for m in models if not record_path(m, s, proto).exists()]
    failed = []
    print(f"{len(todo)} long runs to do ({jobs} at a time): {todo}", flush=True)

    def work(item):
        m, s = item
        t0 = time.time()
        try:
            run_long(m, s, steps, bf16, proto, **kw)
            print(f"done {m} seed {s} in {time.time() - t0:.0f} s", flush=True)
        except subprocess.CalledProcessError as err:
            failed.append((m, s))
            print(f"FAILED {m} seed {s}: {err} (log in {proto.work.parent.parent / 'logs'})", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))
    return failed


def load_records(results_dir: Path = RESULTS) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]


def _bpb(record: dict, length: int, key: str = "results") -> float | None:
    return LM.at({"results": record.get(key) or []}, length, "bits_per_byte")


def summarise(records: list[dict], lengths=CPU.lengths, key: str = "results") -> dict[str, dict]:
    """Per model: seeds, mean and spread (max - min) of test bits per byte and token perplexity at every length, from
    the final checkpoints (``key="results"``) or the validation-selected ones (``"selected_results"``; records without
    a selection are left out)."""
    by_model: dict[str, list[dict]] = {}
    for r in records:
        if r.get(key):
            by_model.setdefault(r["model"], []).append(r)
    out = {}
    for model, rs in by_model.items():
        row = {"seeds": sorted(r["seed"] for r in rs), "parameters": rs[0]["parameters"], "lengths": {}}
        row["selected_steps"] = [r.get("selected_step") for r in sorted(rs, key=lambda r: r["seed"])]
        for n in lengths:
            vals = [v for v in (_bpb(r, n, key) for r in rs) if v is not None]
            ppls = [v for v in (LM.at({"results": r[key]}, n, "ppl_token") for r in rs) if v is not None]
            if vals:
                row["lengths"][n] = {
                    "bpb_mean": sum(vals) / len(vals),
                    "bpb_spread": max(vals) - min(vals),
                    "ppl_mean": math.exp(sum(math.log(p) for p in ppls) / len(ppls)),
                }
        row["final_train_loss"] = sum(r["final_train_loss"] for r in rs) / len(rs)
        out[model] = row
    return out


def plot(records: list[dict], path: Path, proto: Protocol = CPU) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    from research import style as figure_style

    selected = [r for r in records if r.get("validation_curve")]
    fig, axes = plt.subplots(1, 3 if selected else 2, figsize=(16.5 if selected else 11, 4.2))
    ax1, ax2 = axes[0], axes[1]
    seeds: dict[str, list[int]] = {}
    for r in records:
        seeds.setdefault(r["model"], []).append(r["seed"])
    for r in sorted(records, key=lambda r: (r["model"], r["seed"])):
        model = r["model"]
        c, style = figure_style.colour(model), figure_style.linestyle(model)
        first = r["seed"] == min(seeds[model])  # one legend entry per model, its seeds in one colour
        n = len(seeds[model])
        name = (
            (f"{label(model, proto)} ({n} seeds)" if n > 1 else f"{label(model, proto)} s{r['seed']}")
            if first
            else None
        )
        alpha = 1.0 if first else 0.6
        per_step = r["tokens"] / r["steps"]  # records before train_tokens existed: from the step
        pts = [(p["step"] * per_step / 1e6, p["bits_per_byte"]) for p in r["learning_curve"]]
        ax1.plot(*zip(*pts), style, color=c, marker=".", label=name, alpha=alpha)
        gen = [(n, _bpb(r, n)) for n in proto.lengths if _bpb(r, n) is not None]
        ax2.plot(*zip(*gen), style, color=c, marker=figure_style.marker(model), label=name, alpha=alpha)
        if r.get("validation_curve"):
            val = [(p["step"] * per_step / 1e6, p["bits_per_byte"]) for p in r["validation_curve"]]
            axes[2].plot(*zip(*val), style, color=c, marker=".", alpha=alpha)
            best = next(p for p in r["validation_curve"] if p["step"] == r["selected_step"])
            axes[2].plot(best["step"] * per_step / 1e6, best["bits_per_byte"], "*", color=c, markersize=11)
    if selected:
        tail = [p["bits_per_byte"] for r in selected for p in r["validation_curve"][len(r["validation_curve"]) // 3 :]]
        axes[2].set_ylim(min(tail) - 0.02, max(tail) + 0.05)
        axes[2].set_xlabel("training tokens (millions)")
        axes[2].set_ylabel(f"validation bits per byte at L={proto.curve_length}")
        axes[2].set_title("validation curves (star: the selected checkpoint)")
        axes[2].grid(alpha=0.3)
    ax1.set_xlabel("training tokens (millions)")
    ax1.set_ylabel(f"test bits per byte at L={proto.curve_length}")
    ax1.set_title("learning curves (held-out books)")
    lo = min(p["bits_per_byte"] for r in records for p in r["learning_curve"][len(r["learning_curve"]) // 3 :])
    hi = max(p["bits_per_byte"] for r in records for p in r["learning_curve"][len(r["learning_curve"]) // 3 :])
    ax1.set_ylim(lo - 0.02, hi + 0.05)  # the last two thirds of training, where the models separate
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_locator(FixedLocator(list(proto.lengths)))
    ax2.xaxis.set_minor_locator(NullLocator())
    ax2.set_xticklabels([str(n) for n in proto.lengths])
    ax2.set_xlabel(f"evaluation length (tokens; trained at {proto.seq_len})")
    ax2.set_ylabel("test bits per byte")
    ax2.set_title("length generalisation (paper Fig. 5)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    # One legend for all panels, right of them, so that it never covers a curve (there are ~20 models).
    figure_style.figure_legend(fig, [ax1, ax2])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _table(summary: dict, lengths, L: int, steps: bool = False, proto: Protocol = CPU) -> list[str]:
    """Markdown rows: mean bits per byte (± half the seed spread, change against Slide's mean) at every length."""
    slide = summary.get("slide")
    head = "| Model | Params | seeds | " + ("selected steps | " if steps else "")
    head += " | ".join(f"bpb L={n}" for n in lengths) + f" | ppl L={L} |" + ("" if steps else " train loss |")
    lines = [
        head,
        "|---|---|---|" + ("---|" if steps else "") + "---|" * len(lengths) + ("---|" if steps else "---|---|"),
    ]
    order = [m for m in LONG_MODELS if m in summary] + [m for m in summary if m not in LONG_MODELS]
    for model in order:
        row = summary[model]
        cells = []
        for n in lengths:
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
        ppl = row["lengths"].get(L, {}).get("ppl_mean")
        picked = f"{','.join(str(s) for s in row['selected_steps'])} | " if steps else ""
        lines.append(
            f"| {label(model, proto)} | {row['parameters'] / 1e6:.2f}M | {','.join(map(str, row['seeds']))} | {picked}"
            + " | ".join(cells)
            + f" | {'–' if ppl is None else f'{ppl:.1f}'} |"
            + ("" if steps else f" {row['final_train_loss']:.3f} |")
        )
    return lines


def _book_bpb(record: dict, title: str, length: int) -> float | None:
    for book in record.get("per_book") or []:
        if book["title"] == title:
            return LM.at(book, length, "bits_per_byte")
    return None


def _books_table(records: list[dict], lengths: tuple[int, int], proto: Protocol = CPU) -> list[str]:
    """Each held-out book alone, at the training length and 16x: every run's bits per byte and, for runs that share a
    seed with Slide, the change against that Slide run (paired by seed: same initialisation stream and data order)."""
    have = [r for r in records if r.get("per_book")]
    if not have:
        return []
    splits = {}  # every book of any record, in first-seen order (records made before a book was added lack it)
    for r in have:
        for b in r["per_book"]:
            splits.setdefault(b["title"], b["split"])
    titles = list(splits)
    slide = {r["seed"]: r for r in have if r["model"] == "slide"}
    head = "| run | " + " | ".join(f"{t} ({splits[t]}) L={n}" for t in titles for n in lengths) + " |"
    lines = [head, "|---|" + "---|" * (len(titles) * len(lengths))]
    order = {m: i for i, m in enumerate(LONG_MODELS)}
    for r in sorted(have, key=lambda r: (order.get(r["model"], len(order)), r["model"], r["seed"])):
        cells = []
        for t in titles:
            for n in lengths:
                v = _book_bpb(r, t, n)
                ref = _book_bpb(slide[r["seed"]], t, n) if r["seed"] in slide and r["model"] != "slide" else None
                cells.append("–" if v is None else f"{v:.4f}" + (f" ({100 * (v / ref - 1):+.1f}%)" if ref else ""))
        lines.append(f"| {label(r['model'], proto)} s{r['seed']} | " + " | ".join(cells) + " |")
    return lines


def report(results_dir: Path | None = None, docs: Path | None | str = "default", proto: Protocol = CPU) -> str:
    """Table-1-style table (mean and spread over seeds), learning curves and length generalisation (one PNG), written
    into the protocol's section (``lm_long`` for the CPU one) of ``docs`` (None: only returned)."""
    from reporting import cpu_name, write_section

    docs = proto.docs if docs == "default" else docs
    records = load_records(results_dir or proto.results)
    if not records:
        raise SystemExit(f"no records under {results_dir}; run `python -m research.lm_quality long` first")
    docs_dir = (docs or common.DOCS).parent
    png = common.plot_path(docs or common.DOCS, proto.section)
    if docs is not None:
        plot(records, png, proto)
    lengths, L, r0 = proto.lengths, proto.seq_len, records[0]
    lines = _table(summarise(records, lengths), lengths, L, proto=proto)
    chosen = summarise(records, lengths, key="selected_results")
    n_val = validation_tokens(r0["dataset"].get("max_tokens_per_doc") or proto.eval_tokens)
    all_final = bool(chosen) and all(r["selected_step"] == r["steps"] for r in records if r.get("selected_results"))
    # early stopping that keeps every final model gets a sentence: the table above is also the selected one
    selected_lines = _table(chosen, lengths, L, steps=True, proto=proto) if chosen and not all_final else []
    selected_note = (
        f"Early stopping on the validation book (its first {n_val} tokens at L={L}, every {proto.save_every} steps) "
        f"selects the final checkpoint of every run with a selection ({', '.join(sorted(chosen))}): the validation "
        "curves fall to the end (third panel), so the table above is also the early-stopped one."
        if all_final
        else ""
    )
    book_lines = _books_table(records, (L, max(lengths)), proto)
    machine = (
        f"{cpu_name()}, one thread per run, two runs at a time"
        if proto.name == "cpu"
        else "see each record's `device`"
    )
    rerun = "long" if proto.name == "cpu" else f"long --protocol {proto.name}"
    if proto.corpus != CORPUS:
        rerun += f" --corpora {proto.corpus}"
    res = proto.results.relative_to(ROOT).as_posix() if proto.results.is_relative_to(ROOT) else str(proto.results)
    corpus = (
        "Corpus `books` (the ablation): the same books without the Treasury of David (9.6 MB of training text, 8 books; the same test and validation books)."
        if proto.corpus == "books"
        else f"Corpus `{CORPUS}`: every public-domain book in `../shared/data` (the seven of `books/`, the five of "
        "`more-books/`), whole books per split: test = Persuasion and The Adventures of Sherlock Holmes, validation = "
        "Northanger Abbey, training = the other nine (21.1 MB of text; 12,392 segments of 512 tokens = 6.3M tokens "
        "under the corpus's 4,096-token byte-level BPE, trained on the training split). "
        f"{r0['tokens'] / 1e6:.1f}M training tokens are {r0['tokens'] / 6.34e6:.1f} passes over it."
    )
    text = "\n".join(
        [
            f"## Long-run language modelling, {'CPU' if proto.name == 'cpu' else 'accelerator'} protocol, "
            f"`{proto.corpus}` (paper Table 1 / Fig. 5)",
            "",
            corpus,
            "",
            f"Every model ({proto.description}) trained for {r0['steps']} steps ({r0['tokens'] / 1e6:.2f}M tokens, "
            f"{'bf16 autocast' if r0.get('bf16') else 'fp32'}) on "
            f"the `{proto.corpus}` corpus with `configs/train/quality-cpu.yaml`; test: {r0['dataset'].get('documents', '?')} "
            f"held-out books, first {r0['dataset'].get('max_tokens_per_doc')} tokens of each, scored in windows of L "
            f"tokens. Machine: {machine}. ± is half the spread between seeds; percentages compare the mean bits per "
            f"byte with Slide's. Records (commands, commit, curves): `{res}/*.json`; rerun one with `python -m research.lm_quality {rerun} --models M --seeds S`.",
            "",
            *lines,
            *(
                [
                    "",
                    "The same runs at the checkpoint with the lowest validation bits per byte (early stopping: the "
                    f"validation book, first {n_val} tokens, at L={L}, every {proto.save_every} steps; "
                    "`selected steps` gives each seed's step), scored on the same test tokens "
                    "(`python -m research.lm_quality long-select` adds this to finished records):",
                    "",
                    *selected_lines,
                ]
                if selected_lines
                else []
            ),
            *(["", selected_note] if selected_note else []),
            *(
                [
                    "",
                    "Each held-out book alone (first "
                    f"{r0['dataset'].get('max_tokens_per_doc')} tokens of each; the validation book was not used for "
                    "anything but the early-stopping choice"
                    + (
                        f"; {', '.join(UNSEEN_BOOKS[proto.corpus][2])} (unseen) is a book that the `{proto.corpus}` "
                        "corpus leaves out, so no run trained on it or selected with it"
                        if proto.corpus in UNSEEN_BOOKS
                        else ""
                    )
                    + "), bits per byte of the selected checkpoint; percentages compare with the Slide run of the "
                    "same seed:",
                    "",
                    *book_lines,
                ]
                if book_lines
                else []
            ),
            "",
            f"![learning curves and length generalisation]({png.relative_to(docs_dir).as_posix()})",
        ]
    )
    if docs is not None:
        write_section(proto.section, text.split("\n"), docs)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="learning curve of one run, or its scores book by book (used by run_long)", allow_abbrev=False
    )
    p.add_argument("command", choices=["curve", "books"])
    p.add_argument("run_dir", help="curve: the run folder; books: the model folder (a checkpoint)")
    p.add_argument("--lengths", type=int, nargs="+", default=[CPU.seq_len, max(CPU.lengths)], help="books")
    p.add_argument("--output", default=None, help="books: JSON path")
    p.add_argument("--length", type=int, default=CPU.curve_length)
    p.add_argument("--eval_tokens", type=int, default=CPU.eval_tokens)
    p.add_argument("--device", default="cpu")
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--split", default="test", choices=["test", "validation"])
    args = p.parse_args(argv)
    if args.command == "books":
        out = Path(args.output) if args.output else None
        held_out_books(Path(args.run_dir), args.corpus, args.lengths, args.eval_tokens, args.device, out)
        return
    learning_curve(Path(args.run_dir), args.length, args.eval_tokens, args.device, args.corpus, args.split)


if __name__ == "__main__":
    main()
