"""ListOps (Nangia & Bowman 2018) as specified by the Long Range Arena (Tay et al. 2021), written from the spec.

An expression is a nested list of operators over the digits 0-9::

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]      -> 5

Operators: ``[MAX``, ``[MIN``, ``[MED`` (median) and ``[SM`` (sum modulo 10); ``]`` closes a list. The target is
the value of the whole expression, a digit (10 classes).

Sampling follows the LRA generator's distribution:

* the root sits at depth 1; a node at depth < ``max_depth`` (10) is an operator with probability ``p_op`` (0.25),
  otherwise a uniformly drawn digit; a node at depth ``max_depth`` is always a digit;
* an operator is drawn uniformly from the four and gets ``randint(2, max_args)`` arguments (``max_args`` = 10);
* the length is the number of tokens (operators, digits and ``]``, no parentheses); an expression is kept if
  ``min_length <= length <= max_length`` (LRA: 500 < length < 2000; we use inclusive bounds) and if it was not
  drawn before, so that train / val / test never share an expression (LRA draws a set, then splits it).
  A sample that outgrows ``max_length`` is abandoned as soon as it does, which leaves the accepted distribution
  unchanged (length only grows while a tree is drawn).

Median (``[MED``): LRA evaluates ``int(np.median(args))``. For an odd number of arguments that is the middle value;
for an even number it is the mean of the two middle values truncated towards zero, i.e. ``(a + b) // 2`` for the
digits here. We implement exactly that (not the lower or upper median); ``SM`` is ``sum(args) % 10``.

Vocabulary (tokenizer-free): id 0 is padding, ids 1..15 are ``[MAX [MIN [MED [SM ]`` and the digits ``0``-``9``.

Files: a split is JSONL (``{"source": "...", "target": 3}`` per line) or TSV with a ``Source\\tTarget`` header (the
LRA layout; LRA's own files wrap every node in ``(``/``)``, which :func:`tokenize` drops, so the original
``basic_{train,val,test}.tsv`` files load as well).

Training: ListOps is a task of ``training.train`` (``task: listops`` in a recipe, configs/train/listops-*.yaml); this
module gives it its examples (:class:`ListOpsDataset`, :func:`task_splits`), batches (:class:`PaddingCollator`), the
classifier's config (:func:`classifier_config`) and its metric (:func:`compute_accuracy`)::

    python -m training.train --config configs/train/listops-tiny.yaml

CLI::

    python -m training.tasks.listops generate --out DIR --train 96000 --val 2000 --test 2000 --max-length 2000
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable, Sequence


MAX, MIN, MED, SUM_MOD = "[MAX", "[MIN", "[MED", "[SM"
OPERATORS = (MAX, MIN, MED, SUM_MOD)
END = "]"
DIGITS = tuple(str(d) for d in range(10))
PAD_TOKEN = "<pad>"
VOCAB = (PAD_TOKEN, *OPERATORS, END, *DIGITS)
PAD_ID = 0
VOCAB_SIZE = len(VOCAB)  # 16
NUM_CLASSES = 10
TOKEN_TO_ID = {tok: i for i, tok in enumerate(VOCAB)}

# LRA defaults.
DEFAULT_MAX_DEPTH = 10
DEFAULT_MAX_ARGS = 10
DEFAULT_P_OP = 0.25
DEFAULT_MIN_LENGTH = 500
DEFAULT_MAX_LENGTH = 2000
SPLITS = ("train", "val", "test")


# --------------------------------------------------------------------------------------------------------------------
# Tokens and vocabulary
# --------------------------------------------------------------------------------------------------------------------
def tokenize(source: str | Sequence[str]) -> list[str]:
    """Whitespace tokens of an expression; LRA's ``(`` / ``)`` grouping tokens are dropped."""
    tokens = source.split() if isinstance(source, str) else list(source)
    return [t for t in tokens if t not in ("(", ")")]


