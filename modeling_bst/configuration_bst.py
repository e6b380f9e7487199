"""Configuration of the Block-State Transformer (BST) family: BST (SH / MH / MF context states over S4 or "unstruct"
SSM kernels) and the paper's Table 1 baselines; ``docs/paper-mapping.md`` maps each field onto the paper."""

import math
from typing import Literal

from huggingface_hub import errors
from huggingface_hub.dataclasses import strict, validated_field
from transformers import PreTrainedConfig


# The kinds of layer (``BSTConfig.layer_kind``) and their names in ``layer_types``, also their cache layers' names in
# transformers' process-wide registry (hence the prefix). The bare kinds are accepted as input.
LAYER_TYPE_NAMES = {"block": "bst_block", "bst": "bst_context", "recurrent": "bst_recurrent", "gss": "bst_gss"}
LAYER_TYPES = tuple(LAYER_TYPE_NAMES)
LAYER_KINDS = {**{kind: kind for kind in LAYER_TYPES}, **{name: kind for kind, name in LAYER_TYPE_NAMES.items()}}
# The index fields: keyword arguments and config.json keys, each listing the layers of one kind.
LAYER_INDEX_FIELDS = {"bst": "bst_layer_indices", "recurrent": "recurrent_layer_indices", "gss": "gss_layer_indices"}
LAYER_FIELDS = ("num_hidden_layers", "layer_types", *LAYER_INDEX_FIELDS.values())

# Every Auto class of the package, written into config.json so that a saved folder loads with any of them under
# ``trust_remote_code=True`` (``save_pretrained`` alone lists only the saved class). Matches ``__init__.py``.
AUTO_MAP = {
    "AutoConfig": "configuration_bst.BSTConfig",
    "AutoModel": "modeling_bst.BSTModel",
    "AutoModelForCausalLM": "modeling_bst.BSTForCausalLM",
    "AutoModelForSequenceClassification": "modeling_bst.BSTForSequenceClassification",
}


def _default_logit_scale(vocab_size) -> float:
    return 1.0 / math.sqrt(vocab_size)


class BSTConfigError(errors.StrictDataclassError, ValueError):
    """An invalid [`BSTConfig`] layer record; the message names the field."""


def _checked(requirement, condition, default):
    def check(value):
        if value is not None and not condition(value):
            raise ValueError(f"must be {requirement}, got {value!r}.")

    return validated_field(check, default=default)


POSITIVE = ("a positive integer", lambda v: v > 0)
RATE = ("in [0, 1)", lambda v: 0 <= v < 1)
LAYER_NAMES = (f"a list of layer types {tuple(LAYER_KINDS)}", lambda v: all(t in LAYER_KINDS for t in v))


def _indices_of(layer_types, kind) -> list[int]:
    return [i for i, t in enumerate(layer_types) if LAYER_KINDS[t] == kind]


def _error(message) -> BSTConfigError:
    return BSTConfigError(f"BSTConfig.{message}")


def _from_indices(n: int, indices: dict) -> list[str]:
    """``layer_types`` of ``n`` layers from the index fields ``indices`` (kind -> layers), the others blocks."""
    built = ["block"] * n
    for kind, layers in indices.items():
        field = LAYER_INDEX_FIELDS[kind]
        if not isinstance(layers, (list, tuple)) or not all(type(i) is int for i in layers):
            raise _error(f"{field} must be a list of layer indices (int), got {layers!r}.")
        if len(set(layers)) != len(layers):
            raise _error(f"{field} has repeated entries: {list(layers)}.")
        if bad := [i for i in layers if not 0 <= i < n]:
            raise _error(f"{field} entries must be in [0, num_hidden_layers={n}), got out-of-range {bad}.")
        if clash := [i for i in layers if built[i] != "block"]:
            other = LAYER_INDEX_FIELDS[built[clash[0]]]
            raise _error(f"{field}: layers {clash} are in both {other} and {field}; a layer has one type.")
        for i in layers:
            built[i] = kind
    return [LAYER_TYPE_NAMES[kind] for kind in built]


