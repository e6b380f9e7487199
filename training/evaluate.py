"""Perplexity and bits per byte over whole documents at several evaluation lengths (length generalisation), or another
evaluation task (``--task``: ``lm``, the default, or ``mqar``).

    python -m training.evaluate --model outputs/tiny/final --lengths 512 4096 16384 65536 --output eval.json
    python -m training.evaluate --model A B --lengths 512 4096 --dataset pg19 --dataset_path pg19/ --split test \
        --output eval.json --plot eval.png
    python -m training.evaluate --task mqar --model MODEL_DIR --lengths 256 512 --num_pairs 8 --output mqar.json

``--task mqar`` scores a model trained on multi-query associative recall on held-out sequences of each (length,
pairs) cell (``training.tasks.mqar``: the format, the gap, the accuracy); the model folder needs no tokenizer, the
``--dataset`` flags are not used and no plot is drawn.

At evaluation length ``L`` each document (``[bos] + tokens(text)``) is cut into consecutive windows of ``L`` input
tokens; window ``w`` predicts tokens ``w*L+1 .. (w+1)*L``, so every text token is scored exactly once, with a context
that restarts at each window boundary (the paper's length-generalisation protocol: a model trained at 4096 reads
windows of 512 ... 65536 tokens). ``--carry_state`` instead carries the model cache from one window to the next
inside a document (Transformer-XL / BRecT style streaming). ``--chunk_size C`` feeds each window in chunks of C
tokens with the cache carried between chunks: the same numbers as one forward (the BST cache is exact), with memory
bounded by C.

Reported per length, over the whole split: ``ppl_token = exp(sum NLL / scored tokens)``,
``bits_per_byte = sum NLL / (ln 2 * UTF-8 bytes of the scored texts)`` (comparable across tokenizers) and
``ppl_word = exp(sum NLL / whitespace-separated words)`` (PG19's word-level perplexity). ``evaluate``'s Hub
perplexity metric is not used: it truncates each text to the model's maximum length and needs the Hub. The same
numbers, from the same code ([`evaluate_model`]), come as an ``evaluate`` metric module:
``evaluate.load("metrics/bits_per_byte")`` (see metrics/bits_per_byte/).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from training import data as D
from training.tasks import TASKS
from training.tasks import mqar as MQ


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token NLL (nats, float32) of each of ``targets`` `(B, T)` under ``logits`` `(B, T, V)`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets[..., None]).squeeze(-1)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (nats, float64) of ``targets`` `(B, T)` under ``logits`` `(B, T, V)`."""
    return token_nll(logits, targets).double().sum()


def scored_document(tokenizer, text: str, max_tokens: int | None = None) -> tuple[list[int], int, int]:
    """``(ids, bytes, words)`` of one document as scored: BOS + its tokens, cut to the first ``max_tokens`` text
    tokens (then ``bytes`` and ``words`` count the decoded kept part), with the UTF-8 bytes and words of the scored
    text."""
    ids = D.encode_document(tokenizer, text, add_bos=True, add_eos=False)
    if max_tokens is not None and len(ids) - 1 > max_tokens:
        ids = ids[: max_tokens + 1]
        text = tokenizer.decode(ids[1:])
    return ids, len(text.encode("utf-8")), len(text.split())


def window_starts(num_targets: int, length: int) -> tuple[list[int], list[int]]:
    """Starts of the non-overlapping windows of ``length`` inputs over ``num_targets`` scored tokens: the full windows
    and the shorter last one (none or one)."""
    starts = list(range(0, num_targets, length))
    full = [s for s in starts if s + length <= num_targets]
    return full, starts[len(full) :]


@torch.no_grad()
def window_nll(model, inputs, targets, chunk_size: int = 0, cache=None, keep_cache: bool = False):
    """NLL sum of ``targets`` given ``inputs`` (both `(B, T)`, aligned: targets[t] follows inputs[..t]).

    ``cache`` continues a previous window and ``keep_cache`` returns the cache after this one (``--carry_state``);
    ``chunk_size > 0`` feeds the window in chunks carrying the cache. Returns ``(nll, cache_out)``; ``cache_out`` is
    None unless a cache was used."""
    T = inputs.shape[1]
    use_cache = keep_cache or cache is not None or (0 < chunk_size < T)
    if not use_cache:
        return _nll(model(inputs, use_cache=False).logits, targets), None
    step = chunk_size if chunk_size > 0 else T
    total = torch.zeros((), dtype=torch.float64)
    for s in range(0, T, step):
        out = model(inputs[:, s : s + step], use_cache=True, past_key_values=cache)
        cache = out.past_key_values
        total += _nll(out.logits, targets[:, s : s + step])
    return total, cache