def encode(source: str | Sequence[str]) -> list[int]:
    """Token ids (1..15) of an expression string or token list. Unknown tokens raise ``ValueError``."""
    ids = []
    for tok in tokenize(source):
        if tok not in TOKEN_TO_ID or tok == PAD_TOKEN:
            raise ValueError(f"Unknown ListOps token {tok!r}.")
        ids.append(TOKEN_TO_ID[tok])
    return ids


def decode(ids: Iterable[int], skip_pad: bool = True) -> str:
    """Inverse of :func:`encode`: ids to a space-separated expression (padding dropped unless ``skip_pad=False``)."""
    out = []
    for i in ids:
        i = int(i)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"Token id {i} outside the ListOps vocabulary [0, {VOCAB_SIZE}).")
        if i == PAD_ID and skip_pad:
            continue
        out.append(VOCAB[i])
    return " ".join(out)


# --------------------------------------------------------------------------------------------------------------------
# Exact evaluation
# --------------------------------------------------------------------------------------------------------------------
def apply_operator(op: str, args: Sequence[int]) -> int:
    """Value of one operator on its (already evaluated) digit arguments."""
    if not args:
        raise ValueError(f"Operator {op} has no arguments.")
    if op == MAX:
        return max(args)
    if op == MIN:
        return min(args)
    if op == MED:
        s = sorted(args)
        n = len(s)
        if n % 2:
            return s[n // 2]
        return (s[n // 2 - 1] + s[n // 2]) // 2  # int(np.median(args)) for non-negative integers
    if op == SUM_MOD:
        return sum(args) % 10
    raise ValueError(f"Unknown operator {op!r}.")


def evaluate(source: str | Sequence[str]) -> int:
    """Exact value of an expression (iterative, any depth). Malformed input raises ``ValueError``."""
    tokens = tokenize(source)
    if not tokens:
        raise ValueError("Empty expression.")
    stack: list[tuple[str, list[int]]] = []
    result = None
    for pos, tok in enumerate(tokens):
        if result is not None:
            raise ValueError(f"Trailing tokens after the complete expression at position {pos}: {tok!r}.")
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == END:
            if not stack:
                raise ValueError(f"Unmatched ']' at position {pos}.")
            op, args = stack.pop()
            value = apply_operator(op, args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
        elif tok in DIGITS:
            if stack:
                stack[-1][1].append(int(tok))
            elif pos == 0 and len(tokens) == 1:
                result = int(tok)
            else:
                raise ValueError(f"Digit outside any list at position {pos}.")
        else:
            raise ValueError(f"Unknown ListOps token {tok!r} at position {pos}.")
    if stack or result is None:
        raise ValueError("Unclosed list: the expression ends inside an operator.")
    return result


def depth(source: str | Sequence[str]) -> int:
    """Nesting depth in the generator's convention: a bare digit is 1, ``[MAX 1 2 ]`` is 2."""
    d = best = 0
    for tok in tokenize(source):
        if tok in OPERATORS:
            d += 1
            best = max(best, d)
        elif tok == END:
            d -= 1
    return best + 1


# --------------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------------
class _TooLong(Exception):
    pass


def _sample_node(rng: random.Random, level: int, max_depth: int, max_args: int, p_op: float, out: list, budget: int):
    """Append the tokens of one node to ``out``; raise ``_TooLong`` once ``len(out)`` passes ``budget``."""
    if level < max_depth and rng.random() < p_op:
        n_args = rng.randint(2, max_args)
        out.append(rng.choice(OPERATORS))
        # The operator needs at least n_args + 1 more tokens: abandon early if that cannot fit.
        if len(out) + n_args + 1 > budget:
            raise _TooLong
        for _ in range(n_args):
            _sample_node(rng, level + 1, max_depth, max_args, p_op, out, budget)
        out.append(END)
        if len(out) > budget:
            raise _TooLong
    else:
        out.append(DIGITS[rng.randrange(10)])


def sample_expression(
    rng: random.Random,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_args: int = DEFAULT_MAX_ARGS,
    p_op: float = DEFAULT_P_OP,
) -> list[str] | None:
    """One draw of the LRA tree distribution as a token list, or ``None`` if it exceeds ``max_length`` tokens."""
    out: list[str] = []
    try:
        _sample_node(rng, 1, max_depth, max_args, p_op, out, max_length)
    except _TooLong:
        return None
    return out


def generate_examples(
    n: int,
    seed: int = 0,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_args: int = DEFAULT_MAX_ARGS,
    p_op: float = DEFAULT_P_OP,
    exclude: set | None = None,
    max_draws: int | None = None,
    rng: random.Random | None = None,
) -> list[dict]:
    """``n`` distinct examples ``{"source", "target", "length"}`` with ``min_length <= length <= max_length``.

    Deterministic given ``seed`` (or the state of ``rng``). Sources in ``exclude`` are skipped, and accepted sources
    are added to it. Raises ``RuntimeError`` after ``max_draws`` draws (default ``max(10**6, 2000 * n)``).
    """
    if not 4 <= max_length:
        raise ValueError(f"max_length must be >= 4 (the shortest list, e.g. '[MAX 1 2 ]'), got {max_length}.")
    if min_length > max_length:
        raise ValueError(f"min_length={min_length} > max_length={max_length}.")
    if max_depth < 2 or max_args < 2 or not 0 < p_op <= 1:
        raise ValueError("Need max_depth >= 2, max_args >= 2 and 0 < p_op <= 1.")
    rng = rng if rng is not None else random.Random(seed)
    seen = exclude if exclude is not None else set()
    max_draws = max_draws if max_draws is not None else max(10**6, 2000 * n)
    examples = []
    draws = 0
    while len(examples) < n:
        draws += 1
        if draws > max_draws:
            raise RuntimeError(
                f"Only {len(examples)}/{n} examples in [{min_length}, {max_length}] tokens after {max_draws} draws."
            )
        tokens = sample_expression(rng, max_length, max_depth, max_args, p_op)
        if tokens is None or len(tokens) < min_length or len(tokens) == 1:
            continue
        source = " ".join(tokens)
        if source in seen:
            continue
        seen.add(source)
        examples.append({"source": source, "target": evaluate(tokens), "length": len(tokens)})
    return examples


def generate_splits(sizes: dict[str, int], seed: int = 0, **kwargs) -> dict[str, list[dict]]:
    """Disjoint splits (no expression occurs twice) drawn from one seeded stream, in the order of ``sizes``."""
    rng = random.Random(seed)
    seen: set = set()
    return {name: generate_examples(n, rng=rng, exclude=seen, **kwargs) for name, n in sizes.items()}


# --------------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------------
def write_split(path: str, examples: Sequence[dict]) -> None:
    """Write examples as JSONL (``.jsonl``) or TSV with a ``Source\\tTarget`` header (``.tsv``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            for ex in examples:
                f.write(json.dumps({"source": ex["source"], "target": int(ex["target"])}) + "\n")
    elif path.endswith(".tsv"):
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["Source", "Target"])
            for ex in examples:
                writer.writerow([ex["source"], int(ex["target"])])
    else:
        raise ValueError(f"Unknown split format for {path!r}: use .jsonl or .tsv.")


def read_split(path: str) -> list[dict]:
    """Read a JSONL or TSV split (also LRA's own TSV files, whose parentheses are dropped)."""
    examples = []
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        pairs = [(r["source"], r["target"]) for r in rows]
    elif path.endswith(".tsv"):
        with open(path, newline="") as f:
            reader = csv.reader(f, delimiter="\t")
            header = next(reader)
            if [h.strip().lower() for h in header[:2]] != ["source", "target"]:
                raise ValueError(f"{path}: expected a 'Source\\tTarget' header, got {header}.")
            pairs = [(row[0], row[1]) for row in reader if row]
    else:
        raise ValueError(f"Unknown split format for {path!r}: use .jsonl or .tsv.")
    for source, target in pairs:
        tokens = tokenize(source)
        examples.append({"source": " ".join(tokens), "target": int(target), "length": len(tokens)})
    return examples


def find_split_file(data_dir: str, split: str) -> str:
    """``DIR/{split}.jsonl``, ``DIR/{split}.tsv`` or LRA's ``DIR/basic_{split}.tsv``."""
    for name in (f"{split}.jsonl", f"{split}.tsv", f"basic_{split}.tsv"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"No {split} split in {data_dir} ({split}.jsonl, {split}.tsv or basic_{split}.tsv).")


def load_splits(data_dir: str, splits: Sequence[str] = SPLITS) -> dict[str, list[dict]]:
    return {split: read_split(find_split_file(data_dir, split)) for split in splits}


def split_stats(examples: Sequence[dict]) -> dict:
    """Size, length range / mean, label histogram and majority-class accuracy of a split."""
    if not examples:
        return {"n": 0}
    lengths = [ex["length"] for ex in examples]
    labels = Counter(int(ex["target"]) for ex in examples)
    return {
        "n": len(examples),
        "min_length": min(lengths),
        "max_length": max(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "label_counts": {str(k): labels.get(k, 0) for k in range(NUM_CLASSES)},
        "majority_class": labels.most_common(1)[0][0],
        "majority_accuracy": labels.most_common(1)[0][1] / len(examples),
    }


# --------------------------------------------------------------------------------------------------------------------
# The training task (training.train, ``task: listops``)
# --------------------------------------------------------------------------------------------------------------------
# The classifier of the paper's LRA setup (App. D): bidirectional BST layers (every layer, unless the recipe says
# otherwise) followed by two S4 layers, mean pooling over real tokens, a linear head. A recipe's model_overrides win.
MODEL_DEFAULTS = {"bidirectional": True, "num_s4_head_layers": 2}


TASK_FIELDS = {"vocab_size": VOCAB_SIZE, "pad_token_id": PAD_ID}  # fixed by the task; num_labels = NUM_CLASSES


def classifier_fields(overrides: dict, max_length: int, num_hidden_layers: int | None = None) -> dict:
    """:data:`MODEL_DEFAULTS` and ``max_position_embeddings = max_length`` under ``overrides``; with
    ``num_hidden_layers`` (the base config's, for a model not built from a preset) and no ``bst_layer_indices`` in
    ``overrides``, every layer is a BST layer."""
    fields = {**MODEL_DEFAULTS, "max_position_embeddings": max_length, **overrides}
    if num_hidden_layers is not None:
        fields.setdefault("bst_layer_indices", list(range(fields.get("num_hidden_layers", num_hidden_layers))))
    return fields


def classifier_config(overrides: dict, max_length: int, base=None):
    """The ``BSTConfig`` of a ListOps classifier: ``base`` (a preset's config; default: ``BSTConfig`` defaults) with
    :func:`classifier_fields` applied, then the task's own fields (16-token vocabulary, 10 labels, padding id 0),
    which no override changes. ``training.train`` checks ``overrides`` first (unknown names, types, values)."""
    from modeling_bst import BSTConfig

    if base is None:
        fields = classifier_fields(overrides, max_length, BSTConfig().num_hidden_layers)
        return BSTConfig(**{**fields, **TASK_FIELDS, "num_labels": NUM_CLASSES})
    # from_dict: the layer fields among them make the config (they cannot be assigned to one), the others are set
    config = type(base).from_dict(base.to_dict(), **classifier_fields(overrides, max_length), **TASK_FIELDS)
    config.num_labels = NUM_CLASSES
    return config


def task_splits(
    data_dir: str | None,
    sizes: dict[str, int],
    seed: int = 0,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
    **shape,
) -> dict[str, list[dict]]:
    """The train / val / test examples: read from ``data_dir`` when given, else generated (``sizes``, ``seed``,
    length bounds and ``max_depth`` / ``max_args`` / ``p_op``)."""
    if data_dir:
        return load_splits(data_dir)
    return generate_splits(sizes, seed=seed, min_length=min_length, max_length=max_length, **shape)


class ListOpsDataset:
    """Examples ``{"source", "target"}`` as ``{"input_ids": list[int], "labels": int}`` (a map-style dataset)."""

    def __init__(self, examples: Sequence[dict]):
        self.input_ids = [encode(ex["source"]) for ex in examples]
        self.labels = [int(ex["target"]) for ex in examples]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class PaddingCollator:
    """Pads ``input_ids`` with ``pad_id`` on the right (or left) and builds ``attention_mask``."""

    def __init__(self, pad_id: int = PAD_ID, side: str = "right", pad_to_multiple_of: int | None = None):
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
        self.pad_id, self.side, self.multiple = pad_id, side, pad_to_multiple_of

    def __call__(self, features: Sequence[dict]):
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        if self.multiple:
            longest = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(features), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            sl = slice(0, n) if self.side == "right" else slice(longest - n, longest)
            ids[row, sl] = torch.as_tensor(f["input_ids"], dtype=torch.long)
            mask[row, sl] = 1
        batch = {"input_ids": ids, "attention_mask": mask}
        if "labels" in features[0]:
            batch["labels"] = torch.as_tensor([int(f["labels"]) for f in features], dtype=torch.long)
        return batch


def argmax_logits(logits, labels):
    """``preprocess_logits_for_metrics``: keep the predicted class, not the logits."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(-1)


def compute_accuracy(eval_pred) -> dict:
    """``compute_metrics``: accuracy of the predicted classes."""
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    return {"accuracy": float((preds == labels).mean())}


def baselines(stats: dict[str, dict]) -> dict:
    """Constant-prediction baselines of the test split: chance, the test majority class, and the honest one (always
    predict the most frequent *training* label)."""
    test, train = stats.get("test", {}), stats.get("train", {})
    out = {"chance_accuracy": 1.0 / NUM_CLASSES}
    if test.get("n"):
        out["test_majority_accuracy"] = test["majority_accuracy"]
        if train.get("n"):
            out["test_accuracy_of_train_majority_class"] = (
                test["label_counts"][str(train["majority_class"])] / test["n"]
            )
    return out


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.tasks.listops", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate train/val/test splits")
    gen.add_argument("--out", required=True, help="output directory")
    gen.add_argument("--train", type=int, default=96000)
    gen.add_argument("--val", type=int, default=2000)
    gen.add_argument("--test", type=int, default=2000)
    gen.add_argument("--min-length", type=int, default=DEFAULT_MIN_LENGTH)
    gen.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH)
    gen.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH)
    gen.add_argument("--max-args", type=int, default=DEFAULT_MAX_ARGS)
    gen.add_argument("--p-op", type=float, default=DEFAULT_P_OP, help="probability that a node is an operator")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--format", choices=("jsonl", "tsv"), default="jsonl")
    stats = sub.add_parser("stats", help="print statistics of the splits in a directory")
    stats.add_argument("data_dir")
    args = parser.parse_args(argv)

    if args.command == "generate":
        params = {
            "min_length": args.min_length,
            "max_length": args.max_length,
            "max_depth": args.max_depth,
            "max_args": args.max_args,
            "p_op": args.p_op,
        }
        splits = generate_splits({"train": args.train, "val": args.val, "test": args.test}, seed=args.seed, **params)
        meta = {"seed": args.seed, **params, "splits": {}}
        for name, examples in splits.items():
            path = os.path.join(args.out, f"{name}.{args.format}")
            write_split(path, examples)
            meta["splits"][name] = split_stats(examples)
            print(f"wrote {len(examples)} examples to {path}", file=sys.stderr)
        with open(os.path.join(args.out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        print(json.dumps({k: {kk: v[kk] for kk in ("n", "mean_length")} for k, v in meta["splits"].items()}))
    elif args.command == "stats":
        out = {}
        for split in SPLITS:
            try:
                out[split] = split_stats(read_split(find_split_file(args.data_dir, split)))
            except FileNotFoundError:
                continue
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
