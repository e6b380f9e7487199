"""How much a trained BST uses its SSM context states (issue #13: explaining where a variant departs from the paper).

    python -m experiments.context_use RUN_DIR [RUN_DIR ...] --corpus books --length 2048

Each run's final model scores the test books three times, in windows of ``--length`` tokens batched ``--batch`` at a
time (consecutive windows of one book):

- ``normal``: as trained;
- ``shuffled``: every BST layer's context states (keys and values, from its SSM over the window) are those of another
  window of the batch (a neighbouring stretch of the same book), so the states keep their statistics but not their
  information about this window;
- ``zeroed``: the context values are zero, so the cross-attention adds nothing.

``shuffled - normal`` (bits per byte) is what the model draws from the information in its SSM's states;
``zeroed - normal`` also counts what it draws from their mere presence (a learned offset). A model that ignores its
SSM scores the same in the three. Only BST layers (``SH`` / ``MH`` / ``MF``) are ablated; BRecT's recurrent state
and GSS layers are left alone. Writes a JSON record and the ``context_use`` section of ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from experiments import lm_quality as Q


ROOT = Q.ROOT
MODES = ("normal", "shuffled", "zeroed")


@contextmanager
def ablate_context(model, mode: str):
    """Within the block, every BST cross-attention layer of ``model`` builds its context states as ``mode`` says
    (see the module docstring). Yields the number of layers patched."""
    from modeling_bst.modeling_bst import BSTContextCrossAttention

    layers = [m for m in model.modules() if isinstance(m, BSTContextCrossAttention)]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    originals = [m.context.sequence for m in layers]

    def patched(original):
        def sequence(*args, **kwargs):
            ctx_k, ctx_v, ctx_mask, zero_first = original(*args, **kwargs)
            if mode == "shuffled":
                if ctx_k.shape[0] < 2:
                    raise ValueError("shuffled context needs at least 2 windows a batch (--batch)")
                ctx_k, ctx_v = ctx_k.roll(1, 0), ctx_v.roll(1, 0)
            elif mode == "zeroed":
                ctx_v = torch.zeros_like(ctx_v)
            return ctx_k, ctx_v, ctx_mask, zero_first

        return sequence

    try:
        if mode != "normal":
            for m, original in zip(layers, originals):
                m.context.sequence = patched(original)
        yield len(layers)
    finally:
        for m in layers:
            m.context.__dict__.pop("sequence", None)


def measure(run_dir: Path, corpus: str, length: int, batch: int, eval_tokens: int) -> dict:
    """Test bits per byte of ``run_dir``'s final model in the three modes, over all test books and book by book."""
    import math

    from modeling_bst import BSTForCausalLM
    from training import data as D
    from training.evaluate import evaluate_model

    model_dir = run_dir / "final"
    model = BSTForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = D.load_tokenizer(str(model_dir))
    books = [(r.get("title") or f"book {i}", r["text"]) for i, r in enumerate(
        D.load_documents("pg19", "test", path=str(Q.WORK / "data" / corpus)))]  # fmt: skip
    row = {"run": run_dir.name, "path": str(model_dir), "context_mode": model.config.context_mode}
    for mode in MODES:
        with ablate_context(model, mode) as n:
            if n == 0:
                return {**row, "bst_layers": 0}
            t0 = time.time()
            per_book = {
                title: evaluate_model(model, tokenizer, [text], [length], batch_size=batch, max_tokens_per_doc=eval_tokens)[0]
                for title, text in books
            }  # fmt: skip
        nll = sum(r["nll_sum"] for r in per_book.values())
        n_bytes = sum(r["bytes"] for r in per_book.values())
        row["bst_layers"] = n
        row[mode] = {
            "bits_per_byte": nll / (math.log(2) * n_bytes),
            "books": {t: r["bits_per_byte"] for t, r in per_book.items()},
        }
        print(f"{run_dir.name} {mode:>8}: {row[mode]['bits_per_byte']:.4f} bpb {row[mode]['books']} "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    return row


def report(record: dict, docs: Path | None) -> str:
    from benchmarks.docs_section import write_section

    lines = [
        "## How much each BST uses its SSM's context states",
        "",
        f"Test bits per byte of each run's final model on the `{record['corpus']}` test books (first "
        f"{record['eval_tokens']} tokens of each) in windows of L={record['length']}, {record['batch']} consecutive "
        "windows a batch, with every BST layer's context states as trained, taken from another window of the batch "
        "(shuffled: same statistics, wrong information) or with zero values (zeroed). Record: "
        f"`{record['out']}`, with the exact command; `python -m experiments.context_use RUN_DIR ...` reruns it.",
        "",
    ]
    rows = [r for r in record["rows"] if r.get("bst_layers")]
    titles = list(rows[0]["normal"].get("books", {})) if rows else []
    lines += [
        "| run | context | BST layers | normal | shuffled | zeroed | shuffled - normal | zeroed - normal | "
        + "".join(f"shuffled - normal, {t} | " for t in titles),
        "|---|---|---|---|---|---|---|---|" + "---|" * len(titles),
    ]
    for r in rows:
        n, s, z = (r[m]["bits_per_byte"] for m in MODES)
        books = "".join(
            f"{r['shuffled']['books'][t] - r['normal']['books'][t]:+.4f} ({100 * (r['shuffled']['books'][t] / r['normal']['books'][t] - 1):+.1f}%) | "
            for t in titles
        )  # fmt: skip
        lines.append(
            f"| {r['run']} | {r['context_mode']} | {r['bst_layers']} | {n:.4f} | {s:.4f} | {z:.4f} | "
            f"{s - n:+.4f} ({100 * (s / n - 1):+.1f}%) | {z - n:+.4f} ({100 * (z / n - 1):+.1f}%) | " + books
        )
    text = "\n".join(lines)
    if docs is not None:
        write_section("context_use", lines, docs)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("runs", nargs="+", help="run folders (each with final/), e.g. runs/lm_quality/long/books/*-s0")
    p.add_argument("--corpus", default="books")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="windows a batch (shuffled mode rolls the states over it)")
    p.add_argument("--eval_tokens", type=int, default=65536, help="scored tokens per test book")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "context_use_books.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "results.md"), help="'' to skip the docs section")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    rows = []
    for run in args.runs:
        d = Path(run)
        if not (d / "final").is_dir():
            raise SystemExit(f"{d}: no final/ model folder (is the run finished?)")
        rows.append(measure(d, args.corpus, args.length, args.batch, args.eval_tokens))
    out = Path(args.out)
    rel = out.resolve().relative_to(ROOT).as_posix() if out.resolve().is_relative_to(ROOT) else str(out)
    from experiments.lm_long import _commit

    record = {
        "corpus": args.corpus, "length": args.length, "batch": args.batch, "eval_tokens": args.eval_tokens,
        "command": "python -m experiments.context_use " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _commit(), "out": rel, "rows": rows,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, out)
    report(record, Path(args.docs) if args.docs else None)


if __name__ == "__main__":
    main()
