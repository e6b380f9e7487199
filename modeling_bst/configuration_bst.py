"""Configuration of the Block-State Transformer (BST) model family.

One config class describes every model of the paper's Table 1: BST (SH / MH / MF context states over S4 or
"unstruct" SSM kernels), and the baselines Slide (no BST layers), Transformer-XL (one window as long as the
segment) and the Block-Recurrent Transformer (``recurrent_layer_indices``). See ``docs/paper-mapping.md`` for how
each field maps onto the paper and which ambiguities were decided how.
"""

import math

from huggingface_hub.dataclasses import StrictDataclassClassValidationError
from transformers import PreTrainedConfig


CONTEXT_MODES = ("sh", "mh", "mf")
SSM_KINDS = ("s4", "unstruct")
SSM_INITS = ("lin", "inv")
CROSS_MASKS = ("inclusive", "strict")
# One entry per layer: a plain Block-Transformer ("Slide") layer, a BST layer (SSM + context cross-attention), a
# Block-Recurrent Transformer layer, or a Gated State Space layer.
LAYER_TYPES = ("block", "bst", "recurrent", "gss")
# The per-kind index fields, still accepted, and what config.json stores: each lists the layers of one type.
LAYER_INDEX_FIELDS = {"bst": "bst_layer_indices", "recurrent": "recurrent_layer_indices", "gss": "gss_layer_indices"}

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


