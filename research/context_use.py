"""How much a trained BST uses its SSM context states (issue #13: explaining where a variant departs from the paper).

    python -m research.context_use RUN_DIR [RUN_DIR ...] --corpus books --length 2048

Each run's final model scores the test books (the first ``--eval_tokens`` of each, in windows of ``--length`` tokens)
four times:

- ``normal``: as trained;
- ``shuffled``: every BST layer's context states (keys and values, from its SSM over the window) are those of the
  next window of the same book (batches of ``--batch`` consecutive windows, rolled by one), so they keep their
  statistics and the book's gist (characters, style) but lose what is specific to this stretch of text, its own
  tokens included;
- ``other_book``: the states of a window of the other test book (windows of the two books interleaved, rolled by
  one): statistics kept, everything specific to the book lost;
- ``zeroed``: the context values are zero, so the cross-attention adds nothing.

``shuffled - normal`` (bits per byte) is what the model draws from the stretch-specific information in its SSM's
states, ``other_book - normal`` also counts the book-level information, and ``zeroed - normal`` also what it draws
from the states' mere presence (a learned offset). A model that ignores its SSM scores the same in the four. Only BST
layers (``SH`` / ``MH`` / ``MF``) are ablated; BRecT's recurrent state and GSS layers are left alone. Writes a JSON record and the ``context_use`` section of ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from research import common
from research import lm_common as LM


ROOT = common.ROOT
MODES = ("normal", "shuffled", "other_book", "zeroed")


@contextmanager
def ablate_context(model, mode: str):
    """Within the block, every BST cross-attention layer of ``model`` builds its context states as ``mode`` says
    (see the module docstring). Yields the number of layers patched."""
    layers = [m for m in model.modules() if getattr(m, "layer_type", None) == "bst"]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    originals = [m.context.sequence for m in layers]

    def patched(original):
        def sequence(*args, **kwargs):
            ctx_k, ctx_v, ctx_mask, zero_first = original(*args, **kwargs)
            if mode in ("shuffled", "other_book"):
                if ctx_k.shape[0] < 2:
                    raise ValueError(f"{mode} context needs at least 2 windows a batch (--batch)")
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


def _windows(tokenizer, books, length: int, eval_tokens: int):
    """Per book: its scored byte count and its windows ``(inputs, targets)`` of ``length`` tokens over the first
    ``eval_tokens`` text tokens (the convention of ``training.evaluate``: ``[bos] + tokens``, the last window may be
    shorter and is dropped here so that every batch is rectangular)."""
    from training import data as D

    out = {}
    for title, text in books:
        ids = D.encode_document(tokenizer, text, add_bos=True, add_eos=False)[: eval_tokens + 1]
        x = torch.tensor(ids, dtype=torch.long)
        n = (len(ids) - 1) // length
        wins = [(x[i * length : (i + 1) * length], x[i * length + 1 : (i + 1) * length + 1]) for i in range(n)]
        scored = tokenizer.decode(ids[1 : n * length + 1])
        out[title] = (len(scored.encode("utf-8")), wins)
    return out


@torch.no_grad()
def _score(model, batches) -> dict[str, float]:
    """Summed NLL (nats) per book over ``batches``: lists of ``(book, inputs, targets)``."""
    from training.evaluate import _nll

    nll: dict[str, float] = {}
    for group in batches:
        logits = model(torch.stack([g[1] for g in group]), use_cache=False).logits
        for i, (book, _, targets) in enumerate(group):  # per window: each belongs to one book
            nll[book] = nll.get(book, 0.0) + float(_nll(logits[i], targets))
    return nll


def batches_for(mode: str, windows: dict, batch: int) -> list[list]:
    """``shuffled`` (and ``normal`` / ``zeroed``): ``batch`` consecutive windows of one book a batch; ``other_book``:
    the books' windows interleaved (window i of every book, then window i + 1, ...), so that rolling by one hands
    every window the states of another book."""
    titles = list(windows)
    if mode == "other_book":
        if len(titles) < 2:
            raise ValueError("other_book needs at least two test books")
        n = min(len(windows[t][1]) for t in titles)
        flat = [(t, *windows[t][1][i]) for i in range(n) for t in titles]
        return [flat[i : i + batch] for i in range(0, len(flat), batch)]
    out = []
    for t in titles:
        wins = [(t, *w) for w in windows[t][1]]
        out += [wins[i : i + batch] for i in range(0, len(wins), batch)]
    return out


def measure(run_dir: Path, corpus: str, length: int, batch: int, eval_tokens: int) -> dict:
    """Test bits per byte of ``run_dir``'s final model in every mode, over all test books and book by book. Every
    mode scores the same windows, so every test book must give as many (its first ``eval_tokens`` tokens)."""
    from modeling_bst import BSTForCausalLM
    from training import data as D

    model_dir = run_dir / "final"
    model = BSTForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = D.load_tokenizer(str(model_dir))
    books = [(r.get("title") or f"book {i}", r["text"]) for i, r in enumerate(
        D.load_documents("pg19", "test", path=str(LM.WORK / "data" / corpus)))]  # fmt: skip
    windows = _windows(tokenizer, books, length, eval_tokens)
    if len({len(w) for _, w in windows.values()}) > 1:
        raise ValueError(f"the test books give different window counts {[len(w) for _, w in windows.values()]}; "
                         "lower --eval_tokens to the shortest book")  # fmt: skip
    row = {"run": run_dir.name, "path": str(model_dir), "context_mode": model.config.context_mode}
    for mode in MODES:
        with ablate_context(model, mode) as n:
            if n == 0:
                return {**row, "bst_layers": 0}
            t0 = time.time()
            nll = _score(model, batches_for(mode, windows, batch))
        row["bst_layers"] = n
        row[mode] = {
            "bits_per_byte": sum(nll.values()) / (math.log(2) * sum(b for b, _ in windows.values())),
            "books": {t: nll[t] / (math.log(2) * windows[t][0]) for t in windows},
        }
        print(f"{run_dir.name} {mode:>10}: {row[mode]['bits_per_byte']:.4f} bpb {row[mode]['books']} "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    return row


SETTINGS = ("corpus", "length", "batch", "eval_tokens")


def merge_records(previous: dict, new: dict) -> dict:
    """``new``'s rows added to ``previous`` (a row of the same run replaced); both must share every setting. The
    merged record lists every command and commit that made it (``commands``)."""
    differ = [k for k in SETTINGS if previous.get(k) != new.get(k)]
    if differ:
        raise ValueError(f"cannot append: settings differ in {differ} ({[previous.get(k) for k in differ]} vs "
                         f"{[new.get(k) for k in differ]})")  # fmt: skip
    names = {r["run"] for r in new["rows"]}
    history = previous.get("commands") or [{"command": previous["command"], "commit": previous["commit"]}]
    return {
        **previous,
        "rows": [r for r in previous["rows"] if r["run"] not in names] + new["rows"],
        "commands": history + [{"command": new["command"], "commit": new["commit"]}],
    }


def report(record: dict, docs: Path | None) -> str:
    from reporting import write_section

    lines = [
        "## How much each BST uses its SSM's context states",
        "",
        f"Test bits per byte of each run's final model on the `{record['corpus']}` test books (first "
        f"{record['eval_tokens']} tokens of each) in windows of L={record['length']}, {record['batch']} consecutive "
        "windows a batch, with every BST layer's context states as trained, taken from the next window of the same book "
        "(shuffled), from a window of the other test book (other book), or with zero values (zeroed). Record: "
        f"`{record['out']}`, with the exact command; `python -m research.context_use RUN_DIR ...` reruns it.",
        "",
    ]
    rows = [r for r in record["rows"] if r.get("bst_layers")]
    titles = list(rows[0]["normal"].get("books", {})) if rows else []
    lines += [
        "| run | context | BST layers | normal | shuffled - normal | other book - normal | zeroed - normal | "
        + "".join(f"{t}: normal, shuffled, other book, zeroed | " for t in titles),
        "|---|---|---|---|---|---|---|" + "---|" * len(titles),
    ]

    for r in rows:
        n = r["normal"]["bits_per_byte"]
        cells = [
            f"{r[m]['bits_per_byte'] - n:+.4f} ({100 * (r[m]['bits_per_byte'] / n - 1):+.1f}%)" for m in MODES[1:]
        ]
        books = [", ".join(f"{r[m]['books'][t]:.4f}" for m in MODES) for t in titles]
        lines.append(
            f"| {r['run']} | {r['context_mode']} | {r['bst_layers']} | {r['normal']['bits_per_byte']:.4f} | "
            + " | ".join(cells + books)
            + " |"
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
    p.add_argument("--out", default=str(common.RESULTS / "context_use_books.json"))
    p.add_argument("--docs", default=str(common.DOCS), help="'' to skip the docs section")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--replace",
        action="store_true",
        help="start a new record at --out; by default these runs join the record there (same settings), a rerun "
        "replacing its row",
    )
    p.add_argument("--append", action="store_true", help=argparse.SUPPRESS)  # the default since 2026-11-26
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

    command = "python -m research.context_use " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {
        "corpus": args.corpus, "length": args.length, "batch": args.batch, "eval_tokens": args.eval_tokens,
        "command": command, "commit": common.source_commit(), "out": rel, "rows": rows,
    }  # fmt: skip
    if out.exists() and not args.replace:
        try:
            record = merge_records(json.loads(out.read_text()), record)
        except ValueError as exc:
            raise SystemExit(
                f"{out}: {exc}; pass --replace to start a new record there, or --out another file"
            ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, out)
    report(record, Path(args.docs) if args.docs else None)


if __name__ == "__main__":
    main()
