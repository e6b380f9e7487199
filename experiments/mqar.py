"""Multi-query associative recall (MQAR) beyond the attention window: every model family against sequence length and
number of key-value pairs (issue #13, part 2).

MQAR (the "Zoology" study of attention vs gated convolutions / SSMs) asks a model to retrieve many key-value pairs
seen earlier in the sequence. Here every query lies beyond the receptive field of the Slide stack from its pair, so
block attention alone cannot solve it; the SSM / recurrent / GSS paths must carry the pairs.

Sequence format (``make_batch``; length L, N pairs, gap G; vocabulary ``[FILLER, keys..., values...]``)::

    position  0 .. 2N-1       : k_1 v_1 k_2 v_2 ... k_N v_N      (N distinct keys, values drawn with replacement)
    position  2N .. 2N+G-1    : FILLER                           (the gap)
    position  2N+G .. L-1     : FILLER with N query slots "k_i v_i" (every key queried once, random order,
                                slots at random even offsets of the query region, non-overlapping)

Only the value token of each query slot is scored: ``labels`` holds that value at its position and -100 elsewhere
(Hugging Face convention, shifted inside the model: the logits at the query key predict it). Accuracy = fraction of
queried values predicted exactly (argmax) on held-out sequences drawn from a separate seed. G defaults to the
receptive field of a Slide stack of the same depth (``num_layers * block_len``: each layer attends to exactly the W
previous tokens), so a query key is more than ``num_layers * W`` tokens after its pair; ``tests/test_mqar.py``
checks with gradients that a Slide model's scored logits do not depend on the pairs at all.

Models (``MODELS``): the tiny presets of ``configs/models/`` with width, depth-preserving layer layout, block length,
vocabulary and training length overridden, plus Hugging Face ``MambaForCausalLM`` of the same width and depth (the
outside reference; transformers' pure-PyTorch path, with ``use_mambapy`` when the ``mambapy`` package is
installed: its parallel scan, since the sequential loop's backward is quadratic in L). Training: AdamW (SSM
parameters at ``config.ssm_lr``, no weight decay, as in ``training.train``), linear warm-up + cosine decay, fresh
random sequences every step; one run per (model, length, pairs, budget, seed) writes
``docs/results/mqar/<model>-L<length>-N<pairs>-<steps>x<batch>-s<seed>.json`` with the command and git commit. Runs whose JSON exists are skipped, so the same command resumes or extends a grid::

    python -m experiments.mqar                                   # the default grid, then the report
    python -m experiments.mqar --models slide bst-sh-s4 --lengths 512 --pairs 16 --steps 400
    python -m experiments.mqar --report-only                     # table + plot into docs/results.md (``mqar``)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "mqar"
PNG = ROOT / "docs" / "results" / "mqar.png"
PRESETS = ROOT / "configs" / "models"

FILLER = 0

# name -> (label, preset under configs/models/ or None for HF Mamba)
MODELS = {
    "slide": ("Slide", "slide-tiny"),
    "bst-sh-s4": ("BST:SH:S4", "bst-tiny-sh-s4"),
    "bst-mh-s4": ("BST:MH:S4", "bst-tiny-mh-s4"),
    "bst-mf-s4": ("BST:MF:S4", "bst-tiny-mf-s4"),
    "bst-sh-unstruct": ("BST:SH:unstruct", "bst-tiny-sh-unstruct"),
    "brect": ("BRecT:fixed:skip", "brect-tiny"),
    "gss-hybrid": ("GSS-Hybrid", "gss-hybrid-tiny"),
    "mamba": ("Mamba (HF)", None),
}

# Default grid: every length at one pair count, and every pair count at one length (fits ~1 h on one CPU thread
# at the default step budget; a GPU or later sessions can extend it with --lengths/--pairs, finished runs are kept).
LENGTHS = (256, 512, 1024, 2048)
PAIRS_AT_LENGTHS = 16
PAIRS = (4, 16, 64)
LENGTH_FOR_PAIRS = 512
# Default budget per run, the same for every model: what fits one CPU thread in ~1 h for the BST family (far from
# converged; see docs/results.md). On a GPU pass e.g. --steps 2000 --batch-size 64 --device cuda.
STEPS, BATCH = 50, 8


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------
def vocab_size(num_keys: int, num_values: int) -> int:
    return 1 + num_keys + num_values


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
    if num_pairs > num_keys:
        raise ValueError(f"{num_pairs} pairs need at least as many keys (num_keys={num_keys})")
    start = 2 * num_pairs + gap
    slots = (length - start) // 2
    if slots < num_pairs:
        raise ValueError(
            f"length {length} too short for {num_pairs} pairs with gap {gap}: needs {start + 2 * num_pairs} tokens"
        )
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


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------
def _scale_indices(indices: list[int], old_layers: int, new_layers: int) -> list[int]:
    """Map a preset's layer layout onto ``new_layers`` layers (keeps the relative placement; distinct indices)."""
    if new_layers == old_layers:
        return list(indices)
    out = sorted({min(new_layers - 1, (i * new_layers) // old_layers) for i in indices})
    return out


def build_config(
    model: str, hidden: int, layers: int, block_len: int, length: int, vocab: int, state_size: int = 16
) -> dict:
    """The model's config as a dict: the preset with width/depth/block length/vocabulary/length overridden."""
    label, preset = MODELS[model]
    if preset is None:  # HF Mamba: same width and depth, SSM state as the BST presets, no dropout
        return dict(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            state_size=state_size,
            expand=2,
            conv_kernel=4,
            # mambapy's parallel scan (pip install mambapy) when installed; else transformers' sequential loop,
            # whose backward is quadratic in the length (~100 s per step at L = 256 on one CPU thread)
            use_mambapy=importlib.util.find_spec("mambapy") is not None,
            pad_token_id=FILLER,
            bos_token_id=FILLER,
            eos_token_id=FILLER,
        )
    cfg = json.loads((PRESETS / f"{preset}.json").read_text())
    old = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    for key in ("bst_layer_indices", "recurrent_layer_indices", "gss_layer_indices"):
        if cfg.get(key):
            cfg[key] = _scale_indices(cfg[key], old, layers)
    cfg.update(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        block_len=block_len,
        max_position_embeddings=length,
        ssm_state_size=state_size,
        num_recurrent_states=min(cfg.get("num_recurrent_states", 32), block_len),
        dropout=0.0,
        attention_dropout=0.0,
    )
    return cfg


def build_model(config: dict, model: str):
    if MODELS[model][1] is None:
        from transformers import MambaConfig, MambaForCausalLM

        return MambaForCausalLM(MambaConfig(**config))
    import modeling_bst  # noqa: F401  (registers "bst")
    from modeling_bst import BSTConfig, BSTForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    return BSTForCausalLM(BSTConfig(**cfg))


def parameter_groups(model, lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: SSM parameters (BST's ``ssm_parameter_names``; Mamba's A_log, D, dt bias as in its paper) at
    ``ssm_lr`` without weight decay; biases, norms and embeddings without weight decay; the rest with it."""
    if hasattr(model, "ssm_parameter_names"):
        ssm = set(model.ssm_parameter_names())
        ssm_lr = getattr(model.config, "ssm_lr", lr)
    else:
        ssm = {n for n, _ in model.named_parameters() if n.endswith(("A_log", ".D", "dt_proj.bias"))}
        ssm_lr = lr
    groups = {"decay": [], "no_decay": [], "ssm": []}
    for name, p in model.named_parameters():
        if name in ssm:
            groups["ssm"].append(p)
        elif p.ndim < 2 or "norm" in name or "embed" in name:
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    return [
        {"params": groups["decay"], "lr": lr, "weight_decay": weight_decay},
        {"params": groups["no_decay"], "lr": lr, "weight_decay": 0.0},
        {"params": groups["ssm"], "lr": ssm_lr, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 32) -> tuple[float, float]:
    """(accuracy, loss) over the scored positions: exact argmax match of every queried value."""
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
    model.train()
    return correct / total, loss_sum / total


def train_and_eval(
    model: str,
    length: int,
    num_pairs: int,
    *,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    warmup: int | None = None,
    hidden: int = 64,
    layers: int = 4,
    block_len: int = 32,
    gap: int | None = None,
    num_keys: int = 64,
    num_values: int = 64,
    eval_examples: int = 256,
    seed: int = 0,
    log_every: int = 0,
    device: str = "cpu",
) -> dict:
    """Train one model on fresh MQAR batches for ``steps`` AdamW steps; return a result record (accuracy on
    ``eval_examples`` held-out sequences, losses, parameters, timing)."""
    gap = layers * block_len if gap is None else gap
    warmup = max(1, steps // 10) if warmup is None else warmup
    torch.manual_seed(seed)
    vocab = vocab_size(num_keys, num_values)
    config = build_config(model, hidden, layers, block_len, length, vocab)
    net = build_model(config, model).to(device)
    net.train()
    optimizer = torch.optim.AdamW(parameter_groups(net, lr, weight_decay), betas=(0.9, 0.98))
    base = [g["lr"] for g in optimizer.param_groups]

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    data = torch.Generator().manual_seed(seed)
    batch = dict(length=length, num_pairs=num_pairs, gap=gap, num_keys=num_keys, num_values=num_values)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group, lr0 in zip(optimizer.param_groups, base):
            group["lr"] = lr0 * schedule(step)
        ids, labels, _ = make_batch(batch_size, generator=data, **batch)
        loss = net(ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  step {step + 1}: loss {sum(losses[-log_every:]) / log_every:.3f}", flush=True)
    train_seconds = time.perf_counter() - t0
    held_out = torch.Generator().manual_seed(1_000_003 + seed)  # never the training stream
    ids, labels, _ = make_batch(eval_examples, generator=held_out, **batch)
    accuracy, eval_loss = evaluate(net, ids.to(device), labels.to(device))
    tail = losses[-max(1, steps // 10) :]
    return {
        "model": model,
        "label": MODELS[model][0],
        "length": length,
        "num_pairs": num_pairs,
        "seed": seed,
        "accuracy": accuracy,
        "chance": 1.0 / num_values,
        "eval_loss": eval_loss,
        "final_train_loss": sum(tail) / len(tail),
        "train_losses": [round(sum(losses[i : i + 10]) / len(losses[i : i + 10]), 4) for i in range(0, steps, 10)],
        "parameters": sum(p.numel() for p in net.parameters()),
        "train_seconds": round(train_seconds, 1),
        "settings": {
            "steps": steps,
            "batch_size": batch_size,
            "examples": steps * batch_size,
            "lr": lr,
            "weight_decay": weight_decay,
            "warmup": warmup,
            "hidden_size": hidden,
            "num_layers": layers,
            "block_len": block_len,
            "gap": gap,
            "num_keys": num_keys,
            "num_values": num_values,
            "eval_examples": eval_examples,
            "torch_threads": torch.get_num_threads(),
            "device": device,
        },
        "config": config,
    }


# --------------------------------------------------------------------------------------------------------------------
# Grid, records, report
# --------------------------------------------------------------------------------------------------------------------
def run_name(model: str, length: int, pairs: int, seed: int, steps: int, batch_size: int) -> str:
    return f"{model}-L{length}-N{pairs}-{steps}x{batch_size}-s{seed}"


def budget_of(record: dict) -> str:
    """Runs are compared only within one budget: steps x batch size (the same for every model)."""
    return f"{record['settings']['steps']}x{record['settings']['batch_size']}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def uncommitted(paths=("modeling_bst", "experiments/mqar.py")) -> list[str]:
    """Files under ``paths`` that differ from the recorded commit (the run used the working tree)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return [line[3:] for line in out.stdout.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return []


def grid(lengths, pairs, length_for_pairs, pairs_at_lengths) -> list[tuple[int, int]]:
    """(length, pairs) cells: every length at ``pairs_at_lengths`` pairs, every pair count at ``length_for_pairs``."""
    cells = [(n, pairs_at_lengths) for n in lengths] + [(length_for_pairs, p) for p in pairs]
    return list(dict.fromkeys(cells))


def load_results(results_dir: Path = RESULTS) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]


def _select(records: list[dict], model: str, length: int, pairs: int) -> list[dict]:
    return [r for r in records if r["model"] == model and r["length"] == length and r["num_pairs"] == pairs]


def _mean(records: list[dict]) -> float:
    return sum(r["accuracy"] for r in records) / len(records)


def _cell(records: list[dict], model: str, length: int, pairs: int) -> str:
    hits = _select(records, model, length, pairs)
    if not hits:
        return "–"
    text = f"{100 * _mean(hits):.1f}"
    if len(hits) > 1:
        accs = [100 * r["accuracy"] for r in hits]
        text += f" ({min(accs):.0f}–{max(accs):.0f}, {len(hits)} seeds)"
    return text


def plot(records: list[dict], path: Path, length_for_pairs: int, pairs_at_lengths: int) -> None:
    """Accuracy against length (at ``pairs_at_lengths`` pairs) and against pairs (at ``length_for_pairs``), one
    row of panels per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({budget_of(r) for r in records}, key=lambda b: [int(x) for x in b.split("x")])
    fig, axes = plt.subplots(len(budgets), 2, figsize=(11, 4 * len(budgets)), squeeze=False)
    for row, budget in zip(axes, budgets):
        mine = [r for r in records if budget_of(r) == budget]
        chance = 100 * mine[0]["chance"]
        for model, (label, _) in MODELS.items():
            style = "-" if model.startswith("bst") else "--"
            lengths = sorted({r["length"] for r in mine if r["model"] == model and r["num_pairs"] == pairs_at_lengths})
            pts = [(n, 100 * _mean(_select(mine, model, n, pairs_at_lengths))) for n in lengths]
            if pts:
                row[0].plot(*zip(*pts), style, marker="o", label=label)
            pairs = sorted({r["num_pairs"] for r in mine if r["model"] == model and r["length"] == length_for_pairs})
            pts = [(q, 100 * _mean(_select(mine, model, length_for_pairs, q))) for q in pairs]
            if pts:
                row[1].plot(*zip(*pts), style, marker="o", label=label)
        for ax, xlabel, title in (
            (row[0], "sequence length L", f"N = {pairs_at_lengths} pairs"),
            (row[1], "number of key-value pairs N", f"L = {length_for_pairs}"),
        ):
            ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("MQAR accuracy (%)")
            ax.set_ylim(-2, 102)
            ax.set_title(f"{title}, budget {budget} (steps x batch)")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _settings_line(records: list[dict]) -> str:
    s = records[0]["settings"]
    line = (
        f"{s['steps']} AdamW steps of {s['batch_size']} fresh sequences ({s['examples']} training examples) per run, "
        f"lr {s['lr']} (SSM parameters at the config's ssm_lr), warm-up {s['warmup']} + cosine, weight decay "
        f"{s['weight_decay']}; D = {s['hidden_size']}, {s['num_layers']} layers, W = {s['block_len']}, gap G = "
        f"{s['gap']}, {s['num_keys']} keys and {s['num_values']} values (chance {100 / s['num_values']:.1f}%), "
        f"accuracy over {s['eval_examples']} held-out sequences"
    )
    if len({json.dumps(r["settings"], sort_keys=True) for r in records}) > 1:
        line += " (some runs differ: see their JSON `settings`)"
    return line


def report(
    results_dir: Path = RESULTS,
    docs: Path | None = ROOT / "docs" / "results.md",
    length_for_pairs: int = LENGTH_FOR_PAIRS,
    pairs_at_lengths: int = PAIRS_AT_LENGTHS,
) -> str:
    """One accuracy table per budget (model x (L, N) cell) and the plot, into the ``mqar`` section of ``docs``
    (None: only returned and printed)."""
    from benchmarks.docs_section import cpu_name, write_section

    records = load_results(results_dir)
    if not records:
        raise SystemExit(f"no results under {results_dir}; run `python -m experiments.mqar` first")
    budgets = sorted({budget_of(r) for r in records}, key=lambda b: [int(x) for x in b.split("x")])
    tables = []
    for budget in budgets:
        mine = [r for r in records if budget_of(r) == budget]
        cells = sorted({(r["length"], r["num_pairs"]) for r in mine}, key=lambda c: (c[1] != pairs_at_lengths, c))
        lines = [
            f"Budget {budget}: {_settings_line(mine)}; {sum(r['train_seconds'] for r in mine) / 60:.0f} min of "
            f"training in all. Accuracy (%) on held-out sequences:",
            "",
            "| Model | Params | " + " | ".join(f"L={n} N={p}" for n, p in cells) + " |",
            "|---|---|" + "---|" * len(cells),
        ]
        for model, (label, _) in MODELS.items():
            rows = [r for r in mine if r["model"] == model]
            if rows:
                cells_text = " | ".join(_cell(mine, model, n, p) for n, p in cells)
                lines.append(f"| {label} | {rows[0]['parameters'] / 1e3:.0f}k | {cells_text} |")
        best = max(mine, key=lambda r: r["accuracy"])
        chance = mine[0]["chance"]
        above = [r for r in mine if r["accuracy"] > 2 * chance]
        lines += [
            "",
            f"Best run: {best['label']} at L={best['length']} N={best['num_pairs']}, {100 * best['accuracy']:.1f}% "
            f"(chance {100 * chance:.1f}%); {len(above)} of {len(mine)} runs above twice chance"
            + (": " + ", ".join(f"{r['label']} L={r['length']} N={r['num_pairs']}" for r in above) if above else "")
            + ".",
            f"Final training loss over the scored tokens: {min(r['final_train_loss'] for r in mine):.2f}–"
            f"{max(r['final_train_loss'] for r in mine):.2f} nats (ln {mine[0]['settings']['num_values']} = "
            f"{math.log(mine[0]['settings']['num_values']):.2f} is a model that knows only that a value comes next; "
            "recall shows as a loss well below it).",
        ]
        tables += [*lines, ""]
    png = PNG if docs is None else docs.parent / "results" / PNG.name
    if docs is not None:
        plot(records, png, length_for_pairs, pairs_at_lengths)
    rel = png.relative_to(png.parent.parent).as_posix()
    text = "\n".join(
        [
            "Multi-query associative recall (MQAR, after Zoology) with every query beyond the attention window of",
            "its pair (`python -m experiments.mqar`; format, scoring and settings in `experiments/mqar.py`, one JSON",
            "per run with its command and commit in `docs/results/mqar/`). A sequence is N key-value pairs, a gap",
            "of filler as long as the Slide stack's receptive field (layers x W), then the N keys queried once each",
            "in random order at random positions; only the value after each queried key is scored. Models: the tiny",
            "presets (their layer layout) at the width and depth below, and HF `MambaForCausalLM` of the same width and",
            "depth (mambapy's parallel scan). A cell at chance means the model did not learn the task within that",
            "budget, not that it cannot: these budgets are far from the Zoology-scale training (100k+ examples).",
            f"Machine: {cpu_name()}, one thread per run, sharing the CPU with two long training runs.",
            "",
            *tables,
            f"![MQAR accuracy]({rel})",
            "",
            "The same command completes or extends the grid (finished runs are skipped; a budget is part of each run's",
            "name): e.g. `python -m experiments.mqar --steps 2000 --batch-size 64 --device cuda` on a GPU.",
        ]
    )
    if docs is not None:
        write_section("mqar", text.split("\n"), docs)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="lengths run at --pairs-at-lengths")
    p.add_argument("--pairs-at-lengths", type=int, default=PAIRS_AT_LENGTHS)
    p.add_argument("--pairs", nargs="+", type=int, default=list(PAIRS), help="pair counts run at --length-for-pairs")
    p.add_argument("--length-for-pairs", type=int, default=LENGTH_FOR_PAIRS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-len", type=int, default=32)
    p.add_argument("--num-keys", type=int, default=64)
    p.add_argument("--num-values", type=int, default=64)
    p.add_argument("--gap", type=int, default=None, help="filler between pairs and queries (default: layers x W)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--deadline-minutes", type=float, default=None, help="start no new run after this many minutes")
    p.add_argument("--output", default=str(RESULTS), help="folder of the run JSONs")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--log-every", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out_dir = Path(args.output)
    if not args.report_only:
        cells = grid(args.lengths, args.pairs, args.length_for_pairs, args.pairs_at_lengths)
        todo = [
            (m, n, q, s)
            for n, q in cells
            for m in args.models
            for s in args.seeds
            if not (out_dir / f"{run_name(m, n, q, s, args.steps, args.batch_size)}.json").exists()
        ]
        # Cheapest first, so that an interrupted sweep leaves whole cells (HF Mamba's pure-PyTorch scan costs ~10x
        # a BST-family model per token on CPU).
        todo.sort(key=lambda t: (t[1] * (10 if MODELS[t[0]][1] is None else 1), t[1], t[2], t[3]))
        print(f"{len(todo)} runs to do", flush=True)
        started = time.time()
        command = "python -m experiments.mqar " + " ".join(sys.argv[1:] if argv is None else argv)
        commit = git_commit()
        for model, length, pairs, seed in todo:
            if args.deadline_minutes is not None and time.time() - started > 60 * args.deadline_minutes:
                print("deadline reached: the remaining runs are left for the next invocation", flush=True)
                break
            t0 = time.time()
            record = train_and_eval(
                model, length, pairs, steps=args.steps, batch_size=args.batch_size, lr=args.lr, hidden=args.hidden,
                layers=args.layers, block_len=args.block_len, gap=args.gap, num_keys=args.num_keys,
                num_values=args.num_values, seed=seed, log_every=args.log_every, device=args.device,
            )  # fmt: skip
            record.update(
                command=command,
                git_commit=commit,
                uncommitted_changes=uncommitted(),
                wall_seconds=round(time.time() - t0, 1),
            )
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{run_name(model, length, pairs, seed, args.steps, args.batch_size)}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
            print(
                f"{record['label']:>16} L={length:<5} N={pairs:<3} seed {seed}: accuracy {record['accuracy']:.3f} "
                f"(loss {record['final_train_loss']:.3f}, {record['train_seconds']:.0f} s)",
                flush=True,
            )
    if not args.no_report:
        docs = ROOT / "docs" / "results.md" if out_dir.resolve() == RESULTS.resolve() else None
        report(out_dir, docs, args.length_for_pairs, args.pairs_at_lengths)


if __name__ == "__main__":
    main()
