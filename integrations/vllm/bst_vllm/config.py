"""The ``model_type: "bst"`` config of a BST checkpoint as the plugin reads it.

vLLM pins an older transformers than ``modeling_bst`` needs, so the plugin reads config.json itself: this class
takes every key that ``modeling_bst.BSTConfig`` writes, with the same defaults for the ones the serving maths uses,
and rebuilds the layer types (``bst_layer_types``) from the index fields (config.json stores ``bst_layer_indices``,
``recurrent_layer_indices`` and ``gss_layer_indices``). [`check_supported`] refuses what the plugin cannot serve,
naming the config field.
"""

import math

from transformers import PretrainedConfig


DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=8,
    head_dim=128,
    intermediate_size=4096,
    max_position_embeddings=4096,
    block_len=512,
    context_mode="sh",
    ssm_kind="s4",
    ssm_state_size=16,
    num_context_states=32,
    mf_independent_filters=False,
    bidirectional=False,
    ssm_hidden_size=None,
    ssm_input="normed",
    attend_self=False,
    cross_mask="inclusive",
    qk_norm=True,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    logit_scale=None,
    rms_norm_eps=1e-6,
    mf_context_ids_after_norm=False,
    mf_initial_context="lifted",
)
INDEX_FIELDS = {"bst": "bst_layer_indices", "recurrent": "recurrent_layer_indices", "gss": "gss_layer_indices"}


class BSTServingConfig(PretrainedConfig):
    """A BST checkpoint's config.json (``model_type`` "bst") for serving; unknown keys are kept as attributes."""

    model_type = "bst"

    def __init__(self, layer_types=None, tie_word_embeddings=True, **kwargs):
        indices = {kind: kwargs.pop(field, None) for kind, field in INDEX_FIELDS.items()}
        for name, default in DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        if layer_types is None:
            layer_types = ["block"] * self.num_hidden_layers
            given = indices if indices["bst"] is not None else {**indices, "bst": [0, 7, 9]}
            for kind, layers in given.items():
                for i in layers or ():
                    layer_types[i] = kind
        # Not ``layer_types``: transformers checks that attribute against its own attention kinds.
        self.bst_layer_types = list(layer_types)
        if self.logit_scale is None:
            self.logit_scale = 1.0 / math.sqrt(self.vocab_size)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def ssm_channels(self) -> int:
        """D_s, the SSM width: ``ssm_hidden_size``, else D/4 (SH, MH) or D/8 (MF)."""
        if self.ssm_hidden_size is not None:
            return self.ssm_hidden_size
        return max(1, self.hidden_size // (8 if self.context_mode == "mf" else 4))

    @property
    def ssm_output_channels(self) -> int:
        """SSM read-outs per channel: 1 (SH), H (MH) or S (MF)."""
        return {"sh": 1, "mh": self.num_attention_heads, "mf": self.num_context_states}[self.context_mode]

    def to_dict(self):
        output = super().to_dict()
        types = output.pop("bst_layer_types", [])
        for kind, field in INDEX_FIELDS.items():
            output[field] = [i for i, t in enumerate(types) if t == kind]
        return output


def check_supported(config) -> None:
    """Raise ``ValueError`` naming the config field for a checkpoint the plugin cannot serve."""
    bad = {t for t in config.bst_layer_types if t not in ("block", "bst")}
    if bad:
        which = ", ".join(sorted(INDEX_FIELDS[t] for t in bad if t in INDEX_FIELDS)) or f"layer_types {sorted(bad)}"
        raise ValueError(
            f"BST serving: {which} is not empty; the vLLM plugin serves block (Slide) and BST layers only, not "
            "Block-Recurrent (recurrent_layer_indices) or GSS (gss_layer_indices) layers."
        )
    if config.bidirectional:
        raise ValueError(
            "BST serving: bidirectional=True is an encoder (classification) model; only causal models serve."
        )
    if "bst" in config.bst_layer_types:
        if config.ssm_kind != "s4":
            raise ValueError(
                f"BST serving: ssm_kind={config.ssm_kind!r} is not supported (the plugin serves ssm_kind='s4'; an "
                "'unstruct' filter keeps a state that grows with the sequence)."
            )
        if config.mf_independent_filters:
            raise ValueError("BST serving: mf_independent_filters=True is not supported (one SSM per MF filter).")
        if config.context_mode not in ("sh", "mh", "mf"):
            raise ValueError(f"BST serving: unknown context_mode={config.context_mode!r}.")