@torch.no_grad()
def evaluate_model(
    model,
    tokenizer,
    texts: list[str],
    lengths: list[int],
    chunk_size: int = 0,
    carry_state: bool = False,
    batch_size: int = 1,
    max_tokens_per_doc: int | None = None,
    progress: bool = False,
) -> list[dict]:
    """One result dict per evaluation length (see the module docstring for the protocol and the fields).

    ``max_tokens_per_doc`` scores only each document's first N text tokens (the same span at every length, so the
    numbers stay comparable). A length the model cannot run (e.g. an unstruct filter shorter than L) gives a row with
    ``error``."""
    model.eval()
    device = next(model.parameters()).device
    docs = [scored_document(tokenizer, text, max_tokens_per_doc) for text in texts]
    results = []
    total = sum(len(ids) - 1 for ids, _, _ in docs)
    for L in lengths:
        t0 = time.time()
        nll = 0.0
        windows = 0
        # Scored tokens at this length (tokens/s on the bar), documents in the postfix; stderr, only with progress.
        bar = tqdm(total=total, desc=f"eval L={L}", unit="tok", unit_scale=True, disable=not progress, leave=False)
        try:
            for d, (ids, _, _) in enumerate(docs):
                bar.set_postfix_str(f"document {d + 1}/{len(docs)}")
                x = torch.tensor(ids, dtype=torch.long, device=device)
                full, rest = window_starts(len(ids) - 1, L)
                windows += len(full) + len(rest)
                if carry_state:
                    cache = None
                    for s in full + rest:
                        e = min(s + L, len(ids) - 1)
                        n, cache = window_nll(model, x[None, s:e], x[None, s + 1 : e + 1], chunk_size, cache, True)
                        nll += float(n)
                        bar.update(e - s)
                    continue
                for group in _batched(full, batch_size):
                    inp = torch.stack([x[s : s + L] for s in group])
                    tgt = torch.stack([x[s + 1 : s + L + 1] for s in group])
                    nll += float(window_nll(model, inp, tgt, chunk_size)[0])
                    bar.update(tgt.numel())
                for s in rest:
                    e = len(ids) - 1
                    nll += float(window_nll(model, x[None, s:e], x[None, s + 1 : e + 1], chunk_size)[0])
                    bar.update(e - s)
        except ValueError as err:  # a model that cannot run length L
            results.append({"length": L, "error": str(err)})
            continue
        finally:
            bar.close()
        tokens = sum(len(ids) - 1 for ids, _, _ in docs)
        n_bytes = sum(b for _, b, _ in docs)
        words = sum(w for _, _, w in docs)
        row = {
            "length": L,
            "ppl_token": math.exp(nll / tokens),
            "bits_per_byte": nll / (math.log(2) * n_bytes),
            "ppl_word": math.exp(nll / words) if words else None,
            "nll_sum": nll,
            "tokens": tokens,
            "bytes": n_bytes,
            "words": words,
            "documents": len(docs),
            "windows": windows,
            "seconds": time.time() - t0,
        }
        if progress:
            print(f"  L={L:>6}: ppl {row['ppl_token']:.3f}  bpb {row['bits_per_byte']:.4f}  ({row['seconds']:.1f} s)")
        results.append(row)
    return results


def _batched(seq, n):
    for i in range(0, len(seq), n):
        yield tuple(seq[i : i + n])


