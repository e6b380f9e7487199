"""Multi-query associative recall (MQAR) beyond the attention window: every model family against sequence length and
number of key-value pairs (issue #13, part 2).

MQAR (the "Zoology" study of attention vs gated convolutions / SSMs) asks a model to retrieve many key-value pairs
seen earlier in the sequence. Here every query lies beyond the receptive field of the Slide stack from its pair, so
block attention alone cannot solve it; the SSM / recurrent / GSS paths must carry the pairs.

Sequence format (``training.tasks.mqar``: the generator ``make_batch`` and the scorer, which
``python -m training.evaluate --task mqar`` uses on a saved model; length L, N pairs, gap G; vocabulary
``[FILLER, keys..., values...]``)::

    position  0 .. 2N-1       : k_1 v_1 k_2 v_2 ... k_N v_N      (N distinct keys, values drawn with replacement)
    position  2N .. 2N+G-1    : FILLER                           (the gap)
    position  2N+G .. L-1     : FILLER with N query slots "k_i v_i" (every key queried once, random order,
                                slots at random even offsets of the query region, non-overlapping)

Only the value token of each query slot is scored: ``labels`` holds that value at its position and -100 elsewhere
(Hugging Face convention, shifted inside the model: the logits at the query key predict it). Accuracy = fraction of
queried values predicted exactly (argmax) on held-out sequences drawn from a separate seed. G defaults to the
receptive field of a Slide stack of the same depth (``num_layers * block_len``: each layer attends to exactly the W
previous tokens), so a query key is more than ``num_layers * W`` tokens after its pair; ``research/tests/test_mqar.py``
checks with gradients that a Slide model's scored logits do not depend on the pairs at all. Chance is
``1 / num_values`` for a model that guesses a value; a model that copies one of the N values of the sequence without
binding it to its key scores about ``1 / N``.

Models (``MODELS``): the tiny presets of ``training/presets/`` with width, depth-preserving layer layout, block length,
vocabulary and training length overridden, plus Hugging Face ``MambaForCausalLM`` of the same width and depth (the
outside reference; transformers' pure-PyTorch path, with ``use_mambapy`` when the ``mambapy`` package is
installed: its parallel scan, since the sequential loop's backward is quadratic in L). ``attention`` ("Attention
(W=L)") is the reference row: the Slide preset with ``block_len`` = the sequence length, i.e. full causal attention
that reaches every pair, so each cell shows what a model that can see the pairs learns at that budget (every other
model keeps W). Layer layouts scale with depth (``_scale_indices``); at the default 2 layers the presets' layouts
become: BST:* ``bst_layer_indices`` [0, 2] -> [0, 1] (both layers BST; layer 0's SSM reads the embeddings, which
cannot bind a key to its value, layer 1's SSM reads layer 0's output, where attention over the W previous tokens
has put k_i next to v_i: the long-range path), BRecT [2] -> [1] (layer 1 recurrent), GSS-Hybrid [0, 2, 3] ->
[0, 1] (both layers GSS: no attention layer remains; layer 1's GSS is its long-range path over layer 0's gated
mixing). The report's "Layers" column shows each run's layout (A attention, B BST, R BRecT, G GSS, M Mamba).

Training: AdamW (SSM parameters at ``config.ssm_lr``, no weight decay, as in ``training.train``), linear warm-up
(10%) + cosine decay, fresh random sequences every step. Defaults (``STEPS``, ``BATCH``, ``LR``, ...) come from runs
of the reference on one loaded CPU thread (Slide preset, W = L = 64, 2 layers, D = 64, N = 8, gap 0, 32 keys /
32 values, batch 32): at lr 1e-2 and no weight decay its loss sits near ln N = 2.08 (it copies one of the N values
of the sequence, ~18% accuracy) until ~2,000 steps, then falls (1.84 at 2,000, 1.58 at 3,250, 1.41 at 6,000 steps);
after 6,000 steps it scores 39.0% on 512 held-out sequences (eval loss 1.40; 23 min); at lr 3e-3 it was still at
2.06 after 1,500 steps, at lr 1e-3 at 2.31. Hence lr 1e-2, weight decay 0, 2 layers (as in Zoology), D = 64,
32 keys and 32 values, 6,000 steps of 32 sequences: a budget at which the reference clearly learns
(partly: 39%, not solved) at L = 64; W = 32 for the other models (L / W = 8 at the base cell L = 256, as in the
paper). Whether the reference learns at L = 256 is the first thing the default grid shows (it runs first in
every cell); if it stays near 1/N there, raise ``--steps``. The earlier default, 50 steps x 8 sequences, was far too
small: all its runs sit at chance (docs/results.md keeps them as a labelled "too small" budget). Cost per step at
L = 256, batch 32, 2 layers, one loaded core: ~0.65 s (the reference, W = L), ~0.22 s (Slide, W = 32), ~0.36 s
(BST:SH:S4), ~5.5 s (HF Mamba with mambapy); at the default budget ~65 min, ~22 min, ~36 min and ~9 h per run.

Runs span sessions: every ``--checkpoint-every`` steps a run saves its state (weights, optimiser state, step,
losses, the data and torch generators' states, in one safetensors file written atomically) as
``<output>/<run>.ckpt.safetensors``; the same command resumes it exactly (bitwise the same final weights, losses and
accuracy as an uninterrupted run: ``research/tests/test_mqar.py``) and deletes the checkpoint once the run's JSON is written.
``--deadline-minutes`` stops at a checkpoint instead of being killed. A run longer than one sitting (HF Mamba at L =
256: ~2.3 s per step on a loaded Intel Xeon core, ~4 h per run) has its checkpoint committed when it stops (0.9-1.8
MB; a safetensors file of tensors only, nothing unpickled), so that a fresh clone continues it with the same
command; the commit that adds the run's JSON deletes it. One run per (model, length, pairs, budget, seed) writes
``research/results/mqar/<model>-L<length>-N<pairs>-<steps>x<batch>-s<seed>.json`` with the command, git commit and a
SHA-256 of the final weights. Runs whose JSON exists are skipped, so the same command resumes or extends a grid::

    python -m research.mqar                               # --grid first: L = 256, N = 8, every model, then the report
    python -m research.mqar --grid sweep                  # lengths 256-2048 at N = 8 and N = 4-32 at L = 256
    python -m research.mqar --models attention slide bst-sh-s4 --deadline-minutes 170   # part of a grid per sitting
    python -m research.mqar --report-only                 # tables + plot into docs/results.md (``mqar``)
    python -m research.mqar --models bst-sh-unstruct --set unstruct_sin_freq=1   # an ablation: its own row
    python -m research.mqar --models bst-sh-s4 --lengths 2048 --curriculum 256 1500   # short sequences first

``--curriculum LENGTH STEPS`` trains the first STEPS steps on sequences of LENGTH (the same pairs and gap, so the
queries lie closer to their pairs) and the rest at the run's length; like an ablation, it is a run, a name
(``+curriculum=LENGTHxSTEPS``) and a report row of its own.

``--set FIELD=VALUE`` (repeatable) overrides a BSTConfig field of every model of the invocation after the preset
(values are JSON literals: ``1``, ``0.01``, ``true``, ``"s4"``; anything else is a string). An ablation is a run of
its own: its name and label carry the overrides (``bst-sh-unstruct+unstruct_sin_freq=1-L256-...json``,
"BST:SH:unstruct [unstruct_sin_freq=1]"), its JSON records them (``overrides``), and the report gives it its own row
below its model's. Fields the protocol sets itself (width, depth, W, length, vocabulary) have flags of their own and
are refused, as are fields BSTConfig does not have and HF Mamba (whose config is not a BSTConfig).

Records name their machine (``settings.device`` and ``device_name``: the GPU's name on CUDA). Run names do not say
the machine or the number of keys, so another protocol keeps its records in its own folder and its report in its own
section: ``--section NAME`` writes the report into section NAME of ``--docs`` (default docs/results.md) and the plot
to ``results/NAME.png`` beside it. The accelerator protocol, ``bash research/gpu_quality.sh --mqar``, runs the ``gpu``
grid (lengths 256-2048 at N = 8, N = 4-64 at L = 512, 64 keys and 64 values, every model) on one GPU into
``research/results/mqar_gpu/`` and section ``mqar_gpu``::

    python -m research.mqar --grid gpu --num-keys 64 --num-values 64 --device cuda \\
        --output research/results/mqar_gpu --section mqar_gpu      # what gpu_quality.sh --mqar runs
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from research import common
from training import optim
from training.tasks.mqar import (  # noqa: F401  (the task's generator and scorer, read from here by older callers)
    FILLER,
    check_layout,
    held_out_generator,
    make_batch,
    vocab_size,
)
from training.tasks.mqar import score as evaluate


ROOT = common.ROOT
DOCS = common.DOCS
# The CPU protocol's records (research/results/<section>/), docs/results.md section and plot
# (docs/results/<section>.png); the accelerator protocol's (`bash research/gpu_quality.sh --mqar`) have their own:
# run names do not say num_keys or the machine.
SECTION, GPU_SECTION = "mqar", "mqar_gpu"
RESULTS = common.RESULTS / SECTION
GPU_RESULTS = common.RESULTS / GPU_SECTION
PNG = common.PLOTS / f"{SECTION}.png"
PRESETS = ROOT / "training" / "presets"

# name -> (label, preset under training/presets/ or None for HF Mamba); the reference first
REFERENCE = "attention"  # the Slide preset with block_len = the sequence length: full causal attention
MODELS = {
    REFERENCE: ("Attention (W=L)", "slide-tiny"),
    "slide": ("Slide", "slide-tiny"),
    "bst-sh-s4": ("BST:SH:S4", "bst-tiny-sh-s4"),
    "bst-mh-s4": ("BST:MH:S4", "bst-tiny-mh-s4"),
    "bst-mf-s4": ("BST:MF:S4", "bst-tiny-mf-s4"),
    "bst-sh-unstruct": ("BST:SH:unstruct", "bst-tiny-sh-unstruct"),
    "brect": ("BRecT:fixed:skip", "brect-tiny"),
    "gss-hybrid": ("GSS-Hybrid", "gss-hybrid-tiny"),
    "mamba": ("Mamba (HF)", None),
}

# Grids of (length, pairs) cells: every length at one pair count, and every pair count at one length. "first" is the
# cell every model runs first (L = 256, N = 8: ~1 h per BST-family run on one CPU thread at the default budget);
# "sweep" extends it (finished runs are kept). --lengths/--pairs/... override a preset's fields.
GRIDS = {
    "first": dict(lengths=(256,), pairs_at_lengths=8, pairs=(8,), length_for_pairs=256),
    "sweep": dict(lengths=(256, 512, 1024, 2048), pairs_at_lengths=8, pairs=(4, 8, 16, 32), length_for_pairs=256),
    # the accelerator protocol's grid (with 64 keys: N = 64 does not fit in L = 256 with the default gap, hence L = 512)
    "gpu": dict(lengths=(256, 512, 1024, 2048), pairs_at_lengths=8, pairs=(4, 8, 16, 32, 64), length_for_pairs=512),
}
# Default budget and recipe, the same for every model (justified in the module docstring).
STEPS, BATCH = 6000, 32
LR, WEIGHT_DECAY = 1e-2, 0.0
HIDDEN, LAYERS, BLOCK_LEN = 64, 2, 32
NUM_KEYS = NUM_VALUES = 32
# The SSM parameters' learning rate when the config leaves it to the main one (BSTConfig.ssm_lr None, its default
# since issue #33): 1e-3, the config default every recorded run used; ``--set ssm_lr=...`` overrides it.
MQAR_SSM_LR = 1e-3
CHECKPOINT_EVERY = 100
# BSTConfig fields ``build_config`` sets from the protocol's own flags (``--set`` refuses them, naming the flag)
PROTOCOL_FIELDS = {
    "vocab_size": "--num-keys/--num-values",
    "hidden_size": "--hidden",
    "num_hidden_layers": "--layers",
    "head_dim": "--hidden",
    "intermediate_size": "--hidden",
    "block_len": "--block-len",
    "max_position_embeddings": "the cell's length (--lengths/--length-for-pairs)",
    "model_type": "--models",
    "architectures": "--models",
}


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


def parse_overrides(items: list[str] | None) -> dict:
    """``["FIELD=VALUE", ...]`` -> ``{FIELD: value}`` (VALUE a JSON literal, else a string); ValueError naming the
    item if it is malformed, sets a field the protocol sets itself, a field BSTConfig does not have, or twice."""
    from modeling_bst import BSTConfig

    known = set(BSTConfig().to_dict())
    out: dict = {}
    for item in items or []:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field or not text:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. unstruct_sin_freq=1")
        if field in PROTOCOL_FIELDS:
            raise ValueError(f"--set {item!r}: {field} is set by the protocol; use {PROTOCOL_FIELDS[field]}")
        if field not in known:
            raise ValueError(f"--set {item!r}: BSTConfig has no field {field!r}")
        if field in out:
            raise ValueError(f"--set {item!r}: {field} is set twice")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[field] = value
    return out


def overrides_tag(overrides: dict | None) -> str:
    """The part of a run's name that says its overrides: ``+field=value`` each, sorted by field ("" for none).
    ValueError if a value would not make a plain file name."""
    parts = []
    for field, value in sorted((overrides or {}).items()):
        text = value if isinstance(value, str) else json.dumps(value)
        if not text or not all(c.isalnum() or c in "._-" for c in text):
            raise ValueError(f"--set {field}={text}: the value must be letters, digits, '.', '_' or '-' (a file name)")
        parts.append(f"+{field}={text}")
    return "".join(parts)


def curriculum_tag(curriculum: tuple[int, int] | None) -> str:
    """The part of a run's name that says its length curriculum: ``+curriculum=LENGTHxSTEPS`` ("" for none)."""
    return "" if curriculum is None else f"+curriculum={curriculum[0]}x{curriculum[1]}"


