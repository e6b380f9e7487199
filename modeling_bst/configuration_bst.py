"""Configuration of the Block-State Transformer (BST) model family.

One config class describes every model of the paper's Table 1: BST (SH / MH / MF context states over S4 or
"unstruct" SSM kernels), and the baselines Slide (no BST layers), Transformer-XL (one window as long as the
segment) and the Block-Recurrent Transformer (``recurrent_layer_indices``). See ``docs/paper-mapping.md`` for how
each field maps onto the paper and which ambiguities were decided how.

``BSTConfig`` is a ``@strict`` dataclass like transformers' in-tree configs (``LlamaConfig``): every field is an
annotated, defaulted class attribute. Its type and its own range (a positive width, a dropout rate in [0, 1), one
of the context modes, ...) are checked whenever the field is set, by ``__init__``, by ``from_dict`` /
``from_pretrained`` and by assignment; the checks that relate fields (an index below ``num_hidden_layers``, a query
chunk dividing ``block_len``, ...) are the ``validate_*`` methods, which ``__init__``, ``from_dict`` and
``save_pretrained`` run through ``validate()``. Every error is a [`BSTConfigError`] naming the field.
"""

import math
from dataclasses import fields
from typing import Literal, Union, get_args, get_origin

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import (
    StrictDataclassClassValidationError,
    StrictDataclassError,
    StrictDataclassFieldValidationError,
)
from transformers import PreTrainedConfig


CONTEXT_MODES = ("sh", "mh", "mf")
SSM_KINDS = ("s4", "unstruct")
SSM_INITS = ("lin", "inv")
CROSS_MASKS = ("inclusive", "strict")
SSM_INPUTS = ("normed", "raw")
# The kind of each layer (``BSTConfig.layer_kind``): a plain Block-Transformer ("Slide") layer, a BST layer (SSM +
# context cross-attention), a Block-Recurrent Transformer layer, or a Gated State Space layer.
LAYER_TYPES = ("block", "bst", "recurrent", "gss")
# Their names in ``BSTConfig.layer_types``, under which transformers' process-wide cache-layer registry holds BST's
# cache layers (``DynamicCache(config=...)`` builds one layer per name): prefixed, so that no other family's layer
# types collide (RecurrentGemma's blocks are "recurrent"). The bare kinds, which ``layer_types`` held before, are
# accepted as input and read as these names.
LAYER_TYPE_NAMES = {"block": "bst_block", "bst": "bst_context", "recurrent": "bst_recurrent", "gss": "bst_gss"}
LAYER_KINDS = {**{kind: kind for kind in LAYER_TYPES}, **{name: kind for kind, name in LAYER_TYPE_NAMES.items()}}
# The per-type index fields: keyword arguments of ``BSTConfig`` and keys of config.json (what it stores, see
# ``BSTConfig.to_dict``), read-only views of ``layer_types`` otherwise. Each lists the layers of one type.
LAYER_INDEX_FIELDS = {"bst": "bst_layer_indices", "recurrent": "recurrent_layer_indices", "gss": "gss_layer_indices"}
# The fields that describe the layers, set together by ``BSTConfig.update_layers``.
LAYER_FIELDS = ("num_hidden_layers", "layer_types", *LAYER_INDEX_FIELDS.values())
# ``bst_layer_indices`` when neither it nor ``layer_types`` is given.
DEFAULT_BST_LAYER_INDICES = (0, 7, 9)

# Every Auto class the package offers, as written into a saved ``config.json``: a folder written by
# ``save_pretrained`` (which copies these files next to the weights) then loads with any of them and
# ``trust_remote_code=True`` where ``modeling_bst`` is not installed. ``save_pretrained`` alone would list only the
# saved model's own class. Keep in sync with the ``register`` calls in ``__init__.py``.
AUTO_MAP = {
    "AutoConfig": "configuration_bst.BSTConfig",
    "AutoModel": "modeling_bst.BSTModel",
    "AutoModelForCausalLM": "modeling_bst.BSTForCausalLM",
    "AutoModelForSequenceClassification": "modeling_bst.BSTForSequenceClassification",
}


class BSTConfigError(StrictDataclassError, ValueError):
    """An invalid [`BSTConfig`] value; the message names the field.

    A ``ValueError`` (what ``BSTConfig`` raised before it became a strict dataclass, and what the training CLI and
    most callers catch) and a ``StrictDataclassError`` (what transformers' ``@strict`` configs raise)."""