def plot_figure(report: dict):
    """Figure of token perplexity vs evaluation length (log2 axis), one line per model. The y axis starts at 0 and
    every point carries its value, so that a 0.1% difference looks like one (a tight auto-scaled axis would draw it as
    a cliff)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    top = 0.0
    points = {}  # length -> [(perplexity, colour)]
    for m in report["models"]:
        rows = [r for r in m["results"] if "ppl_token" in r]
        xs, ys = [r["length"] for r in rows], [r["ppl_token"] for r in rows]
        (line,) = ax.plot(xs, ys, marker="o", label=m["name"])
        for x, y in zip(xs, ys):
            points.setdefault(x, []).append((y, line.get_color()))
        top = max([top, *ys])
    for x, column in points.items():
        # At each length the lowest value is labelled below its point, the others above, stacked upwards.
        for rank, (y, colour) in enumerate(sorted(column)):
            below = rank == 0 and len(column) > 1
            ax.annotate(
                f"{y:.4g}",
                (x, y),
                textcoords="offset points",
                xytext=(0, -8 if below else 6 + 11 * max(0, rank - 1)),
                ha="center",
                va="top" if below else "bottom",
                fontsize=8,
                color=colour,
            )
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, top * (1.12 + 0.06 * len(report["models"])) if top > 0 else 1)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("token perplexity (axis from 0)")
    ax.set_title(f"{report['dataset']['dataset']} / {report['dataset']['split']}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot(report: dict, path: str | os.PathLike) -> str:
    """PNG of ``plot_figure(report)``; returns the path."""
    import matplotlib.pyplot as plt

    fig = plot_figure(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def load_model(path: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False):
    """A causal LM (BST registered; other custom code with ``trust_remote_code``) and its tokenizer, in eval mode."""
    from transformers import AutoModelForCausalLM

    import modeling_bst  # noqa: F401  (registers model_type "bst")

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval(), D.load_tokenizer(path, trust_remote_code=trust_remote_code)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--task", default="lm", choices=TASKS, help="lm (default): perplexity and bits per byte; mqar")
    p.add_argument("--model", nargs="+", required=True, help="saved model folder(s) with their tokenizer")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="lm default: 512 4096 16384 65536; mqar: 256")
    p.add_argument("--output", required=True, help="JSON file")
    p.add_argument("--plot", default=None, help="PNG file (default: the JSON path with .png)")
    p.add_argument("--dataset", default="embedded", choices=D.DATASET_KINDS)
    p.add_argument("--dataset_path", default=None)
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--data_files", default=None)
    p.add_argument("--text_column", default=None)
    p.add_argument("--split", default="validation")
    p.add_argument("--streaming", action="store_true", help="stream the documents (Hub)")
    p.add_argument("--max_docs", type=int, default=None)
    p.add_argument("--max_tokens_per_doc", type=int, default=None)
    p.add_argument("--chunk_size", type=int, default=0, help="feed windows in chunks of this many tokens (0: whole)")
    p.add_argument("--carry_state", action="store_true", help="carry the cache across windows of a document")
    p.add_argument("--batch_size", type=int, default=None, help="windows (lm, default 1) or sequences (mqar, 32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    mqar = p.add_argument_group("--task mqar (training.tasks.mqar)")
    mqar.add_argument("--num_pairs", nargs="+", type=int, default=[8], help="key-value pairs per sequence")
    mqar.add_argument("--gap", type=int, default=None, help="filler after the pairs (default: layers x block_len)")
    mqar.add_argument("--num_keys", type=int, default=MQ.NUM_KEYS)
    mqar.add_argument("--num_values", type=int, default=MQ.NUM_VALUES)
    mqar.add_argument("--examples", type=int, default=MQ.EXAMPLES, help="held-out sequences per cell")
    mqar.add_argument("--seed", type=int, default=0, help="held-out stream (never a training stream's seed)")
    args = p.parse_args(argv)
    if args.task == "mqar":
        return main_mqar(args)
    args.lengths = args.lengths or [512, 4096, 16384, 65536]
    args.batch_size = args.batch_size or 1

    docs = D.load_documents(
        args.dataset,
        args.split,
        path=args.dataset_path,
        name=args.dataset_config,
        data_files=args.data_files,
        streaming=args.streaming,
        text_column=args.text_column,
    )
    texts = list(itertools.islice(D.texts_of(docs), args.max_docs))
    report = {
        "dataset": {
            "dataset": args.dataset,
            "path": args.dataset_path,
            "split": args.split,
            "documents": len(texts),
            "max_tokens_per_doc": args.max_tokens_per_doc,
        },
        "settings": {
            "lengths": args.lengths,
            "chunk_size": args.chunk_size,
            "carry_state": args.carry_state,
            "dtype": args.dtype,
            "device": args.device,
        },
        "models": [],
    }
    for path in args.model:
        print(f"evaluating {path} on {len(texts)} {args.dataset}/{args.split} documents")
        model, tokenizer = load_model(path, args.device, args.dtype)
        results = evaluate_model(
            model,
            tokenizer,
            texts,
            args.lengths,
            chunk_size=args.chunk_size,
            carry_state=args.carry_state,
            batch_size=args.batch_size,
            max_tokens_per_doc=args.max_tokens_per_doc,
            progress=True,
        )
        report["models"].append(
            {
                "name": Path(path).name if Path(path).name != "final" else Path(path).parent.name,
                "path": str(path),
                "parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer),
                "results": results,
            }
        )
        del model
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = args.plot or str(out.with_suffix(".png"))
    report["plot"] = plot(report, png)
    out.write_text(json.dumps(report, indent=1))
    print(f"evaluation: {out}  plot: {png}")
    return report


def main_mqar(args: argparse.Namespace) -> dict:
    """``--task mqar``: each model's accuracy and loss per (length, pairs) cell, into ``--output``."""
    from transformers import AutoModelForCausalLM

    import modeling_bst  # noqa: F401  (registers model_type "bst")

    lengths = args.lengths or [256]
    batch_size = args.batch_size or 32
    report = {
        "task": "mqar",
        "settings": {
            "lengths": lengths,
            "num_pairs": args.num_pairs,
            "gap": args.gap,
            "num_keys": args.num_keys,
            "num_values": args.num_values,
            "examples": args.examples,
            "seed": args.seed,
            "dtype": args.dtype,
            "device": args.device,
        },
        "models": [],
    }
    for path in args.model:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)
        results = MQ.evaluate_model(
            model, lengths, args.num_pairs, args.gap, args.num_keys, args.num_values, args.examples, args.seed,
            batch_size,
        )  # fmt: skip
        for row in results:
            shown = f"accuracy {row['accuracy']:.4f}  loss {row['loss']:.4f}" if "accuracy" in row else row["error"]
            print(f"{path}: L={row['length']} N={row['num_pairs']} gap {row['gap']}: {shown}")
        name = Path(path).name if Path(path).name != "final" else Path(path).parent.name
        report["models"].append(
            {"name": name, "path": str(path), "parameters": sum(p.numel() for p in model.parameters()),
             "results": results}
        )  # fmt: skip
        del model
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"evaluation: {out}")
    return report


if __name__ == "__main__":
    main()
