"""``BSTForCausalLM`` for vLLM: a BST checkpoint served as an attention-free, stateful model.

Design: every per-request quantity a BST layer keeps has a fixed size (see ``layers.py``): the block
self-attention sees only the W previous tokens, so its keys/values fit a W-slot ring, and the S4D state and the
context keys/values are fixed-size too. vLLM's attention backends cannot run BST's self-attention (T5 relative bias
added before a learned per-head scale, L2-normalised queries/keys, a window of exactly the W previous tokens), so
the model declares itself attention-free (``IsAttentionFree``, ``HasInnerState``, as vLLM's Mamba model does) and
every decoder layer is a ``MambaBase`` layer whose "mamba state" is the tuple of these tensors; the attention is
computed here in PyTorch. vLLM then hands each request one state slot (``state_indices_tensor_d`` /
``_p`` of the metadata), splits every batch into decodes (first) and prefill chunks, and schedules chunked prefill
as for Mamba. All layers declare the same state tuple, the parts of every layer kind the model has (a layer
leaves the other kinds' parts unused), so that all layers share one page size.

Prefix caching runs in vLLM's Mamba ``align`` mode (``engine_config.py``): the state of a request is complete at any
position (W-slot rings by position mod W, the S4D state, the current block's context states or MF read-outs), so
the layers read and write the slot vLLM names exactly as without prefix caching, and vLLM keeps the slot of every
prefill chunk end (a block boundary) as the cached state of that prefix. Before a step vLLM copies a request's
running state into the slot of the block it is now in, or a cached prefix's state into a new request's slot, with
the copy functions [`BSTForCausalLM.get_mamba_state_copy_func`] returns: one per state tensor, each the whole
tensor of the source slot (no part of a BST state shifts with the position).
"""

import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .config import check_supported
from .layers import BSTLayerMath, Decode, Prefill, rms_norm


def copy_whole_state(state: torch.Tensor, block_ids: list[int], cur_block_idx: int, num_accepted_tokens: int):
    """vLLM's align-mode state copy for one BST state tensor ``state`` `(num_slots, ...)`: all of the state of the
    slot ``block_ids[cur_block_idx]`` (the ring of the last W keys / values, the S4D state, the context states or MF
    read-outs alike: none of them shifts with the position). ``num_accepted_tokens`` > 1 only comes with speculative
    decoding, which the plugin does not serve."""
    if num_accepted_tokens != 1:
        raise ValueError("BST serving: speculative decoding is not supported (a state copy with accepted drafts).")
    src = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


def state_shapes(config) -> tuple[tuple[int, ...], ...]:
    """The state tuple every layer of the model declares: the parts of every layer kind the model has
    (``layers.state_layout``)."""
    return BSTLayerMath.state_shapes(config)


