"""Long-range recall: a key at the start of a sequence must be recalled at its end, more than 2W tokens later.

Block attention sees at most the W previous tokens (two blocks), so a Slide model cannot solve it; a BST layer's
SSM carries the key to the end through the context states. Run ``python -m research.long_range_recall`` for a
table over distances; ``research/tests/test_recall.py`` runs one small case.
"""

import argparse
import json
import time

import torch

import modeling_bst  # noqa: F401
from modeling_bst import BSTConfig, BSTForCausalLM
from training.optim import decay_everything, parameter_groups


NUM_KEYS, NUM_FILLERS = 8, 8
QUERY = NUM_KEYS + NUM_FILLERS
VOCAB = QUERY + 1


def make_batch(batch_size: int, length: int, generator: torch.Generator):
    """``[key, filler * (length - 3), QUERY, key]``; only the final key is a target."""
    key = torch.randint(0, NUM_KEYS, (batch_size,), generator=generator)
    filler = torch.randint(NUM_KEYS, NUM_KEYS + NUM_FILLERS, (batch_size, length - 3), generator=generator)
    query = torch.full((batch_size, 1), QUERY)
    ids = torch.cat([key[:, None], filler, query, key[:, None]], 1)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = key
    return ids, labels


def train_and_eval(bst: bool, length: int = 48, block_len: int = 8, steps: int = 300, seed: int = 0, lr: float = 3e-3):
    """Train a 2-layer model (one BST layer at the bottom, or none: Slide); return recall accuracy on 256 fresh
    sequences and the final training loss."""
    torch.manual_seed(seed)
    config = BSTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=length,
        block_len=block_len,
        bst_layer_indices=[0] if bst else [],
        dropout=0.0,
        attention_dropout=0.0,
        logit_scale=1.0,
    )
    model = BSTForCausalLM(config)
    # SSM parameters without weight decay, everything else (1-D parameters included) with AdamW's default 0.01; one lr
    groups = parameter_groups(model, lr, 0.01, ssm_lr=lr, no_decay=decay_everything)
    optimizer = torch.optim.AdamW(groups, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, labels = make_batch(32, length, generator)
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    ids, _ = make_batch(256, length, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        prediction = model(ids).logits[:, -2].argmax(-1)
    return (prediction == ids[:, -1]).float().mean().item(), loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 48, 96, 192])
    parser.add_argument("--block-len", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--output", default="research/results/long_range_recall.json")
    args = parser.parse_args()
    rows = []
    print(f"{'length':>6} {'distance/2W':>11} {'model':>6} {'seed':>4} {'accuracy':>8} {'seconds':>7}")
    for length in args.lengths:
        for bst in (True, False):
            for seed in range(args.seeds):
                start = time.perf_counter()
                acc, loss = train_and_eval(bst, length, args.block_len, args.steps, seed)
                row = dict(length=length, model="BST:SH:S4" if bst else "Slide", seed=seed, accuracy=acc, loss=loss)
                rows.append(row)
                ratio = (length - 2) / (2 * args.block_len)
                name = row["model"][:6]
                print(
                    f"{length:>6} {ratio:>11.1f} {name:>6} {seed:>4} {acc:>8.3f} {time.perf_counter() - start:>7.1f}"
                )
    from pathlib import Path

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"block_len": args.block_len, "steps": args.steps, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
