"""One colour per model across every figure of docs/results/ (the experiments draw with these; research/plots.py
redraws every figure from the committed records).

Colours belong to model names (the records' ``model``, with an MQAR ablation's ``+field=value`` tag): a model has
the same colour in every panel and every figure, and no two models of the records share one. A model that is the
same configuration under two experiments' names (BRecT is ``brect`` in MQAR and ``brect-fixed-skip`` in the LM runs;
the smooth Hyena filters and the ten times slower dt range are an MQAR ablation and an LM model) has one colour.
Line styles say the family: BST solid, the others dashed, the full-attention reference dotted; an ablation of a
model is drawn with square markers.
"""

from __future__ import annotations

import hashlib


# Base models: the families of the paper, and the references.
BASE = {
    "attention": "#000000",  # MQAR's full-attention reference (W = L)
    "slide": "#1f77b4",
    "trsf-xl": "#8c564b",
    "brect-fixed-skip": "#17becf",
    "bst-sh-s4": "#ff7f0e",
    "bst-mh-s4": "#d62728",
    "bst-mf-s4": "#2ca02c",
    "bst-sh-unstruct": "#9467bd",
    "bst-mf-unstruct": "#e377c2",
    "gss-hybrid": "#bcbd22",
    "mamba": "#7f7f7f",
}
# Variants (ablations) of a base model: a colour of their own, none a base model's.
VARIANTS = {
    "bst-sh-s4-n8": "#ffbb78",
    "bst-sh-s4-n32": "#a55194",
    "bst-sh-s4-n64": "#8c6d31",
    "bst-sh-s4-ssmlr": "#843c39",
    "bst-sh-s4-dtlong": "#393b79",
    "bst-sh-s4-layers13": "#637939",
    "bst-sh-s4-rawssm": "#6baed6",
    "bst-mf-s4-ds32": "#98df8a",
    "bst-mf-s4-indep": "#005a32",
    "bst-mf-s4-s16": "#1b9e77",
    "brect-fixed-skip-nostream": "#9edae5",
    "bst-sh-unstruct-smooth": "#e7298a",
    "bst-sh-unstruct+unstruct_decay_target=0.5": "#b15928",
    "bst-sh-unstruct+unstruct_sin_freq=1": "#e6ab02",
    "bst-sh-s4+curriculum=256x1500": "#fb9a99",
}
# One model under two names: the second takes the first's colour.
SAME_MODEL = {
    "brect": "brect-fixed-skip",
    "bst-sh-s4+ssm_dt_max=0.01+ssm_dt_min=0.0001": "bst-sh-s4-dtlong",
    "bst-sh-unstruct+unstruct_decay_target=0.5+unstruct_sin_freq=1": "bst-sh-unstruct-smooth",
}
COLOURS = {**BASE, **VARIANTS}
# For a name not listed above (a new ablation): a colour picked from its name, never one of the listed ones.
SPARE = ("#66a61e", "#7570b3", "#a6761d", "#d95f02", "#e41a1c", "#4daf4a", "#984ea3", "#ff7f00", "#a65628", "#f781bf")


def canonical(name: str) -> str:
    """The name whose colour ``name`` has (itself, unless it is another experiment's name of the same model)."""
    return SAME_MODEL.get(name, name)


def colour(name: str) -> str:
    """The colour of model ``name`` (a record's ``model``, plus an MQAR ablation's tag) in every figure."""
    name = canonical(name)
    if name in COLOURS:
        return COLOURS[name]
    return SPARE[int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(SPARE)]


def is_variant(name: str) -> bool:
    """Whether ``name`` is an ablation of a base model (drawn with square markers)."""
    return canonical(name) not in BASE


def linestyle(name: str) -> str:
    """BST solid, the other families dashed, the full-attention reference dotted."""
    base = canonical(name)
    return ":" if base == "attention" else "-" if base.startswith("bst") else "--"


def marker(name: str) -> str:
    return "s" if is_variant(name) else "o"


def figure_legend(fig, axes, **kwargs) -> None:
    """One legend for the whole figure, right of its panels (so that it covers no curve), with every label that any
    panel draws, once, in the order the panels first draw them."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    kw = dict(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    fig.legend(list(seen.values()), list(seen), **{**kw, **kwargs})


def fitted_ylim(values: list[float], floor: float | None = None, top: float | None = None) -> tuple[float, float]:
    """A y range that fits ``values`` (and ``floor``, e.g. chance, when given): from 0 to a margin above the largest,
    at most ``top``."""
    hi = max([*values, *([floor] if floor is not None else [])])
    upper = hi * 1.15 if hi > 0 else 1.0
    return 0.0, upper if top is None else min(top, upper)