# -- per-field checks: ``validated_field`` validators, run by ``@strict`` after the type check on every assignment --
# Each gets a value of the annotated type and raises ``ValueError`` with a message that ``_errors_name_the_field``
# prefixes with ``BSTConfig.<field>``.
def _positive(value):
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {value!r}.")


def _positive_or_none(value):
    if value is not None:
        _positive(value)


def _non_negative(value):
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {value!r}.")


def _positive_even(value):
    _positive(value)
    if value % 2:
        raise ValueError(f"must be even (N/2 complex-conjugate modes), got {value!r}.")


def _odd_at_least_3(value):
    if value < 3 or value % 2 == 0:
        raise ValueError(f"must be odd and >= 3, got {value!r}.")


def _rate(value):
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1), got {value!r}.")


def _layer_indices(value):
    if value is None:
        return
    negative = [i for i in value if i < 0]
    if negative:
        raise ValueError(f"entries must be layer indices >= 0, got {negative} in {list(value)}.")
    if len(set(value)) != len(value):
        raise ValueError(f"has repeated entries: {list(value)}.")


def _layer_type_entries(value):
    if value is not None and not all(t in LAYER_KINDS for t in value):
        raise ValueError(
            f"entries must be in {tuple(LAYER_TYPE_NAMES.values())} (or their earlier names {LAYER_TYPES}), got "
            f"{list(value)!r}."
        )


def _names(types) -> list[str]:
    """``layer_types`` entries (names, or the earlier bare kinds) as names."""
    return [LAYER_TYPE_NAMES[LAYER_KINDS[t]] for t in types]


# -- layer types: ``layer_types`` is the one record; the index fields are converted to it and derived from it --------
def _indices_of(layer_types, kind) -> list[int]:
    """The layers of one kind, ascending: what the index field of ``kind`` reads."""
    return [i for i, t in enumerate(layer_types or ()) if LAYER_KINDS[t] == kind]


def _checked_indices(name, value, num_layers) -> list[int]:
    """An index field's value as a sorted list: distinct layer indices in [0, num_layers); else a [`BSTConfigError`]
    naming the field."""
    if value is None:
        raise BSTConfigError(
            f"BSTConfig.{name} must be a list of layer indices (None selects the default only when the config is "
            "made); use [] for no such layers."
        )
    if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BSTConfigError(f"BSTConfig.{name} must be a list of layer indices (int), got {value!r}.")
    try:
        _layer_indices(value)
    except ValueError as e:
        raise BSTConfigError(f"BSTConfig.{name} {e}") from None
    bad = [i for i in value if i >= num_layers]
    if bad:
        raise BSTConfigError(
            f"BSTConfig.{name} entries must be in [0, num_hidden_layers={num_layers}), got out-of-range {bad}."
        )
    return sorted(value)


def _assign_indices(layer_types, indices: dict) -> list[str]:
    """``layer_types`` with the layers of ``indices`` (type -> checked index list) set to those types; they must be
    ``"block"`` layers of ``layer_types`` (and not claimed twice), else a [`BSTConfigError`] naming both fields."""
    types = list(layer_types)
    for kind, layers in indices.items():
        taken = {}
        for i in layers:
            if types[i] != "block":
                taken.setdefault(types[i], []).append(i)
            types[i] = kind
        if taken:
            other, overlap = next(iter(taken.items()))
            raise BSTConfigError(
                f"BSTConfig: layers {overlap} are in both {LAYER_INDEX_FIELDS[other]} and {LAYER_INDEX_FIELDS[kind]}; "
                "a layer has one type."
            )
    return types


def _check_agreement(layer_types, given: dict, num_layers):
    """Index fields given together with ``layer_types`` must list exactly its layers of their type."""
    for kind, value in given.items():
        field = LAYER_INDEX_FIELDS[kind]
        if _checked_indices(field, value, num_layers) != _indices_of(layer_types, kind):
            raise BSTConfigError(
                f"BSTConfig: {field}={list(value)} disagrees with layer_types={list(layer_types)}; give one of them "
                f"(layer_types lists {LAYER_TYPE_NAMES[kind]!r} at {_indices_of(layer_types, kind)})."
            )


def _index_view(kind):
    """The read-only view ``<kind>_layer_indices`` of ``layer_types``; assigning it goes through ``update_layers``."""
    field = LAYER_INDEX_FIELDS[kind]

    def fget(self) -> list[int]:
        return _indices_of(self.__dict__.get("layer_types"), kind)

    def fset(self, value):
        self.update_layers(**{field: value})

    doc = (
        f"The layers whose type is {kind!r}, ascending: derived from ``layer_types`` on every read (a new list; "
        f"changing it changes nothing). Assigning it is ``update_layers({field}=...)``: exactly the listed layers "
        f'become {kind!r} layers, the other {kind!r} layers become ``"block"``; a listed layer of another non-block '
        "type raises a [`BSTConfigError`] naming both fields."
    )
    return property(fget, fset, doc=doc)


