"""Writes training/presets/*.json: one preset per row of the paper's Table 1, plus tiny CPU presets.

Run ``python configs/build_presets.py`` after changing a preset here; ``tests/models/bst/test_presets.py`` checks every JSON
builds on the meta device with the parameter count recorded in ``PAPER_PARAMS_M`` (within 5%).
Decisions where the paper's text and its parameter counts disagree are recorded in docs/paper-mapping.md.
"""

import json
from pathlib import Path


OUT = Path(__file__).resolve().parents[1] / "training" / "presets"

# ~200M models (paper Sec. 4.1): 12 layers, D=1024, 8 heads of 128, ReLU MLP 4096, W=512, L=4096, 32k vocab.
BASE = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "head_dim": 128,
    "intermediate_size": 4096,
    "max_position_embeddings": 4096,
    "block_len": 512,
    "bst_layer_indices": [0, 7, 9],
    "context_mode": "sh",
    "ssm_kind": "s4",
    "ssm_state_size": 16,
    "num_context_states": 32,
    "recurrent_layer_indices": [],
    "num_recurrent_states": 512,
    "dropout": 0.05,
    "attention_dropout": 0.05,
}
# "-L" models: MLP 8192 and 16 heads (the counts, not the text's 12 heads), BST layers {0, 5, 7, 9}.
LARGE = {"intermediate_size": 8192, "num_attention_heads": 16, "bst_layer_indices": [0, 5, 7, 9]}

# GSS-Hybrid-L: 32 GSS layers with a Transformer layer at every 4th position from the 2nd: 32 + 11 = 43 layers.
GSS_HYBRID_L_LAYERS = 43

PRESETS = {
    "slide-12l": {"bst_layer_indices": []},
    "trsf-xl-2048": {"bst_layer_indices": [], "block_len": 2048, "max_position_embeddings": 2048},
    "brect-fixed-skip": {"bst_layer_indices": [], "recurrent_layer_indices": [9]},
    "bst-sh-s4": {},
    # D_s = D/2 for MH: with D/4 the per-head lifts give 204M, 6.5% short of the paper's 218M.
    "bst-mh-s4": {"context_mode": "mh", "ssm_hidden_size": 512},
    "bst-mf-s4": {"context_mode": "mf"},
    "bst-sh-unstruct": {"ssm_kind": "unstruct"},
    "bst-mf-unstruct": {"context_mode": "mf", "ssm_kind": "unstruct"},
    "bst-sh-s4-l": {**LARGE},
    # S = 64 filters with D_s = D/16 keeps the filter bank S * D_s = 4096 as in the small MF model (count: 383M).
    "bst-mf-s4-l": {**LARGE, "context_mode": "mf", "num_context_states": 64, "ssm_hidden_size": 64},
    "bst-sh-unstruct-l": {**LARGE, "ssm_kind": "unstruct"},
    "bst-mf-unstruct-l": {
        **LARGE,
        "context_mode": "mf",
        "ssm_kind": "unstruct",
        "num_context_states": 64,
        "ssm_hidden_size": 64,
    },
    # GSS-Hybrid-L (Mehta et al. 2022 as quoted in Table 1), as the paper words it: it "interleaves 32 GSS layers with
    # Transformer layers" (Sec. 4.1) placed "at every 4th layer starting with the 2nd layer" (App. B.2): 43 layers,
    # Transformer layers at 1, 5, ..., 41 (11), GSS layers elsewhere (32). The Transformer layers have the paper's
    # layer shape (8 heads, MLP 4096: the "-L" enlargement is stated for the BST models). 406.5M, +9% over the
    # paper's 373M (OUR_PARAMS_M); docs/paper-mapping.md has the other readings and their counts.
    "gss-hybrid-l": {
        "num_hidden_layers": GSS_HYBRID_L_LAYERS,
        "bst_layer_indices": [],
        "gss_layer_indices": [i for i in range(GSS_HYBRID_L_LAYERS) if i % 4 != 1],
    },
}

# Parameter counts of the paper's Table 1, in millions (32k vocabulary, tied embeddings).
PAPER_PARAMS_M = {
    "slide-12l": 190,
    "trsf-xl-2048": 190,
    "brect-fixed-skip": 196,
    "bst-sh-s4": 202,
    "bst-mh-s4": 218,
    "bst-mf-s4": 217,
    "bst-sh-unstruct": 206,
    "bst-mf-unstruct": 221,
    "bst-sh-s4-l": 366,
    "bst-mf-s4-l": 383,
    "bst-sh-unstruct-l": 371,
    "bst-mf-unstruct-l": 388,
    "gss-hybrid-l": 373,
}
# Presets whose shape follows the paper's text where its parameter count disagrees: the count they have, in millions
# (checked within 0.5%; both numbers are in docs/paper-mapping.md).
OUR_PARAMS_M = {"gss-hybrid-l": 406.5}

# A few million parameters: CPU training, tests and demos. Same structure, small sizes.
TINY = {
    **BASE,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "intermediate_size": 512,
    "max_position_embeddings": 1024,
    "block_len": 64,
    "bst_layer_indices": [0, 2],
    "num_context_states": 8,
    "num_recurrent_states": 32,
    "dropout": 0.0,
    "attention_dropout": 0.0,
}
TINY_PRESETS = {
    "bst-tiny-sh-s4": {},
    "bst-tiny-mh-s4": {"context_mode": "mh"},
    "bst-tiny-mf-s4": {"context_mode": "mf"},
    "bst-tiny-sh-unstruct": {"ssm_kind": "unstruct"},
    "bst-tiny-mh-unstruct": {"context_mode": "mh", "ssm_kind": "unstruct"},
    "bst-tiny-mf-unstruct": {"context_mode": "mf", "ssm_kind": "unstruct"},
    "slide-tiny": {"bst_layer_indices": []},
    "brect-tiny": {"bst_layer_indices": [], "recurrent_layer_indices": [2]},
    "trsf-xl-tiny": {"bst_layer_indices": [], "block_len": 256, "max_position_embeddings": 256},
    "gss-hybrid-tiny": {"bst_layer_indices": [], "gss_layer_indices": [0, 2, 3]},
}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, overrides in PRESETS.items():
        write(name, {**BASE, **overrides})
    for name, overrides in TINY_PRESETS.items():
        write(name, {**TINY, **overrides})


def write(name, fields):
    cfg = {"model_type": "bst", "architectures": ["BSTForCausalLM"], **fields}
    (OUT / f"{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
    main()