def _index_field(kind):
    """The index field of ``kind``: read from ``layer_types``; set only when the config is made."""
    field = LAYER_INDEX_FIELDS[kind]

    def refuse(self, value):
        raise _error(f"{field} is read from layer_types: assign config.layer_types, or make a config with {field}=.")

    return property(lambda self: _indices_of(self.layer_types, kind), refuse, doc=f"The layers of kind {kind!r}.")


@strict
class BSTConfig(PreTrainedConfig):
    r"""Configuration for [`BSTModel`], [`BSTForCausalLM`] and [`BSTForSequenceClassification`]: ``layer_types`` is the
    one record of the layer types, the index fields are read from it (docs/architecture.md, "Configuration")."""

    model_type = "bst"
    keys_to_ignore_at_inference = ["past_key_values"]
    layer_fields = LAYER_FIELDS  # what ``from_dict`` applies before construction (a class attribute, not a field)

    vocab_size: int = _checked(*POSITIVE, 32000)  # tied input and output embeddings
    hidden_size: int = _checked(*POSITIVE, 1024)  # D
    num_hidden_layers: int = _checked(*POSITIVE, 12)
    # per layer "bst_block" (Slide), "bst_context" (SSM + context cross-attention), "bst_recurrent" (Block-Recurrent)
    # or "bst_gss" (Gated State Space); the kinds "block", "bst", "recurrent", "gss" are read as these
    layer_types: list[str] | tuple[str, ...] | None = _checked(*LAYER_NAMES, None)
    num_attention_heads: int = _checked(*POSITIVE, 8)  # H, for self-, cross- and context attention
    head_dim: int = _checked(*POSITIVE, 128)  # d_h (H * d_h need not be D)
    intermediate_size: int = _checked(*POSITIVE, 4096)  # ReLU MLP width
    max_position_embeddings: int = _checked(*POSITIVE, 4096)  # training length; the taps of an unstruct filter
    block_len: int = _checked(*POSITIVE, 512)  # block and window length W
    context_mode: Literal["sh", "mh", "mf"] = "sh"  # single-head, multi-head or multi-filter context states
    ssm_kind: Literal["s4", "unstruct"] = "s4"  # diagonal S4 (S4D) or a Hyena-style filter
    ssm_state_size: int = _checked("even and positive", lambda v: v > 0 and v % 2 == 0, 16)  # N: N/2 complex modes
    num_context_states: int = _checked(*POSITIVE, 32)  # S, MF filters / context states per block
    mf_independent_filters: bool = False  # MF over S4: one SSM per filter, not S read-outs of one state
    num_recurrent_states: int = _checked(*POSITIVE, 512)  # Block-Recurrent state vectors
    bidirectional: bool = False  # two-sided SSM, unmasked attention (classification)
    ssm_hidden_size: int | None = _checked(*POSITIVE, None)  # D_s; None: D/4 (SH, MH), D/8 (MF)
    ssm_init: Literal["lin", "inv"] = "lin"  # S4D initialisation of the state matrix
    ssm_dt_min: float | int = 1e-3  # range of the log-uniform step size initialisation
    ssm_dt_max: float | int = 1e-1
    ssm_lr: float | int | None = None  # learning rate of the SSM parameters (no weight decay); None: the main one
    ssm_input: Literal["normed", "raw"] = "normed"  # what the SSM reads: the normed layer input or the raw one
    unstruct_emb_dim: int = _checked("odd and >= 3", lambda v: v >= 3 and v % 2, 33)  # Hyena filter MLP shape
    unstruct_order: int = _checked(*POSITIVE, 64)
    unstruct_num_inner_mlps: int = 2
    unstruct_sin_freq: float | int = 14.0
    unstruct_decay_target: float | int = 1e-2  # Hyena exponential decay envelope
    unstruct_decay_fast: float | int = 0.3
    unstruct_decay_slow: float | int = 1.5
    unstruct_finite_filter: bool = True  # zero taps beyond max_position_embeddings (False: refuse longer inputs)
    attend_self: bool = False  # the window holds the W previous tokens (False) or the W latest, the token's own too
    attention_query_chunk: int | None = _checked(*POSITIVE, None)  # queries per window call, divides W; None: auto
    cross_mask: Literal["inclusive", "strict"] = "inclusive"  # SH/MH context state j seen at i >= j or i > j
    qk_norm: bool = True  # L2-normalised queries and keys with a learned per-head logit scale
    attn_scale_init: float | int | None = None  # that scale's start; None: sqrt(d_h), 1/sqrt(d_h) without qk_norm
    relative_attention_num_buckets: int = _checked(*POSITIVE, 32)  # T5 relative position bias
    relative_attention_max_distance: int = _checked(*POSITIVE, 128)
    # multiplies the logits; None: 1/sqrt(vocab_size), stored as that number, which follows vocab_size while it is
    # that number (a model's resize_token_embeddings keeps its trained scale)
    logit_scale: float | int | None = None
    rms_norm_eps: float | int = 1e-6
    dropout: float | int = _checked(*RATE, 0.05)
    attention_dropout: float | int = _checked(*RATE, 0.05)
    final_dropout: float | int | None = _checked(*RATE, None)  # before the LM head; None: dropout
    mf_context_ids_after_norm: bool = False  # add MF's context IDs after the context norm (meliad), not before
    mf_initial_context: Literal["lifted", "ssm_output"] = "lifted"  # where block 0's learned MF context lives
    meliad_dropout: bool = False  # dropout where meliad has it (see docs/paper-mapping.md, "Dropout")
    init_truncation_correction: bool = True  # meliad's variance correction of the truncated-normal init
    initializer_range: float | int = 1.0  # std of the embedding init
    use_cache: bool = True
    tie_word_embeddings: bool = True
    num_s4_head_layers: int = _checked("an integer >= 0", lambda v: v >= 0, 0)  # S4 layers atop the classifier
    gss_expansion: int = _checked(*POSITIVE, 3)  # GSS gate width, in multiples of D
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # The index fields, read from ``layer_types`` (a new list on every read).
    bst_layer_indices = _index_field("bst")
    recurrent_layer_indices = _index_field("recurrent")
    gss_layer_indices = _index_field("gss")

    def __post_init__(self, **kwargs):
        indices = {kind: v for kind, field in LAYER_INDEX_FIELDS.items() if (v := kwargs.pop(field, None)) is not None}
        if self.layer_types is None:
            self.layer_types = _from_indices(self.num_hidden_layers, {"bst": [0, 7, 9]} | indices)
        elif indices:  # given both: they must agree
            self.validate_layer_type()
            _from_indices(self.num_hidden_layers, indices)  # the index fields' own checks
            for kind, layers in indices.items():
                if (at := _indices_of(self.layer_types, kind)) != sorted(layers):
                    raise _error(
                        f"{LAYER_INDEX_FIELDS[kind]}={list(layers)} disagrees with layer_types={list(self.layer_types)}"
                        f"; give one of them (layer_types lists {LAYER_TYPE_NAMES[kind]!r} at {at})."
                    )
        super().__post_init__(**kwargs)
        # Entries already present (a loaded config.json; on the Hub "org/name--module.Class") are kept.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    def __setattr__(self, name, value):
        # Runs after ``@strict`` has checked the value's type and range.
        made = self.__dict__.get("_post_init_done")
        if name == "layer_types" and value is None and made:  # None selects the index fields when made only
            raise _error("layer_types must be a list of layer types, got None.")
        if name == "layer_types" and value is not None:  # the names, also for the bare kinds
            value = [LAYER_TYPE_NAMES[LAYER_KINDS[t]] for t in value]
        if name == "logit_scale" and value is None:
            value = _default_logit_scale(self.vocab_size)
        if name == "vocab_size" and made and self.logit_scale == _default_logit_scale(self.vocab_size):
            super().__setattr__("logit_scale", _default_logit_scale(value))
        super().__setattr__(name, value)

    def to_dict(self):  # the index fields in place of layer_types
        output = super().to_dict()
        types = output.pop("layer_types", None) or ()
        output.update({field: _indices_of(types, kind) for kind, field in LAYER_INDEX_FIELDS.items()})
        return output

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As transformers', but the layer fields among ``kwargs`` make the config (docs/architecture.md)."""
        layers = {key: kwargs.pop(key) for key in LAYER_FIELDS if key in kwargs}
        if "layer_types" in layers:
            config_dict = {k: v for k, v in config_dict.items() if k not in LAYER_INDEX_FIELDS.values()}
        return super().from_dict({**config_dict, **layers}, **kwargs)

    def layer_kind(self, layer_idx: int) -> str:
        """The kind of layer ``layer_idx``: ``"block"``, ``"bst"``, ``"recurrent"`` or ``"gss"``."""
        self.validate_layer_type()  # assigned one by one, num_hidden_layers and layer_types may disagree
        return LAYER_KINDS[self.layer_types[layer_idx]]

    @property
    def ssm_channels(self) -> int:
        """D_s, the SSM width after the down-projection."""
        return self.ssm_hidden_size or max(1, self.hidden_size // (8 if self.context_mode == "mf" else 4))

    @property
    def ssm_output_channels(self) -> int:
        """SSM read-outs per channel: 1 (SH), H (MH) or S (MF)."""
        return {"sh": 1, "mh": self.num_attention_heads, "mf": self.num_context_states}[self.context_mode]

    @property
    def resolved_attn_scale_init(self) -> float:
        if self.attn_scale_init is not None:
            return self.attn_scale_init
        return math.sqrt(self.head_dim) if self.qk_norm else 1.0 / math.sqrt(self.head_dim)

    @property
    def resolved_attention_query_chunk(self) -> int:
        """Queries per sliding-window call on the CPU: W/4 for W >= 256, W/2 for W >= 128, else W, when not given."""
        w = self.block_len
        split = 4 if w >= 256 and w % 4 == 0 else 2 if w >= 128 and w % 2 == 0 else 1
        return self.attention_query_chunk or w // split

    @property
    def resolved_final_dropout(self) -> float:
        return self.dropout if self.final_dropout is None else self.final_dropout

    def validate_layer_type(self):  # transformers' check knows only its attention kinds
        if self.layer_types is None or len(self.layer_types) != self.num_hidden_layers:
            n, given = self.num_hidden_layers, self.layer_types
            raise _error(f"layer_types must have num_hidden_layers={n} entries, got {given}.")

    def validate_bst(self):
        """The checks that relate fields."""
        chunk, dt = self.attention_query_chunk, (self.ssm_dt_min, self.ssm_dt_max)
        if chunk is not None and self.block_len % chunk:
            raise ValueError(f"BSTConfig.attention_query_chunk={chunk} must divide block_len={self.block_len}.")
        if not 0 < dt[0] <= dt[1]:
            raise ValueError(f"BSTConfig.ssm_dt_min, ssm_dt_max = {dt} must satisfy 0 < ssm_dt_min <= ssm_dt_max.")
        if self.mf_independent_filters and (self.context_mode, self.ssm_kind) != ("mf", "s4"):
            raise ValueError("BSTConfig.mf_independent_filters=True needs context_mode='mf' and ssm_kind='s4'.")
        if self.bidirectional and self.recurrent_layer_indices:
            raise ValueError("BSTConfig: bidirectional=True is incompatible with recurrent_layer_indices (causal).")


__all__ = ["AUTO_MAP", "BSTConfig", "BSTConfigError", "LAYER_INDEX_FIELDS", "LAYER_TYPE_NAMES", "LAYER_TYPES"]