def _checked(validator, default):
    return validated_field(validator, default=default)


def _describe(annotation) -> str:
    """A field annotation in words, for error messages: ``float | int`` -> "float or int"."""
    origin = get_origin(annotation)
    if origin is Literal:
        return f"one of {get_args(annotation)}"
    if origin is Union or type(annotation).__name__ == "UnionType":
        return " or ".join(_describe(arg) for arg in get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is not None:
        return str(annotation)
    return getattr(annotation, "__name__", str(annotation))


def _errors_name_the_field(cls):
    """Re-raise ``@strict``'s field and class validation errors as [`BSTConfigError`], naming the field.

    Applied on top of ``@strict``: it wraps the ``__setattr__`` (type check + field validators) and ``validate``
    (class validators) that ``@strict`` installs."""
    strict_setattr, strict_validate = cls.__setattr__, cls.validate
    annotations = {f.name: f.type for f in fields(cls)}

    def naming_the_field(cause, name, value):
        if isinstance(cause, TypeError):
            message = f"{cls.__name__}.{name} must be {_describe(annotations.get(name))}, got {value!r}."
        else:
            message = f"{cls.__name__}.{name} {cause}"
        return BSTConfigError(message)

    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as e:
            raise naming_the_field(e.__cause__, name, value) from e.__cause__

    def _check_field(self, name, value):
        """Run the checks that assigning ``value`` to the field ``name`` runs (type, own range), setting nothing."""
        for validator in self.__validators__.get(name, []):
            try:
                validator(value)
            except (ValueError, TypeError) as cause:
                raise naming_the_field(cause, name, value) from cause

    def validate(self):
        """Run the class validators (``validate_*``); raise [`BSTConfigError`] naming the field."""
        try:
            strict_validate(self)
        except StrictDataclassClassValidationError as e:
            raise BSTConfigError(str(e.__cause__)) from e.__cause__

    validate.__is_defined_by_strict_decorator__ = True  # a subclass may be ``@strict`` again
    cls.__setattr__, cls.validate, cls._check_field = __setattr__, validate, _check_field
    return cls


def _default_logit_scale(vocab_size) -> float | None:
    """meliad's logit scale, 1/sqrt(vocab_size) (None for a vocabulary size that ``validate`` will refuse)."""
    return 1.0 / math.sqrt(vocab_size) if isinstance(vocab_size, int) and vocab_size > 0 else None


@_errors_name_the_field
@strict
class BSTConfig(PreTrainedConfig):
    r"""Configuration for [`BSTModel`], [`BSTForCausalLM`] and [`BSTForSequenceClassification`].

    Layer types (issue #33): ``layer_types`` is the one record of which layer is of which type. The index fields
    ``bst_layer_indices``, ``recurrent_layer_indices`` and ``gss_layer_indices`` are accepted as keyword arguments
    and in config.json (earlier files have only them, or both) and converted to ``layer_types`` at construction;
    afterwards they are read-only views computed from it (properties, no stored copy). Given together, they must
    agree with ``layer_types`` (else a [`BSTConfigError`] naming both). Assigning an index field after construction
    updates ``layer_types`` (exactly the listed layers get that type, its other layers become ``"block"``; a listed
    layer of another non-block type raises naming both fields), as does ``num_hidden_layers`` (new layers are
    ``"block"``; dropping a non-block layer raises). [`~BSTConfig.update_layers`] sets several of these fields as
    one change, in any order (``from_pretrained`` keyword overrides, ``update()`` and the training CLI's
    ``--model_overrides`` go through it).

    config.json (``to_dict``) stores the three index fields, not ``layer_types``: transformers' generic
    ``PreTrainedConfig`` rejects layer types other than its attention kinds, and ``AutoTokenizer.from_pretrained``
    falls back to it for a model folder whose config class it cannot load (no ``trust_remote_code``), so a
    ``layer_types`` of BST kinds in config.json would break loading the tokenizer of a BST repository; and package
    versions before ``layer_types`` existed (issue #12) read only the index fields. The index fields say the same
    thing as ``layer_types`` (all three are always written), so nothing is lost.

    Args:
        vocab_size (`int`, defaults to 32000): vocabulary size (tied input/output embedding).
        hidden_size (`int`, defaults to 1024): model width D.
        num_hidden_layers (`int`, defaults to 12): number of layers.
        num_attention_heads (`int`, defaults to 8): heads H of self-, cross- and context attention.
        head_dim (`int`, defaults to 128): per-head width d_h (H * d_h need not equal D).
        intermediate_size (`int`, defaults to 4096): ReLU MLP width F.
        max_position_embeddings (`int`, defaults to 4096): training length L. S4 models run at any length;
            ``unstruct`` filters exist only up to this length.
        block_len (`int`, defaults to 512): block / window length W.
        layer_types (`list[str]`, *optional*): the type of every layer, one of ``"bst_block"`` (Slide layer),
            ``"bst_context"`` (SSM + cross-attention to context states), ``"bst_recurrent"`` (BRecT) and
            ``"bst_gss"``: the one record of the layer types. The earlier names ``"block"``, ``"bst"``,
            ``"recurrent"``, ``"gss"`` (the kinds, [`layer_kind`]) are accepted and stored as these. Default: from
            the index fields below (see "Layer types" above).
        bst_layer_indices (`list[int]`, defaults to `[0, 7, 9]`): 0-based indices of BST layers (SSM + cross-attention
            to context states). Empty list = the Slide baseline. A keyword argument converted to ``layer_types``,
            then a read-only view of it, as are ``recurrent_layer_indices`` and ``gss_layer_indices`` (default
            ``[]``); the default ``[0, 7, 9]`` applies only when neither it nor ``layer_types`` is given.
        context_mode (`str`, defaults to `"sh"`): ``"sh"`` single-head, ``"mh"`` multi-head, ``"mf"`` multi-filter.
        ssm_kind (`str`, defaults to `"s4"`): ``"s4"`` (diagonal S4D kernel) or ``"unstruct"`` (Hyena-style filter).
        ssm_state_size (`int`, defaults to 16): S4D state size N (N/2 complex-conjugate modes per channel).
        num_context_states (`int`, defaults to 32): S, number of MF filters / context states per block.
        mf_independent_filters (`bool`, defaults to `False`): MF over S4 with one SSM per filter (its own Lambda, B
            and dt) instead of S read-outs (C, D) of one shared state. With a shared state of N/2 complex modes,
            the S context states of a block span at most N + 1 dimensions per SSM channel (the paper's motivation
            for MF asks for S distinct filters). Needs ``context_mode="mf"`` and ``ssm_kind="s4"``.
        recurrent_layer_indices (`list[int]`, defaults to `[]`): layers that carry a Block-Recurrent Transformer
            state (BRecT:fixed:skip); must not overlap ``bst_layer_indices``.
        num_recurrent_states (`int`, defaults to 512): number of BRecT recurrent state vectors.
        bidirectional (`bool`, defaults to `False`): two-sided SSM kernel and unmasked attention (classification).
        ssm_hidden_size (`int`, *optional*): SSM channel width D_s after down-projection. Default D/4 (SH, MH), D/8 (MF).
        ssm_init (`str`, defaults to `"lin"`): S4D initialisation of the state matrix, ``"lin"`` or ``"inv"``.
        ssm_dt_min / ssm_dt_max (`float`, defaults to 1e-3 / 1e-1): range of the log-uniform step size init.
        ssm_lr (`float`, *optional*): learning rate of the SSM parameters (Lambda, B, dt, filter MLP), which train
            without weight decay. None (the default): the main learning rate, as the paper trains ("the same
            learning rate for all layers", Sec. 4.1); before issue #33 the default was 1e-3, which configs written
            then store.
        ssm_input (`str`, defaults to `"normed"`): what a BST layer's SSM reads (through its down-projection):
            ``"normed"`` the layer's RMS-normed input, as its attention does (meliad's block cell normalises its
            input before every branch; a deviation: the paper's BST layer listing feeds the SSM the layer input);
            ``"raw"`` the layer's input before the norm (the listing; the embeddings for a first-layer BST), whose
            scale grows with depth.
        unstruct_emb_dim / unstruct_order / unstruct_num_inner_mlps / unstruct_sin_freq: Hyena filter MLP shape.
        unstruct_decay_target / unstruct_decay_fast / unstruct_decay_slow: Hyena exponential-decay envelope.
        unstruct_finite_filter (`bool`, defaults to `True`): an ``unstruct`` filter has ``max_position_embeddings``
            taps; longer inputs (the paper evaluates BST:MF:unstruct at 16k and 65k) see it as finite: taps beyond
            that lag are zero, in the forward, in evaluation and in decoding (which keeps the last
            ``max_position_embeddings`` inputs). ``False`` refuses longer inputs instead.
        attend_self (`bool`, defaults to `False`): meliad attends to exactly the W previous tokens, not the token
            itself; ``True`` attends to the W most recent tokens including itself.
        attention_query_chunk (`int`, *optional*): queries per call of the sliding-window self-attention. Each
            query sees W of the 2W keys of its block pair; chunks of c queries attend over only the W + c keys they
            can reach, skipping (W - c) / 2W of the attention work with identical results. Must divide
            ``block_len``; default on the CPU W/4 for W >= 256, W/2 for W >= 128, else W (one call per block: smaller
            chunks make small matmuls), and W on an accelerator (launches cost more there than the masked work).
            Whatever c, all windows go in one attention call per layer. Measured on one CPU thread: -14% fwd+bwd
            time of a W = 512 layer, -6% forward at W = 128.
        cross_mask (`str`, defaults to `"inclusive"`): SH/MH triangular cross mask, context state j visible at j <= i
            (``"inclusive"``) or j < i (``"strict"``).
        qk_norm (`bool`, defaults to `True`): L2-normalise queries and keys (meliad); logits are scaled by a learned
            per-head scale initialised at ``attn_scale_init``.
        attn_scale_init (`float`, *optional*): initial per-head logit scale; default sqrt(head_dim) with qk_norm,
            else 1/sqrt(head_dim).
        relative_attention_num_buckets / relative_attention_max_distance: T5 bias buckets (32) and max distance (128).
        logit_scale (`float`, *optional*): multiplier on the output logits. Not given (None): 1/sqrt(vocab_size) (meliad),
            stored as that number at construction, so that clients that compute logits from the hidden states and the
            LM head (TRL's fused LM head, which reads ``config.logit_scale``) scale them as the model does. While it is
            that default, setting ``vocab_size`` updates it; a model's ``resize_token_embeddings`` keeps its trained
            scale.
        rms_norm_eps (`float`, defaults to 1e-6), dropout (`float`, 0.05), attention_dropout (`float`, 0.05).
        final_dropout (`float`, *optional*): dropout on the final hidden states before the logits (meliad's
            ``final_dropout_rate``); default ``dropout``.
        mf_context_ids_after_norm (`bool`, defaults to `False`): add the MF context-ID embeddings after the context
            norm (meliad adds position-like embeddings after its norm) instead of before it; the default keeps the
            layout that earlier checkpoints were trained with.
        mf_initial_context (`str`, defaults to `"lifted"`): where block 0's learned MF context lives: `"lifted"`,
            S vectors of width D after the lift (the layout that earlier checkpoints were trained with), or
            `"ssm_output"`, S vectors of width D_s in the SSM's output space, lifted like every other block's context
            (the paper's Listing 4: ``context_states[0] = init_context`` before the lift).
        meliad_dropout (`bool`, defaults to `False`): dropout where meliad (the paper's code base) has it: none on the
            embeddings nor on the attention output before its residual, but on the normed context states before the
            cross-attention's key/value projections. The default (dropout on the embeddings and the attention output,
            none on the context states) is how the published runs of this package trained.
        init_truncation_correction (`bool`, defaults to `True`): truncated-normal initialisation with meliad's
            variance correction (``variance_scaling(1.0, "fan_in", "truncated_normal")`` divides the std by
            0.87962566, the std of a unit normal truncated at +-2, so that the weights have variance 1/fan_in).
        initializer_range (`float`, defaults to 1.0): std of the embedding init (meliad N(0, 1)).
        tie_word_embeddings (`bool`, defaults to `True`).
        gss_layer_indices (`list[int]`, defaults to `[]`): layers that are Gated State Space layers (GSS, Mehta et al.
            2022) instead of attention layers: the GSS-Hybrid baseline interleaves them with block attention.
        gss_expansion (`int`, defaults to 3): GSS gate width F = gss_expansion * D.
        num_labels: classes for [`BSTForSequenceClassification`].
        num_s4_head_layers (`int`, defaults to 0): S4 layers stacked on the BST stack in
            [`BSTForSequenceClassification`] (the paper's LRA model: 4 bidirectional BST layers + 2 S4 layers).
    """

    model_type = "bst"
    keys_to_ignore_at_inference = ["past_key_values"]
    layer_fields = LAYER_FIELDS  # what ``update_layers`` sets as one change (a class attribute, not a field)

    vocab_size: int = _checked(_positive, 32000)
    hidden_size: int = _checked(_positive, 1024)
    num_hidden_layers: int = _checked(_positive, 12)
    layer_types: list[str] | tuple[str, ...] | None = _checked(_layer_type_entries, None)
    num_attention_heads: int = _checked(_positive, 8)
    head_dim: int = _checked(_positive, 128)
    intermediate_size: int = _checked(_positive, 4096)
    max_position_embeddings: int = _checked(_positive, 4096)
    block_len: int = _checked(_positive, 512)
    context_mode: Literal[CONTEXT_MODES] = "sh"
    ssm_kind: Literal[SSM_KINDS] = "s4"
    ssm_state_size: int = _checked(_positive_even, 16)
    num_context_states: int = _checked(_positive, 32)
    mf_independent_filters: bool = False
    num_recurrent_states: int = _checked(_positive, 512)
    bidirectional: bool = False
    ssm_hidden_size: int | None = _checked(_positive_or_none, None)
    ssm_init: Literal[SSM_INITS] = "lin"
    ssm_dt_min: float | int = 1e-3
    ssm_dt_max: float | int = 1e-1
    ssm_lr: float | int | None = None
    ssm_input: Literal[SSM_INPUTS] = "normed"
    unstruct_emb_dim: int = _checked(_odd_at_least_3, 33)
    unstruct_order: int = _checked(_positive, 64)
    unstruct_num_inner_mlps: int = 2
    unstruct_sin_freq: float | int = 14.0
    unstruct_decay_target: float | int = 1e-2
    unstruct_decay_fast: float | int = 0.3
    unstruct_decay_slow: float | int = 1.5
    unstruct_finite_filter: bool = True
    attend_self: bool = False
    attention_query_chunk: int | None = _checked(_positive_or_none, None)
    cross_mask: Literal[CROSS_MASKS] = "inclusive"
    qk_norm: bool = True
    attn_scale_init: float | int | None = None
    relative_attention_num_buckets: int = _checked(_positive, 32)
    relative_attention_max_distance: int = _checked(_positive, 128)
    logit_scale: float | int | None = None
    rms_norm_eps: float | int = 1e-6
    dropout: float | int = _checked(_rate, 0.05)
    attention_dropout: float | int = _checked(_rate, 0.05)
    final_dropout: float | int | None = _checked(_rate, None)
    mf_context_ids_after_norm: bool = False
    mf_initial_context: Literal["lifted", "ssm_output"] = "lifted"
    meliad_dropout: bool = False
    init_truncation_correction: bool = True
    initializer_range: float | int = 1.0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    num_s4_head_layers: int = _checked(_non_negative, 0)
    gss_expansion: int = _checked(_positive, 3)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        """Convert the index fields (keyword arguments, keys of config.json) to ``layer_types``, then the base
        class's handling of the remaining keyword arguments (``num_labels``, ``dtype``, unknown keys kept as
        attributes)."""
        given = {
            kind: kwargs.pop(field) for kind, field in LAYER_INDEX_FIELDS.items() if kwargs.get(field) is not None
        }
        for field in LAYER_INDEX_FIELDS.values():
            kwargs.pop(field, None)  # None: the default
        n = self.num_hidden_layers
        if self.layer_types is not None:
            if len(self.layer_types) != n:
                raise BSTConfigError(
                    f"BSTConfig.layer_types must have num_hidden_layers={n} entries, got {len(self.layer_types)}: "
                    f"{list(self.layer_types)}."
                )
            _check_agreement(self.layer_types, given, n)
            self.layer_types = _names(self.layer_types)
        else:
            given.setdefault("bst", list(DEFAULT_BST_LAYER_INDICES))
            indices = {  # in LAYER_INDEX_FIELDS order, so that an overlap names the fields in that order
                kind: _checked_indices(field, given[kind], n)
                for kind, field in LAYER_INDEX_FIELDS.items()
                if kind in given
            }
            self.layer_types = _names(_assign_indices(["block"] * n, indices))
        if self.logit_scale is None:
            # One number for every reader of the config (a config.json written before stored null: the same value).
            self.logit_scale = _default_logit_scale(self.vocab_size)
        super().__post_init__(**kwargs)  # sets ``_post_init_done``: assignments from here on are checked as changes
        # Entries already present (a loaded config.json; on the Hub "org/name--module.Class") are kept.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    # -- layer types: ``layer_types`` is the record, the index fields are views of it -------------------------------
    bst_layer_indices = _index_view("bst")
    recurrent_layer_indices = _index_view("recurrent")
    gss_layer_indices = _index_view("gss")

    def update_layers(self, **fields):
        """Set any of ``num_hidden_layers``, ``layer_types`` and the index fields as one change; nothing changes
        if it raises.

        With ``layer_types``: it must have ``num_hidden_layers`` entries, and index fields given with it must agree
        with it (as at construction). Without: each given index field's type is cleared (its layers become
        ``"block"``), the layers are cut or extended (with ``"block"``) to ``num_hidden_layers``, then the listed
        layers get their field's type. A listed layer of another non-block type, or a non-block layer cut off by a
        smaller ``num_hidden_layers``, raises a [`BSTConfigError`] naming the fields. So
        ``update_layers(num_hidden_layers=4, bst_layer_indices=[0, 2])`` works on a 12-layer ``[0, 7, 9]`` config,
        in either order of the keywords, where assigning the fields one by one would stop at the first."""
        unknown = sorted(set(fields) - set(LAYER_FIELDS))
        if unknown:
            raise TypeError(f"BSTConfig.update_layers takes {', '.join(LAYER_FIELDS)}; got {', '.join(unknown)}.")
        n = fields.get("num_hidden_layers", self.num_hidden_layers)
        if "num_hidden_layers" in fields:
            self._check_field("num_hidden_layers", n)
        given = {kind: fields[field] for kind, field in LAYER_INDEX_FIELDS.items() if field in fields}
        if "layer_types" in fields:
            types = fields["layer_types"]
            if types is None:
                raise BSTConfigError(
                    "BSTConfig.layer_types must be a list of layer types (None selects the index fields only when "
                    "the config is made)."
                )
            self._check_field("layer_types", types)
            types = [LAYER_KINDS[t] for t in types]
            if len(types) != n:
                raise BSTConfigError(
                    f"BSTConfig.layer_types must have num_hidden_layers={n} entries, got {len(types)}: {types}."
                )
            _check_agreement(types, given, n)
        else:
            indices = {kind: _checked_indices(LAYER_INDEX_FIELDS[kind], value, n) for kind, value in given.items()}
            kept = ["block" if LAYER_KINDS[t] in indices else LAYER_KINDS[t] for t in self.layer_types]
            cut = {i: t for i, t in enumerate(kept[n:], start=n) if t != "block"}
            if cut:
                fields_cut = sorted({LAYER_INDEX_FIELDS[t] for t in cut.values()})
                raise BSTConfigError(
                    f"BSTConfig.num_hidden_layers={n} would drop layers {sorted(cut)} of types "
                    f"{sorted(LAYER_TYPE_NAMES[t] for t in set(cut.values()))} ({', '.join(fields_cut)}); set "
                    "layer_types (or those fields) in the same change: config.update_layers(num_hidden_layers=..., "
                    "layer_types=[...]), one from_pretrained(...) or one --model_overrides."
                )
            types = _assign_indices(kept[:n] + ["block"] * (n - len(kept)), indices)
        if "num_hidden_layers" in fields:
            PreTrainedConfig.__setattr__(self, "num_hidden_layers", n)
        PreTrainedConfig.__setattr__(self, "layer_types", _names(types))

    def __setattr__(self, name, value):
        # Runs after ``@strict`` has checked the value against the field's annotation and validators.
        if not self.__dict__.get("_post_init_done"):  # in __init__: __post_init__ converts the index fields
            if name == "layer_types" and isinstance(value, tuple):
                value = list(value)
            super().__setattr__(name, value)
            return
        if name in ("num_hidden_layers", "layer_types"):  # the index fields' setters call update_layers too
            self.update_layers(**{name: value})
            return
        if name == "vocab_size" and self.logit_scale == _default_logit_scale(self.vocab_size):
            # The default scale follows the vocabulary (a preset given the tokenizer's size); a model's
            # ``resize_token_embeddings`` keeps its trained scale instead (``BSTPreTrainedModel``).
            super().__setattr__("logit_scale", _default_logit_scale(value))
        super().__setattr__(name, value)

    def update(self, config_dict):
        """transformers' ``update``, with the layer fields of ``config_dict`` set as one change (``update_layers``)."""
        layers = {key: value for key, value in config_dict.items() if key in LAYER_FIELDS}
        super().update({key: value for key, value in config_dict.items() if key not in layers})
        if layers:
            self.update_layers(**layers)

    def to_dict(self):
        """As transformers writes it, with the index fields in place of ``layer_types`` (all three, always; see the
        class docstring for why config.json does not store ``layer_types``). Loading converts them back."""
        output = super().to_dict()
        types = output.pop("layer_types", None)
        for kind, field in LAYER_INDEX_FIELDS.items():
            output[field] = _indices_of(types, kind)
        return output

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' ``from_dict`` (also behind ``from_pretrained``), then ``validate()``. Keyword overrides are
        set after construction and checked here; the layer fields among them (``from_pretrained(path,
        num_hidden_layers=4, bst_layer_indices=[0, 2])``) as one change, by ``update_layers``."""
        layers = {key: kwargs.pop(key) for key in LAYER_FIELDS if key in kwargs}
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        if layers:
            config.update_layers(**layers)
        config.validate()
        return result

    # Derived values. Properties, so they never go stale and are not written into config.json.
    @property
    def ssm_channels(self) -> int:
        """D_s: SSM width after the down-projection."""
        if self.ssm_hidden_size is not None:
            return self.ssm_hidden_size
        return max(1, self.hidden_size // (8 if self.context_mode == "mf" else 4))

    @property
    def ssm_output_channels(self) -> int:
        """Number of SSM output channels per input channel: 1 (SH), H (MH) or S (MF)."""
        return {"sh": 1, "mh": self.num_attention_heads, "mf": self.num_context_states}[self.context_mode]

    @property
    def resolved_attn_scale_init(self) -> float:
        if self.attn_scale_init is not None:
            return self.attn_scale_init
        return math.sqrt(self.head_dim) if self.qk_norm else 1.0 / math.sqrt(self.head_dim)

    @property
    def resolved_attention_query_chunk(self) -> int:
        """Queries per sliding-window attention call (see ``attention_query_chunk``); W means one call per block."""
        if self.attention_query_chunk is not None:
            return self.attention_query_chunk
        w = self.block_len
        if w >= 256 and w % 4 == 0:
            return w // 4
        return w // 2 if w >= 128 and w % 2 == 0 else w

    @property
    def resolved_final_dropout(self) -> float:
        return self.dropout if self.final_dropout is None else self.final_dropout

    @property
    def resolved_logit_scale(self) -> float:
        return self.logit_scale if self.logit_scale is not None else _default_logit_scale(self.vocab_size)

    def layer_kind(self, layer_idx: int) -> str:
        """The kind of ``layer_types[layer_idx]``: ``"bst"``, ``"recurrent"``, ``"gss"`` or ``"block"`` (Slide)."""
        return LAYER_KINDS[self.layer_types[layer_idx]]

    # -- class validators: ``@strict`` runs every ``validate_*`` method in ``validate()`` ------------------------------
    def validate_layer_type(self):
        """Replaces transformers' check, which accepts only its attention kinds in ``layer_types``."""
        if self.layer_types is None or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"BSTConfig.layer_types must have num_hidden_layers={self.num_hidden_layers} entries in "
                f"{tuple(LAYER_TYPE_NAMES.values())}, got {self.layer_types!r}."
            )
        _layer_type_entries(self.layer_types)

    def validate_bst(self):
        """The checks that relate fields (each field's own type and range are checked whenever it is set); raise
        ``ValueError`` naming the field."""
        if self.attention_query_chunk is not None and self.block_len % self.attention_query_chunk:
            raise ValueError(
                f"BSTConfig.attention_query_chunk={self.attention_query_chunk} must divide block_len={self.block_len}."
            )
        if not (0 < self.ssm_dt_min <= self.ssm_dt_max):
            raise ValueError(
                f"BSTConfig.ssm_dt_min/ssm_dt_max must satisfy 0 < ssm_dt_min <= ssm_dt_max, got "
                f"{self.ssm_dt_min} and {self.ssm_dt_max}."
            )
        if self.mf_independent_filters and (self.context_mode != "mf" or self.ssm_kind != "s4"):
            raise ValueError(
                "BSTConfig.mf_independent_filters=True needs context_mode='mf' and ssm_kind='s4' (unstruct filters "
                f"are independent already), got context_mode={self.context_mode!r}, ssm_kind={self.ssm_kind!r}."
            )
        self.validate_layer_type()
        if self.bidirectional and self.recurrent_layer_indices:
            raise ValueError(
                "BSTConfig: bidirectional=True is incompatible with recurrent_layer_indices (BRecT is causal)."
            )


__all__ = ["AUTO_MAP", "BSTConfig", "BSTConfigError", "LAYER_INDEX_FIELDS", "LAYER_TYPE_NAMES", "LAYER_TYPES"]
