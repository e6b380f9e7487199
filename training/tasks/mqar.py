"""Multi-query associative recall (MQAR, after the "Zoology" study): a synthetic recall task that a model trained on it
can be scored on, with every query placed beyond a chosen gap from its key-value pair.

Sequence format (:func:`make_batch`; length L, N pairs, gap G; vocabulary ``[FILLER, keys..., values...]``)::

    position  0 .. 2N-1       : k_1 v_1 k_2 v_2 ... k_N v_N      (N distinct keys, values drawn with replacement)
    position  2N .. 2N+G-1    : FILLER                           (the gap)
    position  2N+G .. L-1     : FILLER with N query slots "k_i v_i" (every key queried once, random order,
                                slots at random even offsets of the query region, non-overlapping)

Only the value token of each query slot is scored: ``labels`` holds that value at its position and -100 elsewhere
(Hugging Face convention, shifted inside the model: the logits at the query key predict it). Accuracy (:func:`score`)
= fraction of queried values predicted exactly (argmax). Chance is ``1 / num_values`` for a model that guesses a value;
one that copies one of the N values of the sequence without binding it to its key scores about ``1 / N``.

Held-out sequences come from :func:`held_out_generator` (seed ``EVAL_SEED_OFFSET + seed``), never a training stream's
seed; the research protocol (``research/mqar.py``) trains on ``torch.Generator().manual_seed(seed)`` and reports its
accuracy on these sequences. A saved model (a folder ``from_pretrained`` loads) is scored with::

    python -m training.evaluate --task mqar --model MODEL_DIR --lengths 256 --num_pairs 8 --num_keys 32 \\
        --num_values 32 --output mqar.json
"""

from __future__ import annotations

import torch


FILLER = 0
EVAL_SEED_OFFSET = 1_000_003  # held-out streams: seed + this, never a training stream's seed
NUM_KEYS = NUM_VALUES = 32
EXAMPLES = 256


def vocab_size(num_keys: int, num_values: int) -> int:
    """Tokens the task uses: the filler, the keys, the values."""
    return 1 + num_keys + num_values


def default_gap(config) -> int:
    """The receptive field of a block-attention stack of the model's depth (``num_hidden_layers * block_len``: each
    layer attends to the W previous tokens), so that attention alone cannot reach a pair from its query; 0 for a
    model without ``block_len``."""
    block_len = getattr(config, "block_len", None)
    return int(config.num_hidden_layers * block_len) if block_len else 0


def check_layout(length: int, num_pairs: int, gap: int, num_keys: int) -> None:
    """ValueError unless ``num_pairs`` pairs, the gap and ``num_pairs`` query slots fit in ``length`` tokens."""
    if num_pairs > num_keys:
        raise ValueError(f"{num_pairs} pairs need at least as many keys (num_keys={num_keys})")
    if (length - 2 * num_pairs - gap) // 2 < num_pairs:
        raise ValueError(
            f"length {length} too short for {num_pairs} pairs with gap {gap}: needs {4 * num_pairs + gap} tokens"
        )


def make_batch(
    batch_size: int,
    length: int,
    num_pairs: int,
    gap: int,
    generator: torch.Generator,
    num_keys: int = 64,
    num_values: int = 64,
):
    """``(ids, labels, query_pos)``: MQAR sequences in the format of the module docstring.

    ``query_pos`` `(B, N)` are the positions of the queried keys (their value follows at ``query_pos + 1``; the
    pair of the key at ``query_pos[b, j]`` sits at positions ``2 i, 2 i + 1`` with ``ids[b, 2 i] == ids[b, q]``).
    """
    check_layout(length, num_pairs, gap, num_keys)
    start = 2 * num_pairs + gap
    slots = (length - start) // 2
    b = batch_size
    keys = torch.rand(b, num_keys, generator=generator).argsort(-1)[:, :num_pairs] + 1  # distinct per row
    values = torch.randint(0, num_values, (b, num_pairs), generator=generator) + 1 + num_keys
    ids = torch.full((b, length), FILLER, dtype=torch.long)
    ids[:, 0 : 2 * num_pairs : 2] = keys
    ids[:, 1 : 2 * num_pairs : 2] = values
    slot = torch.rand(b, slots, generator=generator).argsort(-1)[:, :num_pairs]  # distinct slots per row
    query_pos = start + 2 * slot
    which = torch.rand(b, num_pairs, generator=generator).argsort(-1)  # the pair each slot asks for
    rows = torch.arange(b)[:, None]
    ids[rows, query_pos] = keys.gather(1, which)
    ids[rows, query_pos + 1] = values.gather(1, which)
    labels = torch.full_like(ids, -100)
    labels[rows, query_pos + 1] = ids[rows, query_pos + 1]
    return ids, labels, query_pos


def held_out_generator(seed: int = 0) -> torch.Generator:
    """The generator of the held-out sequences of ``seed`` (never a training stream: ``EVAL_SEED_OFFSET + seed``)."""
    return torch.Generator().manual_seed(EVAL_SEED_OFFSET + seed)


@torch.no_grad()
def score(model, ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 32) -> tuple[float, float]:
    """(accuracy, loss) over the scored positions: exact argmax match of every queried value, mean cross-entropy.
    The model is left in train mode if it was in it."""
    training = model.training
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for i in range(0, len(ids), batch_size):
        x, y = ids[i : i + batch_size], labels[i : i + batch_size]
        logits = model(x).logits[:, :-1].float()
        target = y[:, 1:]
        mask = target != -100
        pred = logits.argmax(-1)
        correct += (pred[mask] == target[mask]).sum().item()
        total += mask.sum().item()
        loss_sum += torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
    model.train(training)
    return correct / total, loss_sum / total


def evaluate_model(
    model,
    lengths: list[int],
    num_pairs: list[int],
    gap: int | None = None,
    num_keys: int = NUM_KEYS,
    num_values: int = NUM_VALUES,
    examples: int = EXAMPLES,
    seed: int = 0,
    batch_size: int = 32,
) -> list[dict]:
    """One row per (length, pairs) cell: accuracy and loss on ``examples`` held-out sequences of seed ``seed``
    (``gap`` None: :func:`default_gap`). A cell whose layout does not fit, or whose tokens the model's vocabulary
    lacks, gives a row with ``error``."""
    device = next(model.parameters()).device
    gap = default_gap(model.config) if gap is None else gap
    rows = []
    for length in lengths:
        for pairs in num_pairs:
            row = {"length": length, "num_pairs": pairs, "gap": gap, "examples": examples, "seed": seed}
            try:
                if vocab_size(num_keys, num_values) > model.config.vocab_size:
                    raise ValueError(
                        f"{num_keys} keys and {num_values} values need {vocab_size(num_keys, num_values)} tokens; "
                        f"the model has {model.config.vocab_size}"
                    )
                ids, labels, _ = make_batch(
                    examples, length, pairs, gap, held_out_generator(seed), num_keys=num_keys, num_values=num_values
                )
            except ValueError as err:
                rows.append({**row, "error": str(err)})
                continue
            accuracy, loss = score(model, ids.to(device), labels.to(device), batch_size)
            rows.append({**row, "accuracy": accuracy, "loss": loss, "chance": 1.0 / num_values})
    return rows