class BSTServingLayer(BSTLayerMath, MambaBase):
    """A decoder layer with its per-request state in vLLM's Mamba-style state cache (``self.kv_cache``)."""

    def __init__(self, config, layer_idx: int, prefix: str):
        super().__init__(config, config.bst_layer_types[layer_idx])
        self.layer_idx = layer_idx
        self.prefix = prefix
        self.shapes = state_shapes(config)
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # -- MambaBase ----------------------------------------------------------------------------------------------
    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return (torch.float32,) * len(self.shapes)

    @property
    def mamba_type(self):
        # The generic Mamba metadata (query starts, state slots, decode/prefill split) is all this layer reads.
        return MambaAttentionBackendEnum.SHORT_CONV

    # -- forward --------------------------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer as vLLM compiles it ([`compiled_layers`]): the dense parts (norms, projections, ``o_proj``,
        MLP) traced, everything that touches the state in one custom op (``torch.ops.vllm.bst_mixer``; GSS and
        Block-Recurrent layers whole in ``torch.ops.vllm.bst_layer``)."""
        if self.kind in ("gss", "recurrent"):
            out = torch.empty_like(hidden)
            torch.ops.vllm.bst_layer(hidden, positions, out, self.prefix)
            return out
        xn = rms_norm(hidden, self.input_norm.weight, self.eps)
        q, k, v, qc = self.project(xn)
        mixed = hidden.new_empty(hidden.shape[0], self.o_proj.in_features)
        torch.ops.vllm.bst_mixer(hidden, xn, q, k, v, qc, positions, mixed, self.prefix)
        return self.finish(hidden, mixed, None)

    def _input_weight(self) -> torch.Tensor:
        # Traced code cannot read the weights' versions: the stacked weight is fixed once the weights are loaded.
        stacked = getattr(self, "input_weight", None)
        return super()._input_weight() if stacked is None else stacked

    def weights_loaded(self):
        """Fix the stacked input projection ([`BSTLayerMath._input_weight`]) for the compiled forward."""
        if self.kind != "gss":
            self.register_buffer("input_weight", super()._input_weight(), persistent=False)

    def step(self, positions: torch.Tensor) -> "Step | None":
        """This engine step's [`Step`], read once per forward for the layers of one state group (None in vLLM's
        profiling run)."""
        context = get_forward_context()
        metadata = context.attn_metadata
        m = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if m is None:
            return None
        steps = context.__dict__.setdefault("bst_steps", {})
        if id(m) not in steps:
            steps[id(m)] = Step.from_metadata(m, positions, self.config)
        return steps[id(m)]

    def mix(self, x, xn, q, k, v, qc, positions, out):
        """``torch.ops.vllm.bst_mixer``: the stateful part of a block or BST layer ([`BSTLayerMath.decode_mix`],
        [`BSTLayerMath.prefill_mix`]) of this step's tokens (``q``, ``k``, ``v``, ``qc`` `(N, H, d_h)`) into ``out`` `(N, H d_h (2 H d_h in a BST layer))`."""
        step = self.step(positions)

        def put(rows, parts):
            a_self, a_second = parts
            if a_second is None:
                out[rows].copy_(a_self)
            else:
                torch.cat([a_self, a_second], -1, out=out[rows])

        if step is None:
            batch = Step.scratch(positions, self.block_len).prefill[0][2]
            scratch = tuple(torch.zeros(1, *s, dtype=torch.float32, device=x.device) for s in self.shapes)
            put(slice(None), self.prefill_mix(x, xn, q, k, v, qc, batch, scratch))
            return
        nd = step.num_decodes
        if nd:
            d = slice(0, nd)
            qc_d = None if qc is None else qc[d]
            put(d, self.decode_mix(x[d], xn[d], q[d], k[d], v[d], qc_d, step.decode, self.kv_cache))
        for start, end, run in step.prefill:
            r = slice(nd + start, nd + end)
            parts = self.prefill_mix(x[r], xn[r], q[r], k[r], v[r], None if qc is None else qc[r], run, self.kv_cache)
            put(r, parts)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, step: "Step | None") -> torch.Tensor:
        """The whole layer eagerly over one engine ``step`` (None: vLLM's profiling run)."""
        if step is None:
            # vLLM's profiling / warm-up run: no state slots; one sequence on a scratch state.
            scratch = tuple(torch.zeros(1, *s, dtype=torch.float32, device=hidden.device) for s in self.shapes)
            return self.prefill(hidden, Step.scratch(positions, self.block_len).prefill[0][2], scratch)
        outs = []
        if step.num_decodes:
            nd = step.num_decodes
            outs.append(self.decode(hidden[:nd], step.decode, self.kv_cache))
        prefill = hidden[step.num_decodes :]
        for start, end, run in step.prefill:
            outs.append(self.prefill(prefill[start:end], run, self.kv_cache))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Step:
    """What every layer reads of one engine step, from vLLM's Mamba metadata (built once per step, not per layer):
    the decodes (first in the batch, one token each: [`Decode`], their positions' ring and context slots and masks)
    and the prefill chunks packed ([`Prefill`], in runs of chunks of similar lengths: ``[(first token, end token,
    Prefill), ...]`` counted from the first prefill token). Nothing here reads the device for the decodes (their
    path has no host sync); the prefill runs come from the chunk lengths of ``query_start_loc_p`` (a host tensor
    on the CPU)."""

    def __init__(self, num_decodes: int, decode: Decode | None, prefill: list):
        self.num_decodes, self.decode, self.prefill = num_decodes, decode, prefill

    @staticmethod
    def _column(slots):
        return slots[:, 0] if slots.dim() > 1 else slots

    @classmethod
    def from_metadata(cls, metadata, positions: torch.Tensor, config) -> "Step":
        nd = metadata.num_decodes
        decode = None
        if nd:
            decode = Decode(positions[:nd], cls._column(metadata.state_indices_tensor_d)[:nd].long(), config)
        prefill = []
        if metadata.num_prefills:
            slots = cls._column(metadata.state_indices_tensor_p)[: metadata.num_prefills].long()
            end = metadata.num_decode_tokens + metadata.num_prefill_tokens
            tokens = positions[metadata.num_decode_tokens : end]
            prefill = Prefill.groups(metadata.query_start_loc_p, tokens, slots, config.block_len)
        return cls(nd, decode, prefill)

    @classmethod
    def scratch(cls, positions: torch.Tensor, block_len: int) -> "Step":
        """One sequence of all the tokens, in slot 0 (the profiling run)."""
        n = positions.shape[0]
        device = positions.device
        starts = torch.tensor([0, n], device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return cls(0, None, [(0, n, Prefill(starts[:1], zero, starts[1:], zero, n, n, block_len))])


def bst_mixer(
    x: torch.Tensor,
    xn: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qc: torch.Tensor | None,
    positions: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    """The stateful part of the block or BST layer ``layer_name`` ([`BSTServingLayer.mix`]), written into ``out``."""
    get_forward_context().no_compile_layers[layer_name].mix(x, xn, q, k, v, qc, positions, out)


def bst_mixer_fake(x, xn, q, k, v, qc, positions, out, layer_name) -> None:
    return None


def bst_layer(hidden: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """The whole GSS or Block-Recurrent layer ``layer_name`` ([`BSTServingLayer.run`]), written into ``out``."""
    layer = get_forward_context().no_compile_layers[layer_name]
    out.copy_(layer.run(hidden, positions, layer.step(positions)))


def bst_layer_fake(hidden, positions, out, layer_name) -> None:
    return None


direct_register_custom_op(op_name="bst_mixer", op_func=bst_mixer, mutates_args=["out"], fake_impl=bst_mixer_fake)
direct_register_custom_op(op_name="bst_layer", op_func=bst_layer, mutates_args=["out"], fake_impl=bst_layer_fake)


def compiled_layers(vllm_config: VllmConfig | None = None) -> bool:
    """Whether the model runs its layers as vLLM compiles its own models (``BST_VLLM_COMPILE=1``, the default): the
    dense parts traced by ``@support_torch_compile`` (compiled unless ``enforce_eager``), the state in custom ops.
    ``BST_VLLM_COMPILE=0``: the layers run eagerly, without custom ops."""
    value = os.environ.get("BST_VLLM_COMPILE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"BST serving: BST_VLLM_COMPILE must be 0 or 1, not {value!r}.")
    return value == "1"


@support_torch_compile(enable_if=compiled_layers)
class BSTModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.compiled_layers = compiled_layers()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [BSTServingLayer(config, i, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)]
        )
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.rms_norm_eps

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.float()
        if self.compiled_layers:
            for layer in self.layers:
                hidden = layer(hidden, positions)
        else:
            for layer in self.layers:
                hidden = layer.run(hidden, positions, layer.step(positions))
        return rms_norm(hidden, self.norm.weight, self.eps)


class BSTForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching):
    """A ``modeling_bst`` checkpoint (block and BST layers, S4D SSM, SH / MH / MF context states) in vLLM."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config.model_config.max_model_len)
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("BST serving: tensor_parallel_size must be 1 (the plugin's layers are not sharded).")
        self.config = config
        self.model = BSTModel(vllm_config=vllm_config, prefix="model")
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_scale = config.logit_scale
        # float32 whatever the engine's dtype (vLLM's "auto" downcasts float32 checkpoints to bfloat16 on the CPU):
        # greedy parity with modeling_bst's float32 generate(), and the state vLLM allocates is float32.
        self.float()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return nn.functional.linear(hidden_states * self.logit_scale, head)

    # -- the state vLLM allocates per request ---------------------------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return (torch.float32,) * len(state_shapes(vllm_config.model_config.hf_config))

    # Instance methods, not vLLM's class methods: how many state tensors a layer has depends on the checkpoint
    # (2 for a model of block layers, 4 with MF context states, 5 with SH / MH), and vLLM calls these on the model.
    def get_mamba_state_copy_func(self):
        """Prefix caching (align mode): the copy of each state tensor of a layer from one slot to another."""
        return (copy_whole_state,) * len(state_shapes(self.config))

    def get_mamba_state_copy_funcs(self, mamba_types):
        return {mamba_type: self.get_mamba_state_copy_func() for mamba_type in mamba_types}

    # -- weights --------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a ``modeling_bst`` checkpoint: the parameter names are the same."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the tied head is the embedding
            if name not in params:
                raise ValueError(f"BST serving: unexpected checkpoint tensor {name!r} (shape {tuple(tensor.shape)}).")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"BST serving: {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                    f"{tuple(param.shape)} in the model."
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"BST serving: the checkpoint lacks {sorted(missing)}.")
        for layer in self.model.layers:
            layer.weights_loaded()
        return loaded