def curriculum_of(settings: dict) -> tuple[int, int] | None:
    """The ``(length, steps)`` curriculum a record's settings or a checkpoint's identity holds (None: none)."""
    c = settings.get("curriculum")
    return None if c is None else (c["length"], c["steps"])


def variant_label(label: str, overrides: dict | None, curriculum: tuple[int, int] | None = None) -> str:
    """``label`` with its overrides and curriculum, e.g. "BST:SH:unstruct [unstruct_sin_freq=1]",
    "BST:SH:S4 [first 1500 steps at L=256]"."""
    parts = [f"{k}={json.dumps(v)}" for k, v in sorted((overrides or {}).items())]
    if curriculum is not None:
        parts.append(f"first {curriculum[1]} steps at L={curriculum[0]}")
    return f"{label} [{', '.join(parts)}]" if parts else label


def _scale_indices(indices: list[int], old_layers: int, new_layers: int) -> list[int]:
    """Map a preset's layer layout onto ``new_layers`` layers (keeps the relative placement; distinct indices)."""
    if new_layers == old_layers:
        return list(indices)
    out = sorted({min(new_layers - 1, (i * new_layers) // old_layers) for i in indices})
    return out


def build_config(
    model: str,
    hidden: int,
    layers: int,
    block_len: int,
    length: int,
    vocab: int,
    state_size: int = 16,
    overrides: dict | None = None,
) -> dict:
    """The model's config as a dict: the preset with width/depth/block length/vocabulary/length overridden
    (the reference ``attention``: block length = ``length``, whatever ``block_len`` says), then ``overrides``
    (BSTConfig fields, from ``--set``; refused for HF Mamba)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {list(MODELS)}")
    label, preset = MODELS[model]
    if overrides and preset is None:
        raise ValueError(f"--set overrides BSTConfig fields; {model} is HF Mamba (got {sorted(overrides)})")
    if model == REFERENCE:
        block_len = length
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
    cfg.update(overrides or {})
    return cfg


def build_model(config: dict, model: str):
    if MODELS[model][1] is None:
        from transformers import MambaConfig, MambaForCausalLM

        return MambaForCausalLM(MambaConfig(**config))
    import modeling_bst  # noqa: F401  (registers "bst")
    from modeling_bst import BSTConfig, BSTForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    return BSTForCausalLM(BSTConfig(**cfg))


def layout(config: dict, model: str) -> str:
    """A run's layer layout, one letter per layer: A (block) attention, B BST, R BRecT, G GSS, M Mamba."""
    if MODELS[model][1] is None:
        return " ".join("M" * config["num_hidden_layers"])
    letters = ["A"] * config["num_hidden_layers"]
    for key, letter in (("bst_layer_indices", "B"), ("recurrent_layer_indices", "R"), ("gss_layer_indices", "G")):
        for i in config.get(key) or []:
            letters[i] = letter
    return " ".join(letters)


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints (exact resume)
# --------------------------------------------------------------------------------------------------------------------
CHECKPOINT_FORMAT = "mqar-checkpoint-1"


def checkpoint_path(out_dir: Path, name: str) -> Path:
    return Path(out_dir) / f"{name}.ckpt.safetensors"


def weights_digest(model) -> str:
    """SHA-256 over the state dict (names, dtypes, shapes, bytes, in name order): equal digests = bitwise equal
    weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(path: Path, net, optimizer, data: torch.Generator, losses: list[float], meta: dict) -> None:
    """Everything a run needs to continue bitwise: weights, AdamW state, losses so far, the data generator's and
    torch's generator states, in one safetensors file (``meta`` as JSON in its metadata), written atomically."""
    from safetensors.torch import save_file

    # clone: tied weights share storage, which safetensors refuses; load_state_dict fills both names again
    tensors = {f"model.{k}": v.detach().cpu().clone().contiguous() for k, v in net.state_dict().items()}
    for idx, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {idx}.{key} is a {type(value).__name__}, not a tensor")
            tensors[f"optim.{idx}.{key}"] = value.detach().cpu().clone().contiguous()
    tensors["losses"] = torch.tensor(losses, dtype=torch.float64)  # loss.item() values, exact in float64
    tensors["rng.data"] = data.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": CHECKPOINT_FORMAT, "meta": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)


def checkpoint_meta(path: Path) -> dict:
    """The metadata of a :func:`save_checkpoint` file (``identity``, ``step``, ``train_seconds``, ``sittings``),
    read from its header without loading a tensor. ValueError if it is not an MQAR checkpoint."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except SafetensorError as e:  # not a ValueError: say which file and why
        raise ValueError(f"{path}: not a safetensors file ({e})") from e
    if header.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not an MQAR checkpoint (format {header.get('format')!r}, want {CHECKPOINT_FORMAT})")
    return json.loads(header["meta"])


def load_checkpoint(path: Path, net, optimizer, data: torch.Generator, identity: dict) -> tuple[list[float], dict]:
    """Restore a :func:`save_checkpoint` file into ``net``, ``optimizer`` and ``data`` (and torch's generator);
    returns (losses, meta). Raises ValueError if the checkpoint belongs to a run with other settings."""
    from safetensors.torch import load_file

    meta = checkpoint_meta(path)
    saved = meta["identity"]
    diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
    if diff:
        fields = ", ".join(f"{k}: {saved.get(k)!r} there, {identity.get(k)!r} here" for k in diff)
        raise ValueError(f"{path} is a checkpoint of other settings ({fields}); delete it or pick another --output")
    tensors = load_file(str(path))
    net.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    data.set_state(tensors["rng.data"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    losses = tensors["losses"].tolist()
    if len(losses) != meta["step"]:
        raise ValueError(f"{path}: {len(losses)} losses for step {meta['step']}")
    return losses, meta


# --------------------------------------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------------------------------------
def train_and_eval(
    model: str,
    length: int,
    num_pairs: int,
    *,
    steps: int = STEPS,
    batch_size: int = BATCH,
    lr: float = LR,
    weight_decay: float = WEIGHT_DECAY,
    warmup: int | None = None,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    block_len: int = BLOCK_LEN,
    gap: int | None = None,
    num_keys: int = NUM_KEYS,
    num_values: int = NUM_VALUES,
    eval_examples: int = 256,
    seed: int = 0,
    log_every: int = 0,
    device: str = "cpu",
    checkpoint: Path | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
    deadline: float | None = None,
    overrides: dict | None = None,
    curriculum: tuple[int, int] | None = None,
) -> dict | None:
    """Train one model on fresh MQAR batches for ``steps`` AdamW steps; return a result record (accuracy on
    ``eval_examples`` held-out sequences, losses, parameters, timing, a digest of the final weights).

    With ``checkpoint`` (a path), the run continues from that file if it exists and saves to it every
    ``checkpoint_every`` steps; at ``deadline`` (a ``time.time()`` value) it saves and returns None instead of
    finishing. The caller deletes the checkpoint once it has stored the record. ``overrides``: BSTConfig fields set
    after the preset (an ablation; recorded, and part of the label). ``curriculum`` ``(short, k)``: the first ``k``
    steps train on sequences of length ``short`` (the same pairs and gap), the rest on ``length``; evaluation is at
    ``length`` (recorded in the settings, and part of the label)."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps ({steps}) and batch_size ({batch_size}) must be positive")
    if checkpoint is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be positive, got {checkpoint_every}")
    gap = layers * block_len if gap is None else gap
    warmup = max(1, steps // 10) if warmup is None else warmup
    if curriculum is not None:
        short, short_steps = curriculum
        if not 0 < short < length or not 0 < short_steps < steps:
            raise ValueError(
                f"curriculum {short}x{short_steps}: the first length must lie in 1 .. {length - 1} (below the "
                f"run's length) and its steps in 1 .. {steps - 1}"
            )
        try:  # make_batch's own layout rule, checked before anything trains
            check_layout(short, num_pairs, gap, num_keys)
        except ValueError as e:
            raise ValueError(f"curriculum {short}x{short_steps}: {e}") from None
    torch.manual_seed(seed)
    vocab = vocab_size(num_keys, num_values)
    overrides = dict(overrides or {})
    config = build_config(model, hidden, layers, block_len, length, vocab, overrides=overrides)
    net = build_model(config, model).to(device)
    net.train()
    # SSM parameters (BST's ssm_parameter_names, HF Mamba's A_log, D, dt bias) at the config's ssm_lr without weight
    # decay; biases, norms and embeddings without weight decay (checkpoints index the AdamW state in this order)
    ssm_lr = getattr(net.config, "ssm_lr", None)
    if ssm_lr is None and hasattr(net, "ssm_parameter_names"):
        ssm_lr = MQAR_SSM_LR  # BST's config leaves it to the main lr; the recorded runs used 1e-3
    groups = optim.parameter_groups(net, lr, weight_decay, ssm_lr, no_decay=optim.norms_and_embeddings)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.98))
    base = [g["lr"] for g in optimizer.param_groups]

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    settings = {
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
    }
    if curriculum is not None:  # (only when set: runs without one keep their checkpoints' identity)
        settings["curriculum"] = {"length": curriculum[0], "steps": curriculum[1]}
    # what a checkpoint must agree on (threads and device may change between sittings; each sitting is recorded)
    identity = dict(settings, model=model, length=length, num_pairs=num_pairs, seed=seed)
    if overrides:  # (runs without overrides keep the identity of checkpoints written before --set existed)
        identity["overrides"] = overrides
    from reporting import device_name

    machine = {"device": device, "device_name": device_name(device)}
    sitting = {"git_commit": git_commit(), "torch_threads": torch.get_num_threads(), **machine}
    data = torch.Generator().manual_seed(seed)
    batch = dict(length=length, num_pairs=num_pairs, gap=gap, num_keys=num_keys, num_values=num_values)
    losses: list[float] = []
    sittings: list[dict] = []
    seconds_before = 0.0
    if checkpoint is not None and Path(checkpoint).exists():
        losses, meta = load_checkpoint(Path(checkpoint), net, optimizer, data, identity)
        sittings, seconds_before = meta["sittings"], meta["train_seconds"]
        print(f"  resuming from step {len(losses)} ({checkpoint})", flush=True)
    sitting["start_step"] = len(losses)
    sittings = [*sittings, sitting]

    def save(step: int, seconds: float) -> None:
        meta = {"identity": identity, "step": step, "train_seconds": seconds, "sittings": sittings}
        save_checkpoint(Path(checkpoint), net, optimizer, data, losses, meta)

    t0 = time.perf_counter()
    for step in range(len(losses), steps):
        for group, lr0 in zip(optimizer.param_groups, base):
            group["lr"] = lr0 * schedule(step)
        at = batch if curriculum is None or step >= curriculum[1] else dict(batch, length=curriculum[0])
        ids, labels, _ = make_batch(batch_size, generator=data, **at)
        loss = net(ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"  step {step + 1}: loss {sum(losses[-log_every:]) / log_every:.3f}", flush=True)
        if checkpoint is not None and step + 1 < steps:
            if deadline is not None and time.time() >= deadline:
                save(step + 1, seconds_before + time.perf_counter() - t0)
                print(f"  deadline: stopped after step {step + 1} of {steps}, state in {checkpoint}", flush=True)
                return None
            if (step + 1) % checkpoint_every == 0:
                save(step + 1, seconds_before + time.perf_counter() - t0)
    train_seconds = seconds_before + time.perf_counter() - t0
    held_out = held_out_generator(seed)  # never the training stream (training.tasks.mqar)
    ids, labels, _ = make_batch(eval_examples, generator=held_out, **batch)
    accuracy, eval_loss = evaluate(net, ids.to(device), labels.to(device))
    tail = losses[-max(1, steps // 10) :]
    return {
        "model": model,
        "label": variant_label(MODELS[model][0], overrides, curriculum),
        "overrides": overrides,
        "length": length,
        "num_pairs": num_pairs,
        "seed": seed,
        "accuracy": accuracy,
        "chance": 1.0 / num_values,
        "eval_loss": eval_loss,
        "final_train_loss": sum(tail) / len(tail),
        "train_losses": [round(sum(losses[i : i + 10]) / len(losses[i : i + 10]), 4) for i in range(0, steps, 10)],
        "parameters": sum(p.numel() for p in net.parameters()),
        "weights_sha256": weights_digest(net),
        "layout": layout(config, model),
        "train_seconds": round(train_seconds, 1),
        "sittings": sittings,
        "settings": dict(settings, torch_threads=torch.get_num_threads(), **machine),
        "config": config,
    }


# --------------------------------------------------------------------------------------------------------------------
# Grid, records, report
# --------------------------------------------------------------------------------------------------------------------
def run_name(
    model: str,
    length: int,
    pairs: int,
    seed: int,
    steps: int,
    batch_size: int,
    overrides: dict | None = None,
    curriculum: tuple[int, int] | None = None,
) -> str:
    tag = overrides_tag(overrides) + curriculum_tag(curriculum)
    return f"{model}{tag}-L{length}-N{pairs}-{steps}x{batch_size}-s{seed}"


def budget_of(record: dict) -> str:
    """Runs are compared only within one budget: steps x batch size (the same for every model)."""
    return f"{record['settings']['steps']}x{record['settings']['batch_size']}"


def git_commit() -> str | None:
    """HEAD, or ``$BST_SOURCE_COMMIT`` where it is set (a tree copied to an accelerator machine may carry stale or
    no git metadata; research/lm_long.py does the same)."""
    if os.environ.get("BST_SOURCE_COMMIT"):
        return os.environ["BST_SOURCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def uncommitted(paths=("modeling_bst", "research/mqar.py")) -> list[str]:
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


def _variant(record: dict) -> str:
    """Which ablation of its model a record is: its overrides' and curriculum's tag ("" for the preset itself)."""
    return overrides_tag(record.get("overrides")) + curriculum_tag(curriculum_of(record["settings"]))


def _variants(records: list[dict], model: str) -> list[tuple[str, str]]:
    """(tag, label) of each variant of ``model`` among ``records``: the preset first, then its ablations (fewer
    overrides first, then by tag)."""
    found = {_variant(r): r["label"] for r in records if r["model"] == model}
    return sorted(found.items(), key=lambda item: (item[0].count("+"), item[0]))


def _select(records: list[dict], model: str, length: int, pairs: int, tag: str = "") -> list[dict]:
    return [
        r
        for r in records
        if r["model"] == model and r["length"] == length and r["num_pairs"] == pairs and _variant(r) == tag
    ]


def _mean(records: list[dict]) -> float:
    return sum(r["accuracy"] for r in records) / len(records)


def _cell(records: list[dict], model: str, length: int, pairs: int, tag: str = "") -> str:
    hits = _select(records, model, length, pairs, tag)
    if not hits:
        return "–"
    text = f"{100 * _mean(hits):.1f}"
    if len(hits) > 1:
        accs = [100 * r["accuracy"] for r in hits]
        text += f" ({min(accs):.1f}–{max(accs):.1f}, {len(hits)} seeds)"
    return text


def _budgets(records: list[dict]) -> list[str]:
    """The budgets of ``records``, largest (training examples) first."""
    return sorted({budget_of(r) for r in records}, key=lambda b: (-math.prod(int(x) for x in b.split("x")), b))


def _too_small(records: list[dict]) -> bool:
    """A budget at which no run (the reference included, if it ran) got above twice chance."""
    return all(r["accuracy"] <= 2 * r["chance"] for r in records)


def _axes(records: list[dict], length_for_pairs: int | None, pairs_at_lengths: int | None) -> tuple[int, int]:
    """(length_for_pairs, pairs_at_lengths) of a budget's grid: given, or the length with the most pair counts and
    the pair count with the most lengths among its runs."""
    cells = {(r["length"], r["num_pairs"]) for r in records}
    if length_for_pairs is None:
        length_for_pairs = max(sorted({n for n, _ in cells}), key=lambda n: sum(c[0] == n for c in cells))
    if pairs_at_lengths is None:
        pairs_at_lengths = max(sorted({q for _, q in cells}), key=lambda q: sum(c[1] == q for c in cells))
    return length_for_pairs, pairs_at_lengths


def plot(
    records: list[dict], path: Path, length_for_pairs: int | None = None, pairs_at_lengths: int | None = None
) -> None:
    """Accuracy against length (at ``pairs_at_lengths`` pairs) and against pairs (at ``length_for_pairs``), one
    row of panels per budget, largest first (None: each budget's own grid, see ``_axes``); a budget with one cell
    gets one panel of bars. One colour per model (``research.style``), one legend for the figure, y axes fitted to
    the accuracies (and twice chance: below it a run has not learned)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    from research import style as figure_style

    budgets = _budgets(records)
    one_cell = [len({(r["length"], r["num_pairs"]) for r in records if budget_of(r) == b}) == 1 for b in budgets]
    fig = plt.figure(figsize=(11, sum(3 if one else 4 for one in one_cell)))
    grid_spec = fig.add_gridspec(len(budgets), 2, height_ratios=[3 if one else 4 for one in one_cell])
    panels = []
    for i, budget in enumerate(budgets):
        mine = [r for r in records if budget_of(r) == budget]
        at_length, at_pairs = _axes(mine, length_for_pairs, pairs_at_lengths)
        chance = 100 * mine[0]["chance"]
        note = " (too small: all at chance)" if _too_small(mine) else ""
        variants = [(m, tag, label) for m in MODELS for tag, label in _variants(mine, model=m)]
        cells = {(r["length"], r["num_pairs"]) for r in mine}
        drawn = []
        if len(cells) == 1:  # one cell: a bar per model
            ax = fig.add_subplot(grid_spec[i, :])
            (length, pairs), x = next(iter(cells)), 0
            for model, tag, label in variants:
                acc = 100 * _mean(_select(mine, model, length, pairs, tag))
                name = model + tag
                ax.bar(
                    x,
                    acc,
                    0.6,
                    color=figure_style.colour(name),
                    label=label,
                    hatch="//" if figure_style.is_variant(name) else None,
                )
                ax.annotate(f"{acc:.1f}", (x, acc), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
                drawn.append(acc)
                x += 1
            ax.set_xticks(range(x), [label for _, _, label in variants], rotation=20, ha="right", fontsize=8)
            ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance")
            ax.set_ylabel("MQAR accuracy (%)")
            ax.set_title(f"L = {length}, N = {pairs} pairs, budget {budget}{note}", fontsize=10)
            ax.set_ylim(*figure_style.fitted_ylim(drawn, 2 * chance, 100))
            ax.grid(alpha=0.3, axis="y")
            panels.append(ax)
            continue
        row = [fig.add_subplot(grid_spec[i, 0]), fig.add_subplot(grid_spec[i, 1])]
        for model, tag, _label in variants:
            name, label = model + tag, _label
            ours = [r for r in mine if r["model"] == model and _variant(r) == tag]
            style = dict(
                color=figure_style.colour(name),
                linestyle=figure_style.linestyle(name),
                marker=figure_style.marker(name),
            )
            lengths = sorted({r["length"] for r in ours if r["num_pairs"] == at_pairs})
            pts = [(n, 100 * _mean(_select(mine, model, n, at_pairs, tag))) for n in lengths]
            if pts:
                row[0].plot(*zip(*pts), label=label, **style)
            pairs = sorted({r["num_pairs"] for r in ours if r["length"] == at_length})
            pts2 = [(q, 100 * _mean(_select(mine, model, at_length, q, tag))) for q in pairs]
            if pts2:
                row[1].plot(*zip(*pts2), label=label, **style)
            drawn += [y for _, y in pts + pts2]
        xs = (sorted({n for n, q in cells if q == at_pairs}), sorted({q for n, q in cells if n == at_length}))
        for ax, ticks, xlabel, title in (
            (row[0], xs[0], "sequence length L", f"N = {at_pairs} pairs"),
            (row[1], xs[1], "number of key-value pairs N", f"L = {at_length}"),
        ):
            ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance")
            ax.set_xscale("log", base=2)
            if ticks:  # the grid's values, written out
                ax.xaxis.set_major_locator(FixedLocator(ticks))
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xticklabels([str(t) for t in ticks])
                ax.set_xlim(ticks[0] / 1.25, ticks[-1] * 1.25)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("MQAR accuracy (%)")
            ax.set_ylim(*figure_style.fitted_ylim(drawn, 2 * chance, 100))
            ax.set_title(f"{title}, budget {budget}{note}", fontsize=10)
            ax.grid(alpha=0.3)
        panels += row
    figure_style.figure_legend(fig, panels)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _settings_line(records: list[dict]) -> str:
    s = records[0]["settings"]
    line = (
        f"{s['steps']} AdamW steps of {s['batch_size']} fresh sequences ({s['examples']} training examples) per run, "
        f"lr {s['lr']} (SSM parameters at the config's ssm_lr), warm-up {s['warmup']} + cosine, weight decay "
        f"{s['weight_decay']}; D = {s['hidden_size']}, {s['num_layers']} layers, W = {s['block_len']} (the reference: "
        f"W = L), gap G = {s['gap']}, {s['num_keys']} keys and {s['num_values']} values (chance "
        f"{100 / s['num_values']:.1f}%), accuracy over {s['eval_examples']} held-out sequences"
    )
    machine = ("torch_threads", "device", "device_name")
    recipes = {
        json.dumps({k: v for k, v in r["settings"].items() if k not in machine}, sort_keys=True) for r in records
    }
    if len(recipes) > 1:
        line += " (some runs differ: see their JSON `settings`)"
    return line


def _budget_table(mine: list[dict], budget: str, at_length: int, at_pairs: int) -> list[str]:
    cells = sorted({(r["length"], r["num_pairs"]) for r in mine}, key=lambda c: (c[1] != at_pairs, c))
    chance = mine[0]["chance"]
    head = f"**Budget {budget}**"
    if _too_small(mine):
        head += " (too small to learn the task: every run at chance)"
    lines = [
        f"{head}: {_settings_line(mine)}; {sum(r['train_seconds'] for r in mine) / 60:.0f} min of training in all. "
        f"Accuracy (%) on held-out sequences; chance {100 * chance:.1f}% (guessing a value), about 100/N% for a model "
        "that copies one of the N values of the sequence without binding it to its key:",
        "",
        "| Model | Layers | Params | " + " | ".join(f"L={n} N={p}" for n, p in cells) + " |",
        "|---|---|---|" + "---|" * len(cells),
    ]
    for model in MODELS:
        for tag, label in _variants(mine, model):
            rows = [r for r in mine if r["model"] == model and _variant(r) == tag]
            cells_text = " | ".join(_cell(mine, model, n, p, tag) for n, p in cells)
            shape = layout(rows[0]["config"], model)
            lines.append(f"| {label} | {shape} | {rows[0]['parameters'] / 1e3:.0f}k | {cells_text} |")
    best = max(mine, key=lambda r: r["accuracy"])
    above = [r for r in mine if r["accuracy"] > 2 * chance]
    # One entry per cell (label, L, N), with the number of its seeds above twice chance when there are several.
    above_cells = Counter(f"{r['label']} L={r['length']} N={r['num_pairs']}" for r in above)
    lines += [
        "",
        f"Best run: {best['label']} at L={best['length']} N={best['num_pairs']}, {100 * best['accuracy']:.1f}% "
        f"(chance {100 * chance:.1f}%); {len(above)} of {len(mine)} runs above twice chance"
        + (": " + ", ".join(c + (f" ({k} seeds)" if k > 1 else "") for c, k in above_cells.items()) if above else "")
        + ".",
        f"Final training loss over the scored tokens: {min(r['final_train_loss'] for r in mine):.2f}–"
        f"{max(r['final_train_loss'] for r in mine):.2f} nats (ln {mine[0]['settings']['num_values']} = "
        f"{math.log(mine[0]['settings']['num_values']):.2f} is a model that knows only that a value comes next, "
        f"ln N one that copies a value of the sequence; recall shows as a loss well below ln N).",
    ]
    if not any(r["model"] == REFERENCE for r in mine):
        lines.append("No reference run (Attention (W=L)) at this budget.")
    return lines


def _folder(path: Path) -> str:
    """``path`` as the report names it: relative to the repository when inside it (``research/results/mqar/``)."""
    path = Path(path).resolve()
    return (path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()) + "/"


def _machine(records: list[dict]) -> tuple[str, bool]:
    """The machines the records ran on (``settings.device_name``; this machine's CPU name for CPU records written
    before device names were recorded) and whether every run was on the CPU."""
    from reporting import cpu_name

    names, on_cpu = [], True
    for r in records:
        s = r["settings"]
        if torch.device(s.get("device", "cpu")).type == "cpu":
            names.append(s.get("device_name") or cpu_name())
        else:
            on_cpu = False
            names.append(s.get("device_name") or f"an unnamed {s['device']} device")
    return " and ".join(dict.fromkeys(names)), on_cpu


def _mamba_scan(records: list[dict]) -> str:
    """How the HF Mamba runs scanned (``use_mambapy`` in their configs)."""
    flags = {r["config"].get("use_mambapy") for r in records if r["model"] == "mamba"}
    if flags == {True}:
        return "mambapy's parallel scan"
    if flags == {False}:
        return "transformers' sequential scan: mambapy was not installed"
    if flags:
        return "mambapy's parallel scan where a run's config says use_mambapy, else transformers' sequential scan"
    return "mambapy's parallel scan when installed"


def _how_to_extend(records: list[dict], section: str) -> list[str]:
    if section == SECTION:
        how = [
            "at `--deadline-minutes` continues exactly from its checkpoint): `python -m research.mqar` runs the",
            "first cell (L = 256, N = 8) for every model, `--grid sweep` the lengths and pair counts around it.",
        ]
    else:
        if section == GPU_SECTION:
            command = "`bash research/gpu_quality.sh --mqar` runs the whole grid on one GPU"
        else:
            commands = [r["command"] for r in records if r.get("command")]
            command = f"`{max(commands, key=commands.count)}` wrote most of these runs" if commands else "-"
        how = [
            "at `--deadline-minutes` continues exactly from its checkpoint; each run's JSON holds the command that",
            f"wrote it): {command}.",
        ]
    return [
        "The same command completes or extends the grid (finished runs are skipped; a run interrupted or stopped",
        *how,
    ]


def _in_progress(results_dir: Path) -> list[str]:
    """A line per run stopped at its deadline (its checkpoint beside the records): how far it got, so that a
    half-done run is visible in the report rather than only in the folder."""
    lines = []
    for path in sorted(Path(results_dir).glob("*.ckpt.safetensors")):
        try:
            meta = checkpoint_meta(path)
        except ValueError as e:  # a file of another format: say so rather than hide it
            lines.append(f"- `{path.name}`: unreadable ({e})")
            continue
        ident, n = meta["identity"], len(meta["sittings"])
        label = variant_label(MODELS[ident["model"]][0], ident.get("overrides"), curriculum_of(ident))
        lines.append(
            f"- {label} L={ident['length']} N={ident['num_pairs']} seed {ident['seed']}, budget "
            f"{ident['steps']}x{ident['batch_size']}: step {meta['step']} of {ident['steps']} "
            f"({meta['train_seconds'] / 3600:.1f} h of training in {n} sitting{'s' if n > 1 else ''})"
        )
    if not lines:
        return []
    return [
        f"Runs in progress (a checkpoint in `{_folder(results_dir)}`; the command that started each continues it):",
        *lines,
        "",
    ]


def check_section(section: str) -> str:
    """``section`` if it can name a docs/results.md section (its markers) and a PNG file, else ValueError."""
    if not section or not all(c.isalnum() or c in "_-" for c in section):
        raise ValueError(f"section must be a non-empty name of letters, digits, '_' or '-', got {section!r}")
    return section


def report(
    results_dir: Path = RESULTS,
    docs: Path | None = DOCS,
    length_for_pairs: int | None = None,
    pairs_at_lengths: int | None = None,
    section: str = SECTION,
) -> str:
    """One accuracy table per budget (model x (L, N) cell; largest budget first, the reference row first) and the
    plot, into section ``section`` of ``docs`` and ``<docs folder>/results/<section>.png`` (``docs`` None: only
    returned and printed). ``length_for_pairs`` / ``pairs_at_lengths`` order the cells and pick the plot's axes
    (None: each budget's own grid). The text names ``results_dir`` and the machine of the records; the CPU
    protocol's section (``mqar``) also says that its runs shared the 2-core CPU with other runs (so its wall times are
    not a speed benchmark)."""
    from reporting import write_section

    check_section(section)
    records = load_results(results_dir)
    if not records:
        raise SystemExit(f"no results under {results_dir}; run `python -m research.mqar` first")
    tables = []
    for budget in _budgets(records):
        mine = [r for r in records if budget_of(r) == budget]
        tables += [*_budget_table(mine, budget, *_axes(mine, length_for_pairs, pairs_at_lengths)), ""]
    png = (PNG.parent if docs is None else Path(docs).parent / "results") / f"{section}.png"
    if docs is not None:
        plot(records, png, length_for_pairs, pairs_at_lengths)
    rel = png.relative_to(png.parent.parent).as_posix()
    machine, on_cpu = _machine(records)
    if section == SECTION and on_cpu:
        machine_lines = [
            f"Machine: {machine}, one thread per run unless a run's settings say otherwise, each run sharing the",
            "2-core CPU with one or two other runs (long training or MQAR), so wall times are not a speed benchmark.",
        ]
    elif on_cpu:
        machine_lines = [f"Machine: {machine}, one thread per run unless a run's settings say otherwise."]
    else:
        machine_lines = [f"Machine: {machine}, one run at a time, fp32 (each run's `settings` names its device)."]
    kept = " (the first grid, 50 x 8, is kept for the record)" if section == SECTION else ""
    text = "\n".join(
        [
            "Multi-query associative recall (MQAR, after Zoology) with every query beyond the attention window of",
            "its pair (`python -m research.mqar`; format, scoring, defaults and their reasons in",
            "`research/mqar.py`, one JSON per run with its command, commit and weights digest in",
            f"`{_folder(results_dir)}`). A sequence is N key-value pairs, a gap of filler as long as the Slide stack's",
            "receptive field (layers x W), then the N keys queried once each in random order at random positions;",
            "only the value after each queried key is scored. Models: the tiny presets (their layer layout scaled to",
            "the depth below: column Layers, A attention, B BST, R BRecT, G GSS, M Mamba) at the width and depth",
            f"below, and HF `MambaForCausalLM` of the same width and depth ({_mamba_scan(records)}). The first row,",
            "Attention (W=L), is the reference: the Slide preset with W = L, full causal attention that reaches",
            "every pair, i.e. what a model that can see the pairs learns at that budget. Runs are compared only",
            "within one budget (steps x batch), one table each, the largest first; a budget at which no run gets",
            f"above twice chance is labelled too small{kept}.",
            *machine_lines,
            "",
            *tables,
            *_in_progress(results_dir),
            f"![MQAR accuracy]({rel})",
            "",
            *_how_to_extend(records, section),
        ]
    )
    if docs is not None:
        write_section(section, text.split("\n"), Path(docs))
    print(text)
    return text


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that shape a model as ``build_config`` builds it (shared with ``research.filter_shape``)."""
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--block-len", type=int, default=BLOCK_LEN, help="W of every model but the reference (W = L)")
    p.add_argument("--num-keys", type=int, default=NUM_KEYS)
    p.add_argument("--num-values", type=int, default=NUM_VALUES)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a BSTConfig field of every model run (an ablation: its own run name, label and report row); "
        "repeatable, VALUE a JSON literal",
    )


def run_task(task: tuple[str, int, int, int], job: dict) -> str:
    """Train and record one run of a grid, ``task`` = (model, length, pairs, seed); ``job``: the output folder, the
    invocation's command, torch threads and ``train_and_eval``'s keyword arguments (its ``deadline`` included).
    Returns "done" (its JSON written, its checkpoint deleted), "stopped" (at the deadline, its state in its
    checkpoint) or "not started" (the deadline had passed). A process of its own under ``--jobs``."""
    model, length, pairs, seed = task
    train = job["train"]
    deadline = train["deadline"]
    if deadline is not None and time.time() >= deadline:
        print(
            f"deadline reached: {model} L={length} N={pairs} seed {seed} is left for the next invocation", flush=True
        )
        return "not started"
    torch.set_num_threads(job["threads"])
    out_dir = Path(job["out_dir"])
    name = run_name(
        model, length, pairs, seed, train["steps"], train["batch_size"], train["overrides"], train["curriculum"]
    )
    ckpt = checkpoint_path(out_dir, name)
    t0 = time.time()
    record = train_and_eval(model, length, pairs, seed=seed, checkpoint=ckpt, **train)
    if record is None:
        print(f"deadline reached: {name} continues from its checkpoint at the next invocation", flush=True)
        return "stopped"
    record.update(
        command=job["command"],
        git_commit=git_commit(),
        uncommitted_changes=uncommitted(),
        wall_seconds=round(time.time() - t0, 1),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    ckpt.unlink(missing_ok=True)
    print(
        f"{record['label']:>16} L={length:<5} N={pairs:<3} seed {seed}: accuracy {record['accuracy']:.3f} "
        f"(loss {record['final_train_loss']:.3f}, {record['train_seconds']:.0f} s)",
        flush=True,
    )
    return "done"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--grid", choices=list(GRIDS), default="first", help="preset of (length, pairs) cells")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="lengths run at --pairs-at-lengths")
    p.add_argument("--pairs-at-lengths", type=int, default=None)
    p.add_argument("--pairs", nargs="+", type=int, default=None, help="pair counts run at --length-for-pairs")
    p.add_argument("--length-for-pairs", type=int, default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY)
    add_model_arguments(p)
    p.add_argument("--gap", type=int, default=None, help="filler between pairs and queries (default: layers x W)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs at once, each a process of its own (GPU: several share it)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--deadline-minutes",
        type=float,
        default=None,
        help="after this many minutes, checkpoint the current run and stop (the same command continues it)",
    )
    p.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY, help="steps between checkpoints")
    p.add_argument("--output", default=str(RESULTS), help="folder of the run JSONs (and of running runs' checkpoints)")
    p.add_argument(
        "--section",
        default=None,
        help=f"section of --docs (and plot <docs folder>/results/NAME.png) the report writes; given or not, the report "
        f"writes section {SECTION!r} when --output is the default folder, else prints only (default: {SECTION!r})",
    )
    p.add_argument("--docs", default=str(DOCS), help="the Markdown file the report's section goes into")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument(
        "--curriculum",
        nargs=2,
        type=int,
        default=None,
        metavar=("LENGTH", "STEPS"),
        help="train the first STEPS steps on sequences of LENGTH (shorter than the run's), then on the run's length; "
        "its own run name, label and report row",
    )
    args = p.parse_args(argv)
    curriculum = None if args.curriculum is None else tuple(args.curriculum)
    try:
        overrides = parse_overrides(args.overrides)
        overrides_tag(overrides)
    except ValueError as e:
        p.error(str(e))
    if overrides and "mamba" in args.models and not args.report_only:
        p.error("--set overrides BSTConfig fields; HF Mamba (--models mamba) has no BSTConfig: run it separately")
    preset = GRIDS[args.grid]
    cells_at = {k: getattr(args, k) if getattr(args, k) is not None else preset[k] for k in preset}
    if args.jobs < 1:
        p.error(f"--jobs must be positive, got {args.jobs}")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be positive, got {args.checkpoint_every}")
    try:
        section = check_section(SECTION if args.section is None else args.section)
    except ValueError as e:
        p.error(f"--{e}")
    if not args.report_only and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device (torch {torch.__version__})")
    torch.set_num_threads(args.threads)
    out_dir = Path(args.output)
    if not args.report_only:
        cells = grid(**cells_at)

        def name(t):
            return run_name(*t, args.steps, args.batch_size, overrides, curriculum)

        todo = [
            (m, n, q, s)
            for n, q in cells
            for m in args.models
            for s in args.seeds
            if not (out_dir / f"{name((m, n, q, s))}.json").exists()
        ]
        # Started runs first (their checkpoint), then cheapest first, so that an interrupted sweep leaves whole cells
        # (HF Mamba's pure-PyTorch scan costs ~10x a BST-family model per token on CPU).
        todo.sort(
            key=lambda t: (
                not checkpoint_path(out_dir, name(t)).exists(),
                t[1] * (10 if MODELS[t[0]][1] is None else 1),
                t[1],
                t[2],
                t[3],
            )
        )
        print(f"{len(todo)} runs to do" + (f", {args.jobs} at a time" if args.jobs > 1 else ""), flush=True)
        started = time.time()
        deadline = None if args.deadline_minutes is None else started + 60 * args.deadline_minutes
        command = "python -m research.mqar " + " ".join(sys.argv[1:] if argv is None else argv)
        common = dict(
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
            hidden=args.hidden, layers=args.layers, block_len=args.block_len, gap=args.gap, num_keys=args.num_keys,
            num_values=args.num_values, log_every=args.log_every, device=args.device,
            checkpoint_every=args.checkpoint_every, deadline=deadline, overrides=overrides, curriculum=curriculum,
        )  # fmt: skip
        job = dict(out_dir=str(out_dir), command=command, threads=args.threads, train=common)
        if args.jobs == 1:
            for task in todo:
                if run_task(task, job) != "done":
                    break
        else:
            # One process per run, up to --jobs at once ("spawn": CUDA cannot be used in forked children). On a GPU
            # the tiny models are bound by launching ops from Python, so runs side by side share it well.
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
                outcomes = list(pool.map(run_task, todo, [job] * len(todo)))
            print(f"{outcomes.count('done')} of {len(todo)} runs finished", flush=True)
    if not args.no_report:
        write = args.section is not None or out_dir.resolve() == RESULTS.resolve()
        docs = Path(args.docs) if write else None
        report(out_dir, docs, args.length_for_pairs, args.pairs_at_lengths, section)  # None: each budget's own grid


if __name__ == "__main__":
    main()
