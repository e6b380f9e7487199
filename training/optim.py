"""Optimizer parameter groups for BST language models (the paper: Adam; S4 practice for the SSM parameters).

The one home of the groups: the Trainer of ``training/train.py`` (every task: language models and the LRA ListOps
classifier) and the research scripts (``research/mqar.py``, ``research/long_range_recall.py``) all build them with
:func:`parameter_groups`; the rules they pick (which parameters are the SSM's, which go without weight decay) are the
named functions of this module.

Three groups: weights with weight decay; one-dimensional parameters (biases, norm scales, per-head scales) and
embeddings' tied copies without decay; SSM parameters (``model.ssm_parameter_names()``: the S4D state matrix, B and
dt, the whole unstruct implicit filter, its MLP's biases included) with their own learning rate and no weight decay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


# Hugging Face Mamba's SSM parameters (its paper: the state matrix A_log, the skip D and the step size's bias)
MAMBA_SSM_SUFFIXES = ("A_log", ".D", "dt_proj.bias")


def ssm_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the SSM parameters: ``model.ssm_parameter_names()`` when the model defines it (BST); for Hugging
    Face Mamba (``config.model_type == "mamba"``) its ``A_log``, ``D`` and ``dt_proj.bias``; else every parameter
    whose name contains ``"ssm"`` (a generic fallback for other architectures)."""
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    if hasattr(inner, "ssm_parameter_names"):
        return set(inner.ssm_parameter_names())
    if getattr(getattr(inner, "config", None), "model_type", None) == "mamba":
        return {n for n, _ in inner.named_parameters() if n.endswith(MAMBA_SSM_SUFFIXES)}
    return {n for n, _ in inner.named_parameters() if "ssm" in n.lower()}


def one_dimensional(name: str, param: torch.Tensor) -> bool:
    """The default no-decay rule: parameters with fewer than two dimensions (biases, norm scales, per-head scales)."""
    return param.ndim < 2


def norms_and_embeddings(name: str, param: torch.Tensor) -> bool:
    """No decay for one-dimensional parameters, norms and embeddings (the MQAR protocol's rule, ``research/mqar.py``:
    its committed checkpoints index the AdamW state in the group order this rule gives)."""
    return param.ndim < 2 or "norm" in name or "embed" in name


def decay_everything(name: str, param: torch.Tensor) -> bool:
    """No parameter outside the SSM group goes without weight decay (``research/long_range_recall.py``)."""
    return False


def parameter_groups(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    ssm_lr: float | None = None,
    *,
    ssm_names: Iterable[str] | None = None,
    no_decay: Callable[[str, torch.Tensor], bool] = one_dimensional,
) -> list[dict]:
    """Param groups ``[decay, no_decay, ssm]`` (empty groups left out) for ``torch.optim`` optimizers.

    ``ssm`` parameters (``ssm_names``, default :func:`ssm_parameter_names`) get ``lr=ssm_lr`` (``lr`` when None) and
    ``weight_decay=0``; other parameters for which ``no_decay(name, param)`` holds (default: fewer than two
    dimensions) get ``weight_decay=0``; the rest get ``weight_decay``. Frozen parameters are skipped. Each group
    carries a ``name`` key for logging. Every trainable parameter appears in exactly one group, in
    ``named_parameters`` order within its group (optimizer state is indexed in this order: checkpoints depend on it).
    """
    inner = getattr(model, "module", model)
    ssm = ssm_parameter_names(inner) if ssm_names is None else set(ssm_names)
    groups = {"decay": [], "no_decay": [], "ssm": []}
    seen: set[int] = set()
    for name, p in inner.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        if name in ssm:
            groups["ssm"].append(p)
        elif no_decay(name, p):
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    settings = {
        "decay": {"lr": lr, "weight_decay": weight_decay},
        "no_decay": {"lr": lr, "weight_decay": 0.0},
        "ssm": {"lr": lr if ssm_lr is None else ssm_lr, "weight_decay": 0.0},
    }
    return [{"name": k, "params": v, **settings[k]} for k, v in groups.items() if v]
