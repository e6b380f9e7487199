"""The ``model_type: "bst"`` config of a BST checkpoint as the plugin reads it.

vLLM pins an older transformers than ``modeling_bst`` needs, so the plugin reads config.json itself: this class
takes every key that ``modeling_bst.BSTConfig`` writes, with the same defaults for the ones the serving maths uses,
and rebuilds the layer types (``bst_layer_types``) from the index fields (config.json stores ``bst_layer_indices``,
``recurrent_layer_indices`` and ``gss_layer_indices``). [`check_supported`] refuses what the plugin cannot serve
(a bidirectional encoder; an unstruct model without a finite filter served beyond its length), naming the config
field.
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
    num_recurrent_states=512,
    gss_expansion=3,
    unstruct_emb_dim=33,
    unstruct_order=64,
    unstruct_num_inner_mlps=2,
    unstruct_sin_freq=14.0,
    unstruct_decay_target=1e-2,
    unstruct_decay_fast=0.3,
    unstruct_decay_slow=1.5,
    unstruct_finite_filter=True,
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


def check_supported(config, max_model_len: int | None = None) -> None:
    """Raise ``ValueError`` naming the config field for a checkpoint the plugin cannot serve (``max_model_len``: the
    engine's longest sequence, where known)."""
    bad = {t for t in config.bst_layer_types if t not in ("block", "bst", "recurrent", "gss")}
    if bad:
        raise ValueError(f"BST serving: unknown layer_types {sorted(bad)}.")
    if config.bidirectional:
        raise ValueError(
            "BST serving: bidirectional=True is an encoder (classification) model; only causal models serve."
        )
    if "bst" in config.bst_layer_types:
        if config.ssm_kind not in ("s4", "unstruct"):
            raise ValueError(f"BST serving: unknown ssm_kind={config.ssm_kind!r}.")
        if config.context_mode not in ("sh", "mh", "mf"):
            raise ValueError(f"BST serving: unknown context_mode={config.context_mode!r}.")
        lmax = config.max_position_embeddings
        if config.ssm_kind == "unstruct" and not config.unstruct_finite_filter and (max_model_len or 0) > lmax:
            raise ValueError(
                f"BST serving: unstruct_finite_filter=False and max_model_len={max_model_len} > "
                f"max_position_embeddings={lmax}: such a model generates at most {lmax} tokens (its filter has no "
                "taps beyond them); serve it with max_model_len <= max_position_embeddings."
            )
