"""Where one language model beats another, token by token (issue #13: is BST's gain on *Sherlock Holmes* about the
book's layout, its content, or both?).

``dump`` scores a trained model on the held-out books of a corpus exactly as ``research.lm_long books`` does (each
book's first ``--eval_tokens`` tokens, non-overlapping windows of ``--length`` tokens, the first token of each window
with no context but the window) and keeps every token's loss: a small safetensors file (int32 ids and float32 losses
per book, ~0.5 MB per book at 65,536 tokens) that travels back from an accelerator machine where the models cannot.

``compare A B`` splits the difference between two dumps of the same books and windows into classes of tokens, so that
the sum over the classes of each split is the whole difference:

* layout: the first token of a line (the token before it ends a line), a token that holds a line break, the rest;
* reach: whether the token continues a trigram seen earlier in its window *beyond* the attention's reach
  (``--far`` tokens back, default 2W: block attention sees W to 2W - 1 tokens back), only within it, or not at all;
* place: where the token sits in its window: the first block of W (nothing before it, for attention or the SSM),
  the second, then spans four times longer each (2W-8W, 8W-32W, ...).

Bits per byte use each book's UTF-8 bytes, as ``training.evaluate`` does; per-class numbers are nats per token and
each class's share of the whole difference.

    python -m research.token_losses dump RUN/final --corpus books --length 512 8192 --out slide-L{length}.safetensors
    python -m research.token_losses compare slide.safetensors bst.safetensors --book sherlock-holmes
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from research import common


FORMAT = "bst-token-losses-1"


def _key(title: str) -> str:
    """A tensor-name-safe form of a book title."""
    return "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")


@torch.no_grad()
def window_losses(model, ids: list[int], length: int, batch_size: int = 1) -> torch.Tensor:
    """The loss (nats, float32) of every token after the first of ``ids``, scored in the non-overlapping windows of
    ``length`` inputs that ``training.evaluate.evaluate_model`` uses (the last window may be shorter)."""
    from training.evaluate import token_nll, window_starts

    device = next(model.parameters()).device
    x = torch.tensor(ids, dtype=torch.long, device=device)
    n = len(ids) - 1
    out = torch.empty(n, dtype=torch.float32)
    full, rest = window_starts(n, length)

    def score(inp, tgt):
        return token_nll(model(inp, use_cache=False).logits, tgt).cpu()

    for i in range(0, len(full), batch_size):
        group = full[i : i + batch_size]
        inp = torch.stack([x[s : s + length] for s in group])
        tgt = torch.stack([x[s + 1 : s + length + 1] for s in group])
        for s, row in zip(group, score(inp, tgt)):
            out[s : s + length] = row
    for s in rest:
        out[s:n] = score(x[None, s:n], x[None, s + 1 : n + 1])[0]
    return out


def dump(model_dir: Path, corpus: str, lengths: list[int], eval_tokens: int, out: str, device: str = "cpu") -> list:
    """Every held-out book's token ids and losses under ``model_dir``, one safetensors file per window length at
    ``out`` (a path; with several lengths it must hold ``{length}``), each written atomically; the model is loaded
    and the books tokenised once. Returns each file's metadata (model, corpus, length, W, per-book bytes and bits
    per byte)."""
    from safetensors.torch import save_file

    from modeling_bst import BSTForCausalLM
    from research import lm_long
    from training import data as D
    from training.evaluate import scored_document

    if len(lengths) > 1 and "{length}" not in out:
        raise ValueError(f"--out {out!r} must hold '{{length}}' to name one file per length ({lengths})")
    model = BSTForCausalLM.from_pretrained(model_dir).to(device).eval()
    tokenizer = D.load_tokenizer(str(model_dir))
    books = [(split, title, scored_document(tokenizer, text, eval_tokens))
             for split, title, text in lm_long._scored_books(corpus)]  # fmt: skip
    metas = []
    for length in lengths:
        tensors, rows = {}, []
        for split, title, (ids, n_bytes, _) in books:
            nll = window_losses(model, ids, length)
            key = _key(title)
            tensors[f"{key}.ids"] = torch.tensor(ids, dtype=torch.int32)
            tensors[f"{key}.nll"] = nll
            bpb = float(nll.double().sum()) / (math.log(2) * n_bytes)
            rows.append({"title": title, "key": key, "split": split, "bytes": n_bytes, "bits_per_byte": bpb})
            print(f"{model_dir} {title}: L={length} {bpb:.4f} bits per byte", flush=True)
        meta = {
            "format": FORMAT,
            "model": str(model_dir),
            "corpus": corpus,
            "length": length,
            "eval_tokens": eval_tokens,
            "block_len": model.config.block_len,
            "layer_types": list(model.config.layer_types),
            "commit": common.source_commit(),
            "books": rows,
        }
        path = Path(out.format(length=length))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
        os.replace(tmp, path)
        metas.append(meta)
    return metas


def load(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["meta"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a token-loss dump (format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta, load_file(str(path))


def _place(p: int, block_len: int) -> str:
    """The span of window positions that ``p`` falls in: the first block (nothing before it to attend to or in the
    SSM), the second, then spans four times longer each (2W-8W, 8W-32W, ...): how much of the window the SSM has
    read."""
    if p < 2 * block_len:
        lo, hi = (0, block_len) if p < block_len else (block_len, 2 * block_len)
    else:
        lo = 2 * block_len
        while p >= 4 * lo:
            lo *= 4
        hi = 4 * lo
    return f"positions {lo}-{hi - 1}"


def _label_order(label: str) -> tuple:
    """Classes in reading order: the spans of window positions by where they start, anything else by name."""
    if label.startswith("positions "):
        return (0, int(label.split()[1].split("-")[0]), "")
    return (1, 0, label)


def token_classes(ids: torch.Tensor, tokenizer_pieces: dict[int, str] | None, length: int, block_len: int, far: int):
    """Per scored token (``ids[1:]``), its class in each split: ``{"layout": [...], "reach": [...], "place": [...]}``
    (lists of labels, one per token). ``tokenizer_pieces`` maps ids to their text (None: no layout split)."""
    ids = ids.tolist()
    n = len(ids) - 1
    classes: dict[str, list[str]] = {"reach": [], "place": []}
    if tokenizer_pieces is not None:
        classes["layout"] = []
    last_seen: dict[tuple, int] = {}
    window = -1
    for t in range(n):  # target ids[t + 1] given ids[: t + 1], window of input position t
        if t // length != window:
            window, last_seen = t // length, {}
        p = t % length  # position of the input token in its window
        target = ids[t + 1]
        if tokenizer_pieces is not None:
            if "\n" in tokenizer_pieces.get(target, ""):
                classes["layout"].append("holds a line break")
            elif tokenizer_pieces.get(ids[t], "").endswith("\n") and p > 0:
                classes["layout"].append("first of a line")
            else:
                classes["layout"].append("other")
        # the trigram (input t-1, input t, target): where its previous occurrence in the window ends
        if p >= 1:
            gram = (ids[t - 1], ids[t], target)
            seen = last_seen.get(gram)
            if seen is None:
                classes["reach"].append("new in its window")
            elif t - seen >= far:
                classes["reach"].append(f"repeats from >= {far} back only")
            else:
                classes["reach"].append(f"repeats within {far}")
            last_seen[gram] = t
        else:
            classes["reach"].append("new in its window")
        classes["place"].append(_place(p, block_len))
    return classes


def compare(a: Path, b: Path, books: list[str] | None = None, far: int | None = None, tokenizer=None) -> dict:
    """B's loss minus A's, book by book, split into token classes (see the module docstring). Both dumps must hold
    the same tokens of the same books at the same window length."""
    meta_a, ta = load(a)
    meta_b, tb = load(b)
    for field in ("corpus", "length", "eval_tokens"):
        if meta_a[field] != meta_b[field]:
            raise ValueError(f"the dumps differ in {field}: {meta_a[field]!r} ({a}) vs {meta_b[field]!r} ({b})")
    length, w = meta_a["length"], meta_a["block_len"]
    far = 2 * w if far is None else far
    pieces = None
    if tokenizer is not None:
        pieces = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    result = {"a": str(a), "b": str(b), "length": length, "block_len": w, "far": far, "books": []}
    for book in meta_a["books"]:
        key = book["key"]
        if books and key not in books and book["title"] not in books:
            continue
        if not torch.equal(ta[f"{key}.ids"], tb[f"{key}.ids"]):
            raise ValueError(f"the dumps scored different tokens of {book['title']!r}")
        diff = (tb[f"{key}.nll"].double() - ta[f"{key}.nll"].double()).numpy()
        nll_a = ta[f"{key}.nll"].double().numpy()
        total = float(diff.sum())
        bpb_b = next(x["bits_per_byte"] for x in meta_b["books"] if x["key"] == key)
        row = {
            "title": book["title"],
            "split": book["split"],
            "tokens": int(diff.size),
            "bits_per_byte": [book["bits_per_byte"], bpb_b],
            "relative": bpb_b / book["bits_per_byte"] - 1,
            "difference_nats": total,
            "splits": {},
        }
        for split, labels in token_classes(ta[f"{key}.ids"], pieces, length, w, far).items():
            groups = {}
            labels = np.array(labels)
            for label in sorted(set(labels.tolist()), key=_label_order):
                mask = labels == label
                d = float(diff[mask].sum())
                groups[label] = {
                    "tokens": int(mask.sum()),
                    "nats_a": float(nll_a[mask].mean()),
                    "difference_per_token": d / max(1, int(mask.sum())),
                    "share": d / total if total else float("nan"),
                }
            row["splits"][split] = groups
        result["books"].append(row)
    return result


def table(result: dict) -> str:
    """A Markdown table per book: each class's tokens, A's loss, B - A per token and its share of B - A."""
    lines = []
    for row in result["books"]:
        a, b = row["bits_per_byte"]
        lines += [
            f"**{row['title']}** ({row['split']}, {row['tokens']} tokens, L = {result['length']}, W = "
            f"{result['block_len']}): A {a:.4f}, B {b:.4f} bits per byte ({100 * row['relative']:+.1f}%), B - A = "
            f"{row['difference_nats']:+.1f} nats",
            "",
            "| split | class | tokens | A nats/token | B - A nats/token | share of B - A |",
            "|---|---|---|---|---|---|",
        ]
        for split, groups in row["splits"].items():
            for label, g in groups.items():
                lines.append(
                    f"| {split} | {label} | {g['tokens']} | {g['nats_a']:.3f} | {g['difference_per_token']:+.4f} | "
                    f"{100 * g['share']:+.0f}% |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="every held-out token's loss under one model")
    d.add_argument("model_dir")
    d.add_argument("--corpus", required=True)
    d.add_argument("--length", type=int, nargs="+", required=True, help="window lengths (one file each)")
    d.add_argument("--eval_tokens", type=int, default=65536)
    d.add_argument("--device", default="cpu")
    d.add_argument("--out", required=True, help="the file; with several lengths a path holding {length}")
    c = sub.add_parser("compare", help="B - A by token class")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--book", nargs="*", default=None, help="book keys or titles (default: every book)")
    c.add_argument("--far", type=int, default=None, help="tokens back beyond the attention's reach (default 2W)")
    c.add_argument("--tokenizer", default=None, help="a model or tokenizer folder: adds the layout split")
    c.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.command == "dump":
        try:
            dump(Path(args.model_dir), args.corpus, args.length, args.eval_tokens, args.out, args.device)
        except ValueError as e:
            p.error(str(e))
        return
    tokenizer = None
    if args.tokenizer:
        from training import data as D

        tokenizer = D.load_tokenizer(args.tokenizer)
    result = compare(Path(args.a), Path(args.b), args.book, args.far, tokenizer)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