class BSTConfig(PreTrainedConfig):
    r"""Configuration for [`BSTModel`], [`BSTForCausalLM`] and [`BSTForSequenceClassification`].

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
        layer_types (`list[str]`, *optional*): the type of every layer, one of ``"block"`` (Slide layer), ``"bst"``
            (SSM + cross-attention to context states), ``"recurrent"`` (BRecT) and ``"gss"``. Default: from the index
            fields below. The index fields and ``layer_types`` are two views of one thing: setting either updates the
            other, so a layer has exactly one type. config.json stores the index fields (transformers' generic config
            loader rejects non-attention ``layer_types``).
        bst_layer_indices (`list[int]`, defaults to `[0, 7, 9]`): 0-based indices of BST layers (SSM + cross-attention
            to context states). Empty list = the Slide baseline.
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
        ssm_lr (`float`, defaults to 1e-3): learning rate of SSM parameters (Lambda, B, dt, filter MLP), wd 0.
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
            ``block_len``; default W/4 for W >= 256, W/2 for W >= 128, else W (one call per block: smaller chunks
            make small matmuls). Measured on one CPU thread: -14% fwd+bwd time of a W = 512 layer, -6% forward at
            W = 128.
        cross_mask (`str`, defaults to `"inclusive"`): SH/MH triangular cross mask, context state j visible at j <= i
            (``"inclusive"``) or j < i (``"strict"``).
        qk_norm (`bool`, defaults to `True`): L2-normalise queries and keys (meliad); logits are scaled by a learned
            per-head scale initialised at ``attn_scale_init``.
        attn_scale_init (`float`, *optional*): initial per-head logit scale; default sqrt(head_dim) with qk_norm,
            else 1/sqrt(head_dim).
        relative_attention_num_buckets / relative_attention_max_distance: T5 bias buckets (32) and max distance (128).
        logit_scale (`float`, *optional*): multiplier on the output logits; default 1/sqrt(vocab_size) (meliad).
        rms_norm_eps (`float`, defaults to 1e-6), dropout (`float`, 0.05), attention_dropout (`float`, 0.05).
        final_dropout (`float`, *optional*): dropout on the final hidden states before the logits (meliad's
            ``final_dropout_rate``); default ``dropout``.
        mf_context_ids_after_norm (`bool`, defaults to `False`): add the MF context-ID embeddings after the context
            norm (meliad adds position-like embeddings after its norm) instead of before it; the default keeps the
            layout that earlier checkpoints were trained with.
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

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 12,
        layer_types: list | None = None,
        num_attention_heads: int = 8,
        head_dim: int = 128,
        intermediate_size: int = 4096,
        max_position_embeddings: int = 4096,
        block_len: int = 512,
        bst_layer_indices: list | None = None,
        context_mode: str = "sh",
        ssm_kind: str = "s4",
        ssm_state_size: int = 16,
        num_context_states: int = 32,
        mf_independent_filters: bool = False,
        recurrent_layer_indices: list | None = None,
        num_recurrent_states: int = 512,
        bidirectional: bool = False,
        ssm_hidden_size: int | None = None,
        ssm_init: str = "lin",
        ssm_dt_min: float = 1e-3,
        ssm_dt_max: float = 1e-1,
        ssm_lr: float = 1e-3,
        unstruct_emb_dim: int = 33,
        unstruct_order: int = 64,
        unstruct_num_inner_mlps: int = 2,
        unstruct_sin_freq: float = 14.0,
        unstruct_decay_target: float = 1e-2,
        unstruct_decay_fast: float = 0.3,
        unstruct_decay_slow: float = 1.5,
        unstruct_finite_filter: bool = True,
        attend_self: bool = False,
        attention_query_chunk: int | None = None,
        cross_mask: str = "inclusive",
        qk_norm: bool = True,
        attn_scale_init: float | None = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        logit_scale: float | None = None,
        rms_norm_eps: float = 1e-6,
        dropout: float = 0.05,
        attention_dropout: float = 0.05,
        final_dropout: float | None = None,
        mf_context_ids_after_norm: bool = False,
        init_truncation_correction: bool = True,
        initializer_range: float = 1.0,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        num_s4_head_layers: int = 0,
        gss_layer_indices: list | None = None,
        gss_expansion: int = 3,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.block_len = block_len
        if layer_types is not None:
            indices = self._indices_from_types(layer_types)
            if len(layer_types) != num_hidden_layers:
                raise ValueError(
                    f"BSTConfig.layer_types must have num_hidden_layers={num_hidden_layers} entries, got "
                    f"{len(layer_types)}: {list(layer_types)}."
                )
            given = {"bst": bst_layer_indices, "recurrent": recurrent_layer_indices, "gss": gss_layer_indices}
            for kind, field in LAYER_INDEX_FIELDS.items():
                if given[kind] is not None and sorted(given[kind]) != indices[kind]:
                    raise ValueError(
                        f"BSTConfig: {field}={list(given[kind])} disagrees with layer_types={list(layer_types)}; "
                        "give one of them."
                    )
            bst_layer_indices = indices["bst"]
            recurrent_layer_indices = indices["recurrent"]
            gss_layer_indices = indices["gss"]
        self.bst_layer_indices = list(bst_layer_indices) if bst_layer_indices is not None else [0, 7, 9]
        self.context_mode = context_mode
        self.ssm_kind = ssm_kind
        self.ssm_state_size = ssm_state_size
        self.num_context_states = num_context_states
        self.mf_independent_filters = mf_independent_filters
        self.recurrent_layer_indices = list(recurrent_layer_indices) if recurrent_layer_indices is not None else []
        self.num_recurrent_states = num_recurrent_states
        self.bidirectional = bidirectional
        self.ssm_hidden_size = ssm_hidden_size
        self.ssm_init = ssm_init
        self.ssm_dt_min = ssm_dt_min
        self.ssm_dt_max = ssm_dt_max
        self.ssm_lr = ssm_lr
        self.unstruct_emb_dim = unstruct_emb_dim
        self.unstruct_order = unstruct_order
        self.unstruct_num_inner_mlps = unstruct_num_inner_mlps
        self.unstruct_sin_freq = unstruct_sin_freq
        self.unstruct_decay_target = unstruct_decay_target
        self.unstruct_decay_fast = unstruct_decay_fast
        self.unstruct_decay_slow = unstruct_decay_slow
        self.unstruct_finite_filter = unstruct_finite_filter
        self.attend_self = attend_self
        self.attention_query_chunk = attention_query_chunk
        self.cross_mask = cross_mask
        self.qk_norm = qk_norm
        self.attn_scale_init = attn_scale_init
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.logit_scale = logit_scale
        self.rms_norm_eps = rms_norm_eps
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.final_dropout = final_dropout
        self.mf_context_ids_after_norm = mf_context_ids_after_norm
        self.init_truncation_correction = init_truncation_correction
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.num_s4_head_layers = num_s4_head_layers
        self.gss_layer_indices = list(gss_layer_indices) if gss_layer_indices is not None else []
        self.gss_expansion = gss_expansion
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        # Entries already present (a loaded config.json; on the Hub "org/name--module.Class") are kept.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        # Set after PreTrainedConfig.__init__, whose validator accepts only attention kinds in ``layer_types``.
        self.layer_types = self._types_from_indices()
        self.validate_bst()

    # -- layer types: ``layer_types`` and the index fields stay two views of one assignment ---------------------------
    @staticmethod
    def _indices_from_types(layer_types) -> dict:
        if not isinstance(layer_types, (list, tuple)) or not all(t in LAYER_TYPES for t in layer_types):
            raise ValueError(f"BSTConfig.layer_types entries must be in {LAYER_TYPES}, got {layer_types!r}.")
        return {kind: [i for i, t in enumerate(layer_types) if t == kind] for kind in LAYER_INDEX_FIELDS}

    def _types_from_indices(self):
        """``layer_types`` from the index fields; None while they are invalid (``validate_bst`` names the field)."""
        try:
            types = ["block"] * self.num_hidden_layers
            for kind, field in LAYER_INDEX_FIELDS.items():
                for i in getattr(self, field):
                    if types[i] != "block" or not 0 <= i:
                        return None
                    types[i] = kind
            return types
        except (TypeError, IndexError, AttributeError):
            return None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if "layer_types" not in self.__dict__:  # still in __init__
            return
        if name == "layer_types":
            if value is not None:
                for kind, indices in self._indices_from_types(value).items():
                    super().__setattr__(LAYER_INDEX_FIELDS[kind], indices)
        elif name in LAYER_INDEX_FIELDS.values() or name == "num_hidden_layers":
            super().__setattr__("layer_types", self._types_from_indices())

    def to_dict(self):
        """As transformers writes it, without ``layer_types``: config.json keeps the index fields (every reader of
        ``config.json``, transformers' own ``PreTrainedConfig`` included, accepts them; its ``validate_layer_type``
        rejects BST's layer types), and ``layer_types`` is rebuilt from them on load."""
        output = super().to_dict()
        output.pop("layer_types", None)
        return output

    def validate(self):
        """transformers' config validators (run by ``save_pretrained``), then [`validate_bst`].

        transformers' ``validate_layer_type`` accepts only its attention kinds in ``layer_types``; BST's layer
        types are checked by ``validate_bst`` instead.
        """
        for validator in PreTrainedConfig.__class_validators__:
            if validator.__name__ == "validate_layer_type":
                continue
            try:
                validator(self)
            except (ValueError, TypeError) as e:
                raise StrictDataclassClassValidationError(validator=validator.__name__, cause=e) from e
        self.validate_bst()

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
        return self.logit_scale if self.logit_scale is not None else 1.0 / math.sqrt(self.vocab_size)

    def layer_kind(self, layer_idx: int) -> str:
        """``layer_types[layer_idx]``: ``"bst"``, ``"recurrent"``, ``"gss"`` or ``"block"`` (plain Slide layer)."""
        return self.layer_types[layer_idx]

    def validate_bst(self):
        """Raise ``ValueError`` naming the field for any invalid or incompatible value."""

        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BSTConfig.{name} must be a positive integer, got {value!r}.")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "block_len",
            "ssm_state_size",
            "num_context_states",
            "num_recurrent_states",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
            "unstruct_emb_dim",
            "unstruct_order",
            "gss_expansion",
        ):
            positive_int(name)
        if self.ssm_hidden_size is not None:
            positive_int("ssm_hidden_size")
        if isinstance(self.num_s4_head_layers, bool) or not isinstance(self.num_s4_head_layers, int):
            raise ValueError(f"BSTConfig.num_s4_head_layers must be an integer >= 0, got {self.num_s4_head_layers!r}.")
        if self.num_s4_head_layers < 0:
            raise ValueError(f"BSTConfig.num_s4_head_layers must be >= 0, got {self.num_s4_head_layers}.")
        if self.attention_query_chunk is not None:
            positive_int("attention_query_chunk")
            if self.block_len % self.attention_query_chunk:
                raise ValueError(
                    f"BSTConfig.attention_query_chunk={self.attention_query_chunk} must divide "
                    f"block_len={self.block_len}."
                )
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"BSTConfig.context_mode must be one of {CONTEXT_MODES}, got {self.context_mode!r}.")
        if self.ssm_kind not in SSM_KINDS:
            raise ValueError(f"BSTConfig.ssm_kind must be one of {SSM_KINDS}, got {self.ssm_kind!r}.")
        if self.ssm_init not in SSM_INITS:
            raise ValueError(f"BSTConfig.ssm_init must be one of {SSM_INITS}, got {self.ssm_init!r}.")
        if self.cross_mask not in CROSS_MASKS:
            raise ValueError(f"BSTConfig.cross_mask must be one of {CROSS_MASKS}, got {self.cross_mask!r}.")
        if self.ssm_state_size % 2:
            raise ValueError(
                f"BSTConfig.ssm_state_size must be even (N/2 complex-conjugate modes), got {self.ssm_state_size}."
            )
        if self.unstruct_emb_dim < 3 or self.unstruct_emb_dim % 2 == 0:
            raise ValueError(f"BSTConfig.unstruct_emb_dim must be odd and >= 3, got {self.unstruct_emb_dim}.")
        if not (0 < self.ssm_dt_min <= self.ssm_dt_max):
            raise ValueError(
                f"BSTConfig.ssm_dt_min/ssm_dt_max must satisfy 0 < ssm_dt_min <= ssm_dt_max, got "
                f"{self.ssm_dt_min} and {self.ssm_dt_max}."
            )
        if not isinstance(self.unstruct_finite_filter, bool):
            raise ValueError(f"BSTConfig.unstruct_finite_filter must be a bool, got {self.unstruct_finite_filter!r}.")
        if self.mf_independent_filters is True and (self.context_mode != "mf" or self.ssm_kind != "s4"):
            raise ValueError(
                "BSTConfig.mf_independent_filters=True needs context_mode='mf' and ssm_kind='s4' (unstruct filters "
                f"are independent already), got context_mode={self.context_mode!r}, ssm_kind={self.ssm_kind!r}."
            )
        for name in ("mf_independent_filters", "mf_context_ids_after_norm", "init_truncation_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BSTConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("dropout", "attention_dropout", "final_dropout"):
            value = getattr(self, name)
            if name == "final_dropout" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
                raise ValueError(f"BSTConfig.{name} must be in [0, 1), got {value!r}.")
        for name in ("bst_layer_indices", "recurrent_layer_indices", "gss_layer_indices"):
            indices = getattr(self, name)
            if not isinstance(indices, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in indices
            ):
                raise ValueError(f"BSTConfig.{name} must be a list of integers, got {indices!r}.")
            bad = [i for i in indices if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(
                    f"BSTConfig.{name} entries must be in [0, num_hidden_layers={self.num_hidden_layers}), "
                    f"got out-of-range {bad}."
                )
            if len(set(indices)) != len(indices):
                raise ValueError(f"BSTConfig.{name} has repeated entries: {indices}.")
        kinds = {
            "bst_layer_indices": self.bst_layer_indices,
            "recurrent_layer_indices": self.recurrent_layer_indices,
            "gss_layer_indices": self.gss_layer_indices,
        }
        names = list(kinds)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                overlap = sorted(set(kinds[first]) & set(kinds[second]))
                if overlap:
                    raise ValueError(
                        f"BSTConfig: layers {overlap} are in both {first} and {second}; a layer has one kind."
                    )
        if self.layer_types is None or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"BSTConfig.layer_types must have num_hidden_layers={self.num_hidden_layers} entries in "
                f"{LAYER_TYPES}, got {self.layer_types!r}."
            )
        if self.bidirectional and self.recurrent_layer_indices:
            raise ValueError(
                "BSTConfig: bidirectional=True is incompatible with recurrent_layer_indices (BRecT is causal)."
            )
        if self.ssm_kind == "unstruct" and self.bst_layer_indices and self.max_position_embeddings < 1:
            raise ValueError("BSTConfig.max_position_embeddings sets the unstruct filter length and must be >= 1.")


__all__ = ["AUTO_MAP", "BSTConfig", "LAYER_TYPES"]
