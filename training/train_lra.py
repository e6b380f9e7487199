"""Train ``BSTForSequenceClassification`` on a Long Range Arena task with the Hugging Face ``Trainer``.

The paper's LRA recipe (App. D): AdamW, learning rate warmed up linearly from 1e-7 to the peak over the first 10% of
training, then cosine-decayed to 1e-7; weight decay on every parameter except the S4 state-space parameters
(``model.ssm_parameter_names()``: Lambda/A, B, dt; unstruct's implicit filter), which train at ``ssm_lr`` without
decay. One-dimensional parameters (biases, norm scales, per-head logit scales) are not decayed either. The groups
come from ``training.optim.parameter_groups``.

Only ListOps is implemented so far (``training/listops.py``)::

    python -m training.train_lra --task listops --data DIR --config configs/lra/listops-bst-sh-s4.yaml
    python -m training.train_lra --task listops --generate 20000 --config configs/lra/listops-tiny.yaml --max_steps 500

Config (YAML): ``model`` (``BSTConfig`` keyword arguments; ``vocab_size``, ``num_labels`` and ``pad_token_id``
come from the task), ``data`` (split sizes and length bounds used by ``--generate``), ``training`` (see
``TRAIN_DEFAULTS``). ``--set section.key=value`` overrides any entry. The run writes ``results.json`` (accuracies,
losses, data statistics, model size, timing) and ``log.jsonl`` (one line per logging / evaluation event) into the
output directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence

import torch
import yaml
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from modeling_bst import BSTConfig, BSTForSequenceClassification
from training import listops
from training.optim import parameter_groups


TRAIN_DEFAULTS = {
    "output_dir": "runs/lra",
    "max_steps": None,  # overrides num_train_epochs when set
    "num_train_epochs": 1,
    "batch_size": 32,
    "eval_batch_size": 64,
    "gradient_accumulation_steps": 1,
    "learning_rate": 1e-3,
    "ssm_lr": None,  # default: model.config.ssm_lr
    "weight_decay": 0.05,
    "warmup_ratio": 0.1,
    "init_lr": 1e-7,  # warm-up starts here ...
    "min_lr": 1e-7,  # ... and the cosine ends here
    "adam_betas": [0.9, 0.999],
    "max_grad_norm": 1.0,
    "logging_steps": 10,
    "eval_steps": None,  # None: evaluate on val only at the end
    "max_eval_samples": None,  # cap on the val set used during training (final val/test use everything)
    "group_by_length": True,
    "bf16": False,
    "seed": 0,
    "num_threads": None,
}
DATA_DEFAULTS = {"train": 96000, "val": 2000, "test": 2000, "min_length": 500, "max_length": 2000, "seed": 0}


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------
class ListOpsDataset(Dataset):
    """Examples ``{"source", "target"}`` as ``{"input_ids": list[int], "labels": int}``."""

    def __init__(self, examples: Sequence[dict]):
        self.input_ids = [listops.encode(ex["source"]) for ex in examples]
        self.labels = [int(ex["target"]) for ex in examples]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class PaddingCollator:
    """Pads ``input_ids`` with ``pad_id`` on the right (or left) and builds ``attention_mask``."""

    def __init__(self, pad_id: int = listops.PAD_ID, side: str = "right", pad_to_multiple_of: int | None = None):
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
        self.pad_id, self.side, self.multiple = pad_id, side, pad_to_multiple_of

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
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


def load_task_data(task: str, data_dir: str | None, generate: int | None, data_cfg: dict) -> dict[str, list[dict]]:
    if task != "listops":
        raise NotImplementedError(f"LRA task {task!r} is not implemented yet (only 'listops').")
    if data_dir is not None:
        return listops.load_splits(data_dir)
    sizes = {"train": generate if generate is not None else data_cfg["train"], "val": data_cfg["val"]}
    sizes["test"] = data_cfg["test"]
    return listops.generate_splits(
        sizes,
        seed=data_cfg["seed"],
        min_length=data_cfg["min_length"],
        max_length=data_cfg["max_length"],
        **{k: data_cfg[k] for k in ("max_depth", "max_args", "p_op") if k in data_cfg},
    )


# --------------------------------------------------------------------------------------------------------------------
# Optimiser
# --------------------------------------------------------------------------------------------------------------------
def warmup_cosine(total_steps: int, warmup_steps: int, start_ratio: float, end_ratio: float):
    """LR multiplier: linear from ``start_ratio`` to 1 over ``warmup_steps``, then cosine down to ``end_ratio``."""

    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return start_ratio + (1.0 - start_ratio) * step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return end_ratio + (1.0 - end_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def build_optimizer(model, tcfg: dict, total_steps: int):
    lr = float(tcfg["learning_rate"])
    ssm_lr = tcfg["ssm_lr"] if tcfg["ssm_lr"] is not None else model.config.ssm_lr
    ssm_lr = lr if ssm_lr is None else float(ssm_lr)  # None: the main learning rate
    # decayed weights, undecayed 1-D parameters, the SSM parameters at ssm_lr without decay (training.optim)
    groups = parameter_groups(model, lr, float(tcfg["weight_decay"]), ssm_lr)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(float(b) for b in tcfg["adam_betas"]))
    warmup = int(round(float(tcfg["warmup_ratio"]) * total_steps))
    lambdas = [
        warmup_cosine(total_steps, warmup, float(tcfg["init_lr"]) / g["lr"], float(tcfg["min_lr"]) / g["lr"])
        for g in groups
    ]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    return optimizer, scheduler


# --------------------------------------------------------------------------------------------------------------------
# Metrics and logging
# --------------------------------------------------------------------------------------------------------------------
def argmax_logits(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(-1)


def compute_accuracy(eval_pred) -> dict:
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    return {"accuracy": float((preds == labels).mean())}


class JsonlProgress(TrainerCallback):
    """Appends every log / evaluation dict to ``log.jsonl`` and prints a compact progress line."""

    def __init__(self, path: str, total_steps: int):
        self.path, self.total, self.t0 = path, total_steps, time.time()
        open(path, "w").close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        record = {"step": state.global_step, "elapsed_s": round(time.time() - self.t0, 1), **logs}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in logs.items()
            if k in ("loss", "learning_rate", "grad_norm", "train_loss") or k.endswith(("_loss", "_accuracy"))
        )
        if not shown:
            return
        print(f"[{record['elapsed_s']:7.1f}s] step {state.global_step}/{self.total} {shown}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------------
def load_config(path: str | None, overrides: Sequence[str] = ()) -> dict:
    cfg = {}
    if path is not None:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set expects section.key=value, got {item!r}.")
        section, name = key.split(".", 1)
        cfg.setdefault(section, {})[name] = yaml.safe_load(value)
    cfg["model"] = dict(cfg.get("model") or {})
    cfg["data"] = {**DATA_DEFAULTS, **(cfg.get("data") or {})}
    cfg["training"] = {**TRAIN_DEFAULTS, **(cfg.get("training") or {})}
    unknown = set(cfg["training"]) - set(TRAIN_DEFAULTS)
    if unknown:
        raise ValueError(f"Unknown training options {sorted(unknown)}; known: {sorted(TRAIN_DEFAULTS)}.")
    return cfg


def build_model(model_cfg: dict, max_length: int, seed: int) -> BSTForSequenceClassification:
    kwargs = {
        "bidirectional": True,
        "num_s4_head_layers": 2,
        "max_position_embeddings": max_length,
        **model_cfg,
        "vocab_size": listops.VOCAB_SIZE,
        "num_labels": listops.NUM_CLASSES,
        "pad_token_id": listops.PAD_ID,
    }
    kwargs.setdefault("bst_layer_indices", list(range(kwargs.get("num_hidden_layers", 12))))
    torch.manual_seed(seed)
    return BSTForSequenceClassification(BSTConfig(**kwargs))


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None):
    p = argparse.ArgumentParser(
        prog="python -m training.train_lra", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--task", default="listops", choices=["listops"])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="directory with train/val/test splits (.jsonl, .tsv or LRA basic_*.tsv)")
    src.add_argument("--generate", type=int, help="generate N training examples (val/test sizes from the config)")
    p.add_argument("--config", help="YAML config (configs/lra/*.yaml)")
    p.add_argument("--max_steps", type=int)
    p.add_argument("--output_dir")
    p.add_argument("--seed", type=int)
    p.add_argument("--num_threads", type=int, help="torch CPU threads")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config entry")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    tcfg, dcfg = cfg["training"], cfg["data"]
    for key in ("max_steps", "output_dir", "seed", "num_threads"):
        if getattr(args, key) is not None:
            tcfg[key] = getattr(args, key)
    if tcfg["num_threads"]:
        torch.set_num_threads(int(tcfg["num_threads"]))
    out_dir = tcfg["output_dir"]
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()

    splits = load_task_data(args.task, args.data, args.generate, dcfg)
    stats = {name: listops.split_stats(ex) for name, ex in splits.items()}
    max_len = max(s["max_length"] for s in stats.values() if s["n"])
    print(
        "data: " + ", ".join(f"{k} {v['n']} (len {v['min_length']}-{v['max_length']})" for k, v in stats.items()),
        flush=True,
    )
    datasets = {name: ListOpsDataset(ex) for name, ex in splits.items()}
    val_during = datasets["val"]
    if tcfg["max_eval_samples"] and len(val_during) > int(tcfg["max_eval_samples"]):
        val_during = torch.utils.data.Subset(val_during, range(int(tcfg["max_eval_samples"])))

    model = build_model(cfg["model"], max(max_len, int(dcfg["max_length"])), int(tcfg["seed"]))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, {len(model.config.bst_layer_indices)} BST layers "
          f"(of {model.config.num_hidden_layers}, bidirectional={model.config.bidirectional}) "
          f"+ {model.config.num_s4_head_layers} S4 layers, D={model.config.hidden_size}, "
          f"W={model.config.block_len}", flush=True)  # fmt: skip

    batch = int(tcfg["batch_size"]) * int(tcfg["gradient_accumulation_steps"])
    if tcfg["max_steps"]:
        total_steps = int(tcfg["max_steps"])
    else:
        total_steps = math.ceil(len(datasets["train"]) / batch) * int(tcfg["num_train_epochs"])
    eval_steps = tcfg["eval_steps"]
    targs = TrainingArguments(
        output_dir=out_dir,
        max_steps=total_steps,
        per_device_train_batch_size=int(tcfg["batch_size"]),
        per_device_eval_batch_size=int(tcfg["eval_batch_size"]),
        gradient_accumulation_steps=int(tcfg["gradient_accumulation_steps"]),
        learning_rate=float(tcfg["learning_rate"]),
        weight_decay=float(tcfg["weight_decay"]),
        max_grad_norm=float(tcfg["max_grad_norm"]),
        logging_steps=int(tcfg["logging_steps"]),
        logging_first_step=True,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=int(eval_steps) if eval_steps else None,
        save_strategy="no",
        report_to="none",
        seed=int(tcfg["seed"]),
        train_sampling_strategy="group_by_length" if tcfg["group_by_length"] else "random",
        bf16=bool(tcfg["bf16"]),
        disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    optimizer, scheduler = build_optimizer(model, tcfg, total_steps)
    trainer = Trainer(
        model=model,
        args=targs,
        data_collator=PaddingCollator(),
        train_dataset=datasets["train"],
        eval_dataset=val_during,
        compute_metrics=compute_accuracy,
        preprocess_logits_for_metrics=argmax_logits,
        optimizers=(optimizer, scheduler),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(JsonlProgress(os.path.join(out_dir, "log.jsonl"), total_steps))

    train_out = trainer.train()
    val = trainer.evaluate(datasets["val"], metric_key_prefix="val")
    test = trainer.evaluate(datasets["test"], metric_key_prefix="test")
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    results = {
        "task": args.task,
        "command": "python -m training.train_lra " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": cfg,
        "data_source": args.data if args.data else f"generated (train={len(datasets['train'])}, seed={dcfg['seed']})",
        "data": stats,
        "model_parameters": n_params,
        "steps": trainer.state.global_step,
        "examples_seen": trainer.state.global_step * batch,
        "train_loss": train_out.training_loss,
        "last_logged_loss": losses[-1] if losses else None,
        "val_accuracy": val["val_accuracy"],
        "val_loss": val["val_loss"],
        "test_accuracy": test["test_accuracy"],
        "test_loss": test["test_loss"],
        "chance_accuracy": 1.0 / listops.NUM_CLASSES,
        "test_majority_accuracy": stats["test"]["majority_accuracy"],
        # The honest constant baseline: always predict the most frequent training label.
        "test_accuracy_of_train_majority_class": stats["test"]["label_counts"][str(stats["train"]["majority_class"])]
        / stats["test"]["n"],
        "train_runtime_s": train_out.metrics.get("train_runtime"),
        "wall_time_s": time.time() - t_start,
        "torch_threads": torch.get_num_threads(),
        "device": str(trainer.args.device),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(
        f"done: val_accuracy={results['val_accuracy']:.4f} test_accuracy={results['test_accuracy']:.4f} "
        f"(chance 0.10, test majority {results['test_majority_accuracy']:.3f}) -> {out_dir}/results.json",
        flush=True,
    )
    return results


if __name__ == "__main__":
    main()
