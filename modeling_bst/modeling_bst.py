"""PyTorch Block-State Transformer (Fathi, Pilault et al., NeurIPS 2023), Hugging Face compatible.

A BST layer runs an SSM (S4D or a Hyena-style filter) over the whole sequence, turns its output into context
states (SH / MH / MF), and lets every block of W tokens self-attend over the W previous tokens while
cross-attending to its context states. Plain layers are Block-Transformer ("Slide") layers; BRecT layers carry a
recurrent state updated block by block. The block cell follows meliad (the paper's code base):

* self-attention over exactly the W previous tokens (``attend_self`` to include the token), T5 relative bias
  (one table per layer), L2-normalised queries/keys with a learned per-head scale, bias added before scaling;
* self- and cross-attention outputs concatenated, then one output projection; ReLU MLP; RMS norm; tied embeddings,
  logits scaled by 1/sqrt(vocab);
* all blocks in one batched attention call; the only Python loop over blocks is the BRecT state recurrence.

Layout (one module per paper concept, docs/paper-mapping.md "Module map"): the layer types of ``config.layer_types``
pick their module from ``DECODER_LAYER_CLASSES``; a BST layer's context states come from the builder of its
``context_mode`` (``CONTEXT_BUILDERS``: ``SHContextStates``, ``MHContextStates``, ``MFContextStates``), over the SSM
kernel of its ``ssm_kind`` (``SSM_KERNELS``, ``ssm_bst.py``). Each of them has a full-sequence form and a one-step
form; recurrent state lives only in the ``BSTCache`` passed in.

Departures from the paper / meliad, each a config field (see docs/paper-mapping.md):

* the previous block of the first block is masked (meliad: zero keys, unmasked);
* the logit scale starts at sqrt(d_h) (meliad: 1.0, tuned for Adafactor);
* the SH/MH triangular cross mask is inclusive (j <= i) by default.
"""

import math
import re
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.integrations.flex_attention import compile_friendly_flex_attention
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple, logging

from .cache_bst import MAX_ROLLBACK, BSTCache, BSTLayerCache, gather_rows, host_can_branch, tracing
from .configuration_bst import BSTConfig
from .ssm_bst import PerFilterS4D, S4DKernel, UnstructFilter, memoised, upcast_ssm


logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache that a model's ``forward`` takes and returns, and that ``generate`` keeps among
# its model kwargs, from ``past_key_values`` to ``cache`` (the old name stays a deprecated alias there until 5.40).
# BST's forwards take either name and return the cache under the installed transformers' name.
CACHE_NAME = (
    "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPastAndCrossAttentions)} else "past_key_values"
)


def resolve_cache_argument(cache, past_key_values):
    """The cache a forward was given under either name (``cache``; ``past_key_values`` before transformers 5.24)."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            "Got two different caches, `cache` and `past_key_values`: pass the BSTCache once (`past_key_values` is "
            "the name transformers used before 5.24)."
        )
    return past_key_values


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision tensors, unchanged otherwise (float32/float64 keep their precision)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def eager_attention_forward(module, query, key, value, attention_mask, scaling=1.0, dropout=0.0, **kwargs):
    """Reference attention. ``query`` `(N, H, Lq, d)`, ``key``/``value`` `(N, H, Lk, d)` -> `(N, Lq, H, d)`."""
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(upcast(weights), dim=-1).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def t5_relative_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5 bucket of ``key_pos - query_pos``: exact for small distances, log-spaced up to ``max_distance``."""
    bucket = torch.zeros_like(relative_position)
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket = (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, large)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(upcast(x).pow(2).sum(-1, keepdim=True) + 1e-6).to(x.dtype)


def masked_fill_value(dtype: torch.dtype) -> float:
    # Finite, so that fully masked rows stay finite (they are zeroed afterwards, meliad's safe softmax).
    return torch.finfo(dtype).min


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``valid``, a large negative number elsewhere."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, masked_fill_value(dtype))


class BSTRMSNorm(nn.Module):
    """RMS norm computed in float32 (meliad "LayerNorm": no mean, no bias, learned scale)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = upcast(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * upcast(self.weight)).to(dtype)


def maybe_any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` where reading it costs nothing ([`host_can_branch`]), else ``True`` (do the work)."""
    return bool(mask.any()) if host_can_branch(mask) else True


def decode_memo(layer_cache: BSTLayerCache, slot: str, key: tuple, params, compute, max_bytes: int | None = None):
    """``compute()`` kept in ``layer_cache.step_memo[slot]`` and reused while ``key`` and the tensors ``params`` are
    unchanged (decoding); recomputed every time when gradients flow to ``params`` (the graph must reach them), and
    where checking the parameters would read device values back (an accelerator, tracing): these constants are
    cheap, a device sync per step is not. Values over ``max_bytes`` are not kept."""
    params = list(params)
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return compute()
    if not params or not host_can_branch(params[0]):
        return compute()
    if layer_cache.step_memo is None:
        layer_cache.step_memo = {}
    return memoised(layer_cache.step_memo, slot, key, params, compute, max_bytes)


# Largest unstruct taps spectrum kept for decoding chunks (per layer; recomputed per chunk beyond it).
CHUNK_SPECTRUM_MEMO_BYTES = 128 * 2**20
# Tokens per segment of MH's segmented S4 path ([`TokenContextStates.segmented_context`]; 0: off).
MH_SEGMENT_LEN = 256


class BSTContextStates(nn.Module):
    """SSM sublayer and context-state builder of a BST layer (paper Sec. 3.3-3.4): the part shared by SH/MH/MF.

    ``z = x_n P_down`` (D -> D_s), a long convolution over the whole sequence (``ssm``, picked by ``ssm_kind`` from
    [`SSM_KERNELS`]), then context keys/values per mode (subclasses, picked by ``context_mode`` from
    [`CONTEXT_BUILDERS`]), all behind one contract:

    * ``sequence(xn, lengths, layer_cache, positions, fill_cache)``: full-sequence form. Returns context keys and
      values `(B, nb, S_c, H, d)` per block, an additive cross mask `(W, S_c)` or None, and whether the first query of
      every block has no context (strict mask); with ``fill_cache``, writes the SSM and context state;
    * ``step(xn, layer_cache, positions)``: recurrent form for one token; returns keys/values `(B, S_c, H, d)`, an
      additive mask `(B, 1, 1, S_c)` or None, and which rows see any context (None: all).

    Context keys/values come from their own projections after an RMS norm; keys are L2-normalised with qk_norm.
    """

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        self.mode = config.context_mode
        self.block_len = config.block_len
        d, ds = config.hidden_size, config.ssm_channels
        self.down_proj = nn.Linear(d, ds, bias=False)
        self.ssm = SSM_KERNELS[config.ssm_kind](ds, config.ssm_output_channels, config)
        self.norm = BSTRMSNorm(d, config.rms_norm_eps)

    def _heads(self, x):
        return x.unflatten(-1, (self.config.num_attention_heads, self.config.head_dim))

    def step_constants(self, layer_cache: BSTLayerCache):
        """The SSM's [`step_constants`], memoised in ``layer_cache`` while its parameters are unchanged."""
        return decode_memo(layer_cache, "ssm", (), self.ssm.parameters(), self.ssm.step_constants)

    def _ssm_input(self, xn, lengths):
        z = self.down_proj(xn)  # (B, T, Ds)
        if lengths is not None and self.config.bidirectional:
            z = z * (torch.arange(z.shape[1], device=z.device)[None] < lengths[:, None]).to(z.dtype)[..., None]
        return z

    def _sequence_input(self, xn, lengths, layer_cache, positions):
        """The SSM input ``z`` of a full sequence, the SSM state it continues from (None: a fresh sequence) and
        whether it continues a cached one."""
        continued = layer_cache is not None and positions is not None
        return self._ssm_input(xn, lengths), (layer_cache.ssm.state if continued else None), continued

    def _fill_ssm_state(self, z, lengths, state0, layer_cache):
        """The SSM state after each row's real tokens into ``layer_cache`` (rows right-aligned for ``final_state``)."""
        bsz, seq_len, _ = z.shape
        lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=z.device)
        idx = torch.arange(seq_len, device=z.device)[None] - (seq_len - lens[:, None])
        z_right = gather_rows(z, idx.clamp(min=0)) * (idx >= 0).to(z.dtype)[..., None]
        layer_cache.ssm.set(self.ssm.final_state(z_right.detach(), state0).detach())
        return lens

    def _step_ssm(self, xn, layer_cache, p, output: bool = True, chunked: bool = False):
        """One SSM step: ``y_t`` `(B, C, Ds)` (None if not ``output``); the cache's SSM state advances.

        ``chunked`` (unstruct, outputs at every step: SH/MH): decode in chunks of M steps ([`_unstruct_chunk`])."""
        z = self.down_proj(xn)[:, 0]  # (B, Ds)
        seen = None
        if self.config.ssm_kind == "unstruct":
            rp = p - layer_cache.doc_start
            if not tracing():
                # Unstruct steps cost O(longest document so far): one read of the position per step.
                seen = int(rp.max()) + 1
                if seen > self.config.max_position_embeddings and not self.config.unstruct_finite_filter:
                    raise ValueError(
                        f"unstruct BST models generate at most max_position_embeddings="
                        f"{self.config.max_position_embeddings} tokens (the filter has no taps beyond it); use an S4 "
                        "model for longer generation."
                    )
        constants = self.step_constants(layer_cache)
        if self.config.ssm_kind != "unstruct":
            y, state = self.ssm.step(z, layer_cache.ssm.state, constants, seen)
            layer_cache.ssm.set(state)
            return y
        pending = self._unstruct_chunk(layer_cache, constants, seen) if chunked and output else None
        y, state = self.ssm.step(z, layer_cache.ssm.state, constants, seen, output=output, pending=pending)
        if pending is None:
            # Eager: the history stays a view into its slack buffer (``append_history``: O(1) per step). Traced: the
            # step built a new history anyway; written over the old one in place (a fixed address for CUDA graphs).
            layer_cache.ssm.set(state, contiguous=tracing())
        else:
            layer_cache.ssm.set(state, pending[0], pending[1] + 1, contiguous=False)
        return y

    def _unstruct_chunk(self, layer_cache, constants, seen):
        """The current decoding chunk ``(pending outputs, step in the chunk)`` for an unstruct step, or None (a direct
        dot product over the ``seen`` newest inputs).

        A chunk starts when the last one is used up (or there is none: after a prefill, a continued chunk, a loaded
        cache, a traced step) and the longest row has more than M inputs (below that the direct product is as
        cheap): one FFT convolution of the history with the taps gives the share of every earlier input in the next
        M outputs ([`UnstructFilter.pending_outputs`]). A step then costs O(M) instead of O(seen), plus the chunk's
        O(seen log seen) / M. Under tracing (``seen`` unknown) steps take the direct form and drop the chunk
        ([`SSMStateCache.set`]): an eager step after a traced one starts a new one."""
        if seen is None:
            return None
        chunk = layer_cache.ssm.chunk(self.ssm.decode_chunk)
        if chunk is not None or seen <= self.ssm.decode_chunk:
            return chunk
        n = min(seen - 1, self.ssm.max_len)  # the previous inputs that can be non-zero
        size = self.ssm.pending_fft_size(n)
        spectrum = decode_memo(
            layer_cache,
            "unstruct_chunk",
            (size,),
            self.ssm.parameters(),
            lambda: self.ssm.pending_spectrum(size, constants),
            CHUNK_SPECTRUM_MEMO_BYTES,
        )
        return self.ssm.pending_outputs(layer_cache.ssm.state, n, spectrum), 0


class TokenContextStates(BSTContextStates):
    """SH / MH: one context state per token; block b cross-attends to its own W context states (triangular mask).

    The decoding cache keeps the current block's context keys/values in a W-slot ring (``layer_cache.context``, a
    ``TokenContextCache``)."""

    # Tokens per segment of the segmented S4 path ([`segmented_context`]); 0: the whole-sequence path.
    segment_len = 0

    def lift_and_project(self, y: torch.Tensor):
        """SSM outputs ``y`` `(..., C, Ds)` -> context keys, values `(..., 1, H, d_h)`."""
        raise NotImplementedError

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        """[`lift_and_project`] of SSM outputs laid out `(C, Ds, B * n)` (tokens batch-major) -> context keys,
        values `(B, n, H, d_h)`."""
        raise NotImplementedError

    def use_segments(self) -> bool:
        """Whether [`sequence`] runs the segmented path: ``segment_len`` set, a causal S4D kernel evaluated in chunks,
        eager mode (under tracing the whole-sequence path keeps the graph free of a length-dependent loop)."""
        ssm = self.ssm
        return (
            self.segment_len > 0
            and isinstance(ssm, S4DKernel)
            and ssm.chunk_len > 0
            and not ssm.bidirectional
            and not tracing()
        )

    def segmented_context(self, z: torch.Tensor, state: torch.Tensor | None):
        """Context keys and values `(B, T, H, d_h)` from the SSM input ``z`` `(B, T, Ds)`, a few chunks at a time.

        The same map as ``lift_and_project(ssm(z, state))`` (the chunked S4D form, [`S4DKernel.chunked_forward`]),
        but no `(B, T, C, Ds)` SSM output or `(B, T, H, D)` lifted state ever exists: the chunk-start states come from
        one scan over the whole input, then each segment of ``segment_len`` tokens runs convolution, free response,
        lift, norm and K/V projection while its tensors are small enough to stay in the caches, in the layout the
        convolution produces ([`S4DKernel.channel_major_chunks`]). Time and memory traffic stay linear in T.
        """
        ssm, bsz, length = self.ssm, z.shape[0], z.shape[1]
        chunk = ssm.chunk_len
        nc = -(-length // chunk)
        zc = F.pad(upcast_ssm(z, ssm.log_dt), (0, 0, 0, nc * chunk - length))  # causal: zeros at the end are inert
        x0 = ssm.chunk_start_states(zc, chunk, state)  # (B, nc, Ds, N2)
        constants = ssm.chunked_constants(chunk, zc.dtype)
        per = max(1, self.segment_len // chunk)  # chunks per segment
        keys, values = [], []
        for c0 in range(0, nc, per):
            c1 = min(nc, c0 + per)
            # (C, Ds, B*n): the segment's SSM outputs, lifted and projected at once
            y = ssm.channel_major_chunks(zc[:, c0 * chunk : c1 * chunk], x0[:, c0:c1], chunk, constants)
            k, v = self.lift_channel_major(y, bsz)
            keys.append(k)
            values.append(v)
        return torch.cat(keys, 1)[:, :length], torch.cat(values, 1)[:, :length]

    def sequence(self, xn, lengths, layer_cache, positions, fill_cache):
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w = self.block_len
        nb = seq_len // w
        z, state0, continued = self._sequence_input(xn, lengths, layer_cache, positions)
        if self.use_segments():
            ck, cv = self.segmented_context(z, state0)  # (B, T, H, d)
        else:
            y = self.ssm(z, state0)  # (B, T, C, Ds)
            ck, cv = self.lift_and_project(y)  # (B, T, 1, H, d)
        ctx_k, ctx_v = ck.view(bsz, nb, w, *ck.shape[-2:]), cv.view(bsz, nb, w, *cv.shape[-2:])
        if cfg.bidirectional:
            mask, zero_first = None, False
        else:
            i = torch.arange(w, device=z.device)
            allowed = i[None] <= i[:, None] if cfg.cross_mask == "inclusive" else i[None] < i[:, None]
            mask = additive_mask(allowed, ck.dtype)
            zero_first = cfg.cross_mask == "strict"
        if fill_cache:
            lens = self._fill_ssm_state(z, lengths, state0, layer_cache)
            offset = positions if continued else None
            layer_cache.context.fill(ctx_k.flatten(1, 2).detach(), ctx_v.flatten(1, 2).detach(), lens, w, offset)
        return ctx_k, ctx_v, mask, zero_first

    def step(self, xn, layer_cache, p):
        cfg = self.config
        w = self.block_len
        y = self._step_ssm(xn, layer_cache, p, chunked=True)
        ck, cv = self.lift_and_project(y)  # (B, 1, H, d)
        ctx_k, ctx_v, cpos = layer_cache.context.write(p, ck[:, 0], cv[:, 0])
        # Blocks are counted from the start of each row's current document.
        block_start = (p - (p - layer_cache.doc_start).remainder(w))[:, None]
        upper = (cpos <= p[:, None]) if cfg.cross_mask == "inclusive" else (cpos < p[:, None])
        valid = (cpos >= block_start) & upper  # (B, W)
        mask = additive_mask(valid, ck.dtype)[:, None, None, :]
        return ctx_k, ctx_v, mask, valid.any(-1)


class SHContextStates(TokenContextStates):
    """SH (single head, Listing 2): ``c_t = Norm(P_up y_t)``, projected to H heads by the context K/V projections."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.up_proj = nn.Linear(config.ssm_channels, d, bias=False)
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)

    def lift_and_project(self, y: torch.Tensor):
        c = self.norm(self.up_proj(y.to(self.down_proj.weight.dtype)[..., 0, :]))  # (..., D)
        k = self._heads(self.k_proj(c)).unsqueeze(-3)
        v = self._heads(self.v_proj(c)).unsqueeze(-3)
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., 1, H, d_h)

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        c = self.norm(F.linear(y[0].to(self.down_proj.weight.dtype).t(), self.up_proj.weight))  # (B*n, D)
        k = self._heads(self.k_proj(c)).unflatten(0, (bsz, -1))
        v = self._heads(self.v_proj(c)).unflatten(0, (bsz, -1))
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (B, n, H, d_h)


class MHContextStates(TokenContextStates):
    """MH (multi-head, Listing 3): H SSM outputs (one C matrix per head), each lifted by its own D_s -> D projection
    and projected to that head's keys/values."""

    # Long S4 sequences run segment by segment: no (B, T, H, Ds) SSM output or (B, T, H, D) lift is built.
    segment_len = MH_SEGMENT_LEN

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.up_proj = nn.Parameter(torch.empty(heads, config.ssm_channels, d))  # (H, Ds, D)
        self.k_proj = nn.Parameter(torch.empty(heads, d, hd))
        self.v_proj = nn.Parameter(torch.empty(heads, d, hd))

    def lift_and_project(self, y: torch.Tensor):
        y = y.to(self.down_proj.weight.dtype)
        c = self.norm(torch.einsum("...hs,hsd->...hd", y, self.up_proj.to(y.dtype)))  # (..., H, D)
        k = torch.einsum("...hd,hde->...he", c, self.k_proj.to(c.dtype)).unsqueeze(-3)
        v = torch.einsum("...hd,hde->...he", c, self.v_proj.to(c.dtype)).unsqueeze(-3)
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., 1, H, d_h)

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        # Contracted in the layout y has: (H, B*n, Ds) is a transposed view of (H, Ds, B*n), no copy.
        y = y.to(self.down_proj.weight.dtype)
        c = self.norm(torch.bmm(y.transpose(1, 2), self.up_proj.to(y.dtype)))  # (H, B*n, D)
        kv = torch.bmm(c, torch.cat([self.k_proj, self.v_proj], -1).to(c.dtype))  # (H, B*n, 2 d_h)
        k, v = kv.unflatten(1, (bsz, -1)).permute(1, 2, 0, 3).split(self.config.head_dim, -1)  # (B, n, H, d_h)
        return (l2_normalize(k) if self.config.qk_norm else k), v


class MFContextStates(BSTContextStates):
    """MF (multi-filter, Listing 4): S filters; block b attends to the S SSM outputs at the last token of block b-1
    (block 0: a learned initial context), each lifted by its own projection, plus learned context IDs; no mask.

    The decoding cache keeps the current block's S context keys/values and the latest SSM outputs `(B, S, Ds)`, the
    next block's context (``layer_cache.context``, a ``BlockContextCache``)."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd, s = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_context_states
        self.up_proj = nn.Parameter(torch.empty(s, config.ssm_channels, d))  # (S, Ds, D)
        self.context_ids = nn.Parameter(torch.empty(s, d))
        self.initial_context = nn.Parameter(torch.empty(s, d))
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)

    def mf_context(self, y_prev: torch.Tensor | None, batch_shape):
        """Context keys/values from the previous block's last SSM outputs ``y_prev`` `(..., S, Ds)` (None: block 0)."""
        if y_prev is None:
            c = self.initial_context.expand(*batch_shape, -1, -1)
        else:
            c = torch.einsum("...sc,scd->...sd", y_prev.to(self.up_proj.dtype), self.up_proj)
        if self.config.mf_context_ids_after_norm:
            c = self.norm(c) + self.context_ids.to(c.dtype)
        else:
            c = self.norm(c + self.context_ids.to(c.dtype))
        k, v = self._heads(self.k_proj(c)), self._heads(self.v_proj(c))
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., S, H, d_h)

    def sequence(self, xn, lengths, layer_cache, positions, fill_cache):
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w = self.block_len
        nb = seq_len // w
        z, state0, continued = self._sequence_input(xn, lengths, layer_cache, positions)
        if cfg.bidirectional:
            y_end = self.ssm(z, state0)[:, w - 1 :: w]
        else:
            # Causal S4: states at block ends, read out by the S filters (no FFT per filter).
            y_end = self.ssm.block_end_outputs(z, w, state0)  # (B, nb, S, Ds)
        first_k, first_v = self.mf_context(None, (bsz,))
        if continued:
            cont_k, cont_v = self.mf_context(layer_cache.context.last, (bsz,))
            fresh = (positions == layer_cache.doc_start)[:, None, None, None]
            first_k = torch.where(fresh, first_k.to(cont_k.dtype), cont_k)
            first_v = torch.where(fresh, first_v.to(cont_v.dtype), cont_v)
        rest_k, rest_v = self.mf_context(y_end[:, :-1], (bsz, nb - 1))
        ctx_k = torch.cat([first_k[:, None].to(rest_k.dtype), rest_k], 1)
        ctx_v = torch.cat([first_v[:, None].to(rest_v.dtype), rest_v], 1)
        if fill_cache:
            lens = self._fill_ssm_state(z, lengths, state0, layer_cache)
            rows = torch.arange(bsz, device=z.device)
            blk = ((lens - 1) // w).clamp(min=0)
            layer_cache.context.set_context(ctx_k[rows, blk].detach(), ctx_v[rows, blk].detach())
            # Needed at the next block start (lens % W == 0): the output at the last token, a block end.
            layer_cache.context.set_last(y_end[rows, (lens // w - 1).clamp(min=0)].detach())
        return ctx_k, ctx_v, None, False

    def step(self, xn, layer_cache, p):
        w = self.block_len
        rp = p - layer_cache.doc_start  # position inside the current document: blocks are counted from its start
        block_start = rp.remainder(w) == 0
        if maybe_any(block_start):
            # A new block starts: its context is built from the previous block's last SSM outputs.
            k_new, v_new = self.mf_context(layer_cache.context.last, (xn.shape[0],))
            k0, v0 = self.mf_context(None, (xn.shape[0],))
            first = (p == layer_cache.doc_start)[:, None, None, None]
            k_new, v_new = torch.where(first, k0, k_new), torch.where(first, v0, v_new)
            layer_cache.context.set_context(k_new, v_new, rows=block_start)
        block_end = (rp + 1).remainder(w) == 0
        # The SSM output matters only at block ends (unstruct computes it only there).
        y = self._step_ssm(xn, layer_cache, p, output=self.config.ssm_kind == "s4" or maybe_any(block_end))
        if y is not None:
            layer_cache.context.set_last(y, rows=block_end)
        return layer_cache.context.k, layer_cache.context.v, None, None


# The SSM kernel of each ``ssm_kind`` and the context builder of each ``context_mode``.
def _s4_kernel(channels, out_channels, config):
    """S4D with a state shared by the C read-outs, or (MF, ``mf_independent_filters``) one SSM per filter."""
    per_filter = config.context_mode == "mf" and config.mf_independent_filters
    return (PerFilterS4D if per_filter else S4DKernel)(channels, out_channels, config.ssm_state_size, config)


SSM_KERNELS = {"s4": _s4_kernel, "unstruct": UnstructFilter}
CONTEXT_BUILDERS = {"sh": SHContextStates, "mh": MHContextStates, "mf": MFContextStates}


def attention(module, q, k, v, mask, dropout, return_weights: bool = False):
    """The attention backend of ``module.config._attn_implementation`` (eager or SDPA), unscaled (queries carry the
    learned scale). ``q`` `(N, H, Lq, d)`, ``k``/``v`` `(N, H, Lk, d)`, additive ``mask`` broadcastable ->
    `(N, Lq, H, d)`, and with ``return_weights`` the weights `(N, H, Lq, Lk)` (eager attention only; None under SDPA).

    Under ``flex_attention`` this is SDPA: the full-sequence forms call [`flex_attention`] themselves (see
    [`use_flex`]); what comes here are one-query decode steps, the BRecT state update and the fallbacks.
    """
    implementation = module.config._attn_implementation
    if implementation == "flex_attention":
        implementation = "sdpa"
    if (
        implementation == "sdpa"
        and not return_weights
        and mask is not None
        and mask.requires_grad
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        return learned_mask_attention(q, k, v, mask, dropout)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    if torch.compiler.is_compiling():
        # Inductor may hand the CPU flash-attention kernel a key whose last dimension is strided (it only keeps the
        # stride order), for which that kernel returns wrong values; dense inputs cost eager nothing.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, weights = interface(module, q, k, v, mask, dropout=dropout, scaling=1.0, is_causal=False)
    return (out, weights) if return_weights else out


def learned_mask_attention(q, k, v, mask, dropout: float) -> torch.Tensor:
    """SDPA for an additive mask that needs a gradient (the learned T5 bias while training), written out.

    torch's fused CPU kernel returns no gradient for a mask, so SDPA takes its math path here; this computes exactly
    what that path does (half precision upcast to float32, results equal bit for bit) without its extra work: the
    query and key scaling by 1, a copy of the transposed keys, and the checks for fully masked rows (the masks here
    are finite, see [`masked_fill_value`]). ~25% less time per call at the training shapes on CPU.
    Same arguments as [`attention`]; returns `(N, Lq, H, d)`.
    """
    dtype = q.dtype
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = upcast(q), upcast(k), upcast(v)
        weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + mask.to(q.dtype), dim=-1)
        if dropout > 0:
            weights = F.dropout(weights, p=dropout)
        return torch.matmul(weights, v).to(dtype).transpose(1, 2).contiguous()


# -- FlexAttention (attn_implementation="flex_attention") ----------------------------------------------------------
# The full-sequence forms of the block self-attention and of both cross-attentions run as one FlexAttention call over
# the whole sequence: the window / block structure is a ``BlockMask`` whose tiles are derived analytically
# ([`tiled_block_mask`]), row-dependent masks (cached previous block, padding) and the T5 bias are ``mask_mod`` /
# ``score_mod`` functions. Everything else (decode steps, the BRecT state update) stays on SDPA; see
# docs/paper-mapping.md "Attention backends".

FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_flex(module, q: torch.Tensor, dropout: float, *tensors: torch.Tensor) -> bool:
    """Whether a full-sequence attention of ``module`` runs on FlexAttention: ``attn_implementation="flex_attention"``
    and nothing flex cannot do here, else the SDPA path (same result):

    * attention dropout (flex has no dropout);
    * a dtype flex's CPU kernel lacks (float64);
    * a backward on CPU (torch implements flex's backward on accelerators only): with gradients enabled and any of
      ``q``, ``tensors`` or the module's parameters requiring them, a CPU forward takes SDPA.
    """
    if module.config._attn_implementation != "flex_attention" or dropout > 0:
        return False
    if q.device.type != "cpu":
        return True
    if q.dtype not in FLEX_DTYPES:
        return False
    if torch.is_grad_enabled():
        needs_grad = any(t.requires_grad for t in (q, *tensors)) or any(p.requires_grad for p in module.parameters())
        if needs_grad:
            logger.warning_once(
                "BST: flex_attention has no backward on CPU; full-sequence attention with gradients runs on SDPA."
            )
            return False
    return True


_COMPILED_FLEX = {}


def flex_kernel(device_type: str):
    """``flex_attention`` compiled once per device type (uncompiled inside a compiled region, which compiles it).

    On accelerators transformers' [`compile_friendly_flex_attention`] (dynamic shapes after the first recompile).
    On CPU with static shapes, one compilation per input shape: in torch 2.13 inductor's CPU FlexAttention template
    emits C++ that does not compile for dynamic shapes (``'cur_kvSplitSize7' was not declared``)."""
    if torch.compiler.is_compiling():
        return flex_attention
    if device_type != "cpu":
        return compile_friendly_flex_attention
    if "cpu" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cpu"] = torch.compile(flex_attention, dynamic=False)
    compiled = _COMPILED_FLEX["cpu"]
    return lambda q, k, v, training=False, **kwargs: compiled(q, k, v, **kwargs)


def flex(module, q, k, v, block_mask, score_mod=None):
    """FlexAttention ([`flex_kernel`]), unscaled (queries carry the learned scale). ``q`` `(B, H, Lq, d)`,
    ``k``/``v`` `(B, H, Lk, d)` -> `(B, Lq, H, d)`; a query without any key gets zeros."""
    kernel = flex_kernel(q.device.type)
    out = kernel(q, k, v, training=module.training, score_mod=score_mod, block_mask=block_mask, scale=1.0)
    return out.transpose(1, 2)


def tiled_block_mask(mask_mod, q_len: int, kv_len: int, bands, device, keys_partial=None, tile: int = 128):
    """The ``BlockMask`` of ``mask_mod`` built from its band structure instead of evaluating it on all pairs.

    ``bands``: constraints ``(f, g, lo, hi)`` that ``mask_mod`` implies, each ``lo <= g(kv) - f(q) <= hi`` with
    ``f``/``g`` non-decreasing integer maps of index tensors (positions, block indices). A `tile x tile` tile is
    skipped if some band excludes all its pairs and is "full" (no ``mask_mod`` call) if every band includes all its
    pairs and no key of it is in ``keys_partial`` (a bool tensor `(kv_len,)` of keys that ``mask_mod`` also masks
    per row: cached-block validity, padding); all other tiles are partial and ``mask_mod`` decides per pair, so the
    mask is exactly ``mask_mod`` whenever ``mask_mod`` implies the bands. Costs O((q_len / tile) x (kv_len / tile)).
    """
    nq, nk = -(-q_len // tile), -(-kv_len // tile)
    q_first = torch.arange(nq, device=device) * tile
    k_first = torch.arange(nk, device=device) * tile
    q_last = (q_first + tile).clamp(max=q_len) - 1
    k_last = (k_first + tile).clamp(max=kv_len) - 1
    any_pair = torch.ones(nq, nk, dtype=torch.bool, device=device)
    all_pairs = torch.ones(nq, nk, dtype=torch.bool, device=device)
    for f, g, lo, hi in bands:
        low = g(k_first)[None] - f(q_last)[:, None]  # (nq, nk): the band quantity's range over the tile
        high = g(k_last)[None] - f(q_first)[:, None]
        any_pair &= (high >= lo) & (low <= hi)
        all_pairs &= (low >= lo) & (high <= hi)
    if keys_partial is not None:
        tiles_partial = F.pad(keys_partial, (0, nk * tile - kv_len)).view(nk, tile).any(-1)
        all_pairs &= ~tiles_partial[None]
    partial = any_pair & ~all_pairs

    def blocks(selected):
        # Indices of the selected kv tiles first (stable order), their count per query tile.
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return selected.sum(-1, dtype=torch.int32)[None, None], order[None, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(all_pairs)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


def positions_of(offset: int = 0):
    """Band map: index -> index - ``offset``."""
    return lambda idx: idx - offset


def groups_of(size: int, offset: int = 0):
    """Band map: index -> (index - ``offset``) // ``size`` (block of a token, group of a context state)."""
    return lambda idx: torch.div(idx - offset, size, rounding_mode="floor")


def grouped_flex(module, q, k, v, q_group: int, kv_group: int, causal_within: str | None = None):
    """Flex attention of query block ``i // q_group`` over key group ``j // kv_group``: every block's queries see only
    their own block's keys (context states, recurrent state keys). ``q`` `(B, T, H, d)`, ``k``/``v``
    `(B, S_total, H, d)` -> `(B, T, H, d)`. ``causal_within``: ``"inclusive"`` (key j <= query i) or ``"strict"``
    (j < i) for one key per token (SH/MH, ``q_group == kv_group``); None: the whole group."""
    q_len, kv_len = q.shape[1], k.shape[1]
    bands = [(groups_of(q_group), groups_of(kv_group), 0, 0)]
    if causal_within is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx // kv_group == q_idx // q_group

    else:
        upper = 0 if causal_within == "inclusive" else -1
        bands.append((positions_of(), positions_of(), -(q_group - 1), upper))

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx // kv_group == q_idx // q_group) & (kv_idx - q_idx <= upper)

    block_mask = tiled_block_mask(mask_mod, q_len, kv_len, bands, q.device)
    return flex(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask)


class BSTRecurrentState(nn.Module):
    """BRecT:fixed:skip recurrent cell (meliad ``recurrent_gate_type="bias"``, ``recurrent_skip_ffn=True``).

    Per block: ``z = [attn(Qr, Kr, Vr) ; attn(Q2r, K_tokens, V_tokens)] Wo_r`` over the previous and current block's
    token keys/values, then ``s' = g * s + (1 - g) * z`` with a learned input-independent gate ``g = sigmoid(b)``.
    ``update`` is one block (the recurrent form), ``sequence`` runs it over all blocks of a sequence.
    """

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        d, heads, hd, s = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_recurrent_states
        self.initial_state = nn.Parameter(torch.empty(s, d))
        self.state_pos = nn.Parameter(torch.empty(s, d))
        self.norm = BSTRMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)
        self.q2_proj = nn.Linear(d, heads * hd, bias=False)
        self.o_proj = nn.Linear(2 * heads * hd, d, bias=False)
        self.self_scale = nn.Parameter(torch.empty(heads))
        self.cross_scale = nn.Parameter(torch.empty(heads))
        self.gate_bias = nn.Parameter(torch.empty(d))
        self.is_causal = False

    def _heads(self, x):
        return x.unflatten(-1, (self.config.num_attention_heads, self.config.head_dim))

    def keys_values(self, state: torch.Tensor):
        """Keys/values the tokens read from the state: `(B, S, D)` -> 2 x `(B, S, H, d_h)`."""
        sn = self.norm(state) + self.state_pos.to(state.dtype)
        k = self._heads(self.k_proj(sn))
        if self.config.qk_norm:
            k = l2_normalize(k)
        return k, self._heads(self.v_proj(sn))

    def update(self, state, token_k, token_v, token_valid, state_kv=None):
        """Next state. ``token_k``/``token_v`` `(B, 2W, H, d_h)` (already normalised), ``token_valid`` `(B, 2W)`;
        ``state_kv``: the state's keys/values if already computed (``keys_values(state)``)."""
        cfg = self.config
        sn = self.norm(state) + self.state_pos.to(state.dtype)
        q = self._heads(self.q_proj(sn))
        q2 = self._heads(self.q2_proj(sn))
        k, v = state_kv if state_kv is not None else self.keys_values(state)
        if cfg.qk_norm:
            q, q2 = l2_normalize(q), l2_normalize(q2)
        q = q * self.self_scale.to(q.dtype)[:, None]
        q2 = q2 * self.cross_scale.to(q2.dtype)[:, None]
        r_self = attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0.0)
        mask = additive_mask(token_valid, q2.dtype)[:, None, None, :]
        r_cross = attention(self, q2.transpose(1, 2), token_k.transpose(1, 2), token_v.transpose(1, 2), mask, 0.0)
        r_cross = r_cross * token_valid.any(-1).to(r_cross.dtype)[:, None, None, None]
        z = self.o_proj(torch.cat([r_self.flatten(-2), r_cross.flatten(-2)], -1))
        gate = torch.sigmoid(upcast(self.gate_bias)).to(state.dtype)
        return gate * state + (1 - gate) * z.to(state.dtype)

    def sequence(self, state, kb, vb, previous):
        """The recurrence over the blocks of a sequence (the package's only sequential loop).

        ``state`` `(B, S, D)` before block 0; ``kb``/``vb`` `(B, nb, W, H, d_h)` the blocks' token keys/values;
        ``previous``: the block before block 0 ``(k, v, valid)`` (`(B, W, H, d_h)` x 2, `(B, W)`).
        Returns the states before and after every block `(B, nb + 1, S, D)` and the keys/values that block b's
        tokens read from the state before it, `(B, nb, S, H, d_h)` x 2.
        """
        bsz, nb, w = kb.shape[:3]
        prev_k, prev_v, prev_valid = previous
        cur_valid = torch.ones(bsz, w, dtype=torch.bool, device=kb.device)
        states, state_keys, state_values = [state], [], []
        for b in range(nb):
            kcat = torch.cat([prev_k if b == 0 else kb[:, b - 1], kb[:, b]], 1)
            vcat = torch.cat([prev_v if b == 0 else vb[:, b - 1], vb[:, b]], 1)
            valid = torch.cat([prev_valid if b == 0 else cur_valid, cur_valid], 1)
            # The state's keys/values serve both its own update and the tokens of block b: computed once.
            state_kv = self.keys_values(states[-1])
            state_keys.append(state_kv[0])
            state_values.append(state_kv[1])
            states.append(self.update(states[-1], kcat, vcat, valid, state_kv))
        return torch.stack(states, 1), torch.stack(state_keys, 1), torch.stack(state_values, 1)


class BSTBlockSelfAttention(nn.Module):
    """Block self-attention (paper Sec. 3.1, meliad's windowed attention): every token attends over exactly the W
    previous tokens (the W most recent with ``attend_self``), with a T5 relative bias (one table per layer),
    L2-normalised queries/keys and a learned per-head scale applied after the bias is added.

    * ``forward``: full-sequence form. All blocks in one batched call over ``[previous block ; own block]`` keys
      (query-chunked with ``attention_query_chunk``); the first block sees the cached previous block or none;
      bidirectional models see the previous, own and next block; with ``output_attentions`` one dense `(T, K)`
      matrix per head (eager) whose weights are returned.
    * ``flex_forward``: the same under ``attn_implementation="flex_attention"``, one FlexAttention call over the
      whole sequence (window as a ``BlockMask``, T5 bias as a ``score_mod``).
    * ``step``: recurrent form for one token over the attention ring of the cache.
    """

    def __init__(self, config: BSTConfig, ring: int):
        super().__init__()
        self.config = config
        self.block_len = config.block_len
        self.ring = ring
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)
        self.scale = nn.Parameter(torch.empty(heads))
        self.relative_bias = nn.Embedding(config.relative_attention_num_buckets, heads)
        self.is_causal = False

    def _heads(self, x):
        return x.unflatten(-1, (self.config.num_attention_heads, self.config.head_dim))

    def project(self, xn):
        """Queries (scaled), keys, values `(B, T, H, d_h)` of the normalised input ``xn`` `(B, T, D)`."""
        q = self._heads(self.q_proj(xn))
        k = self._heads(self.k_proj(xn))
        v = self._heads(self.v_proj(xn))
        if self.config.qk_norm:
            q, k = l2_normalize(q), l2_normalize(k)
        return q * self.scale.to(q.dtype)[:, None], k, v

    def bias(self, relative_position):
        """T5 bias for relative positions `(...)` -> `(..., H)`."""
        cfg = self.config
        bucket = t5_relative_bucket(
            relative_position,
            cfg.bidirectional,
            cfg.relative_attention_num_buckets,
            cfg.relative_attention_max_distance,
        )
        return self.relative_bias(bucket)

    def window_valid(self, relative_position):
        """Causal sliding window on ``key_pos - query_pos``: exactly W previous tokens (or W most recent with self)."""
        w = self.block_len
        if self.config.attend_self:
            return (relative_position <= 0) & (relative_position > -w)
        return (relative_position < 0) & (relative_position >= -w)

    def block_mask(self, num_queries: int, key_start: int, key_end: int, dtype, device):
        """Additive mask `(1, H, Q, K)`: T5 bias and sliding window of queries at positions 0 .. Q-1 over keys at
        positions ``key_start`` .. ``key_end`` - 1 (relative to the first query)."""
        q_pos = torch.arange(num_queries, device=device)[:, None]
        k_pos = torch.arange(key_start, key_end, device=device)[None]
        rel = k_pos - q_pos  # (Q, K)
        # Bias and mask depend only on the distance: build them for the distinct distances, then gather
        # (4x cheaper in backward than an embedding lookup per (query, key) pair).
        lowest = key_start - (num_queries - 1)
        distances = torch.arange(lowest, key_end, device=device)  # (n,)
        per_distance = self.bias(distances).to(dtype) * self.scale.to(dtype)  # (n, H)
        if not self.config.bidirectional:
            valid = self.window_valid(distances)[:, None]
            per_distance = torch.where(valid, per_distance, masked_fill_value(dtype))
        bias = per_distance.t()[:, rel - lowest]  # (H, Q, K)
        # 4-D (1, H, Q, K): SDPA on CPU takes its fused path only for 4-D masks (3-D falls back to ~4x slower math).
        return bias.unsqueeze(0)

    def previous_block(self, layer_cache: BSTLayerCache, positions):
        """The cached block before ``positions``: keys, values `(B, W, H, d)`, which are held (else masked)."""
        return layer_cache.attention.window(positions, self.block_len)

    def write_cache(self, layer_cache: BSTLayerCache, k, v, lengths, positions):
        """Keep the keys/values `(B, T, H, d)` of each row's real tokens in the attention ring."""
        bsz, seq_len = k.shape[:2]
        lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=k.device)
        layer_cache.attention.fill(k.detach(), v.detach(), lens, self.ring, positions)

    # -- full-sequence form --------------------------------------------------------------------------------------
    def forward(self, q, k, v, lengths=None, layer_cache=None, positions=None, num_positions=None, weights=False):
        """
        Args:
            q, k, v (`torch.Tensor` of shape `(B, T, H, d_h)`): from [`project`]; T is a multiple of W.
            lengths (`torch.LongTensor` of shape `(B,)`, *optional*): real tokens per row (right padding).
            layer_cache, positions: a continued sequence (rows block-aligned) sees the cached previous block.
            num_positions (`int`, *optional*): leading positions the returned weights cover.
            weights (`bool`): also return the attention weights `(B, H, T, K)` (eager; the dense form).

        Returns:
            the attention output `(B, T, H * d_h)` and the weights (None unless ``weights``).
        """
        cfg = self.config
        bsz, seq_len, heads, hd = q.shape
        w = self.block_len
        nb = seq_len // w
        continued = layer_cache is not None and positions is not None
        drop = cfg.attention_dropout if self.training else 0.0
        if weights:
            previous = self.previous_block(layer_cache, positions) if continued and not cfg.bidirectional else None
            n_out = seq_len if num_positions is None else num_positions
            out, probs = self.dense(q, k, v, n_out, lengths, previous, drop)
            return out.reshape(bsz, seq_len, heads * hd), probs
        if use_flex(self, q, drop, k, v):
            previous = self.previous_block(layer_cache, positions) if continued and not cfg.bidirectional else None
            return self.flex_forward(q, k, v, lengths, previous).reshape(bsz, seq_len, heads * hd), None
        qb = q.view(bsz * nb, w, heads, hd).transpose(1, 2)
        kb, vb = k.view(bsz, nb, w, heads, hd), v.view(bsz, nb, w, heads, hd)
        if cfg.bidirectional:
            out = self.bidirectional(qb, kb, vb, lengths, drop)
        else:
            out = self.windowed(qb, kb, vb, layer_cache, positions, drop)
        return out.reshape(bsz, seq_len, heads * hd), None

    def flex_forward(self, q, k, v, lengths, previous):
        """The full-sequence form on FlexAttention: one call over all T queries and the T keys (after the cached
        previous block's W keys for a continued sequence), with the same key set per query as the block form.

        The window (or, bidirectional, the previous / own / next block) is the band of the ``BlockMask``; the cached
        block's validity and the padding (bidirectional) are ``mask_mod`` terms; the scaled T5 bias is a ``score_mod``
        lookup by distance. A query without any key (a document's first token, ``attend_self=False``) gets zeros, as
        in the block form. ``q``/``k``/``v`` `(B, T, H, d)`; ``previous``: ``(k, v, valid)`` or None. -> `(B, T, H, d)`.
        """
        cfg = self.config
        bsz, seq_len = q.shape[:2]
        w = self.block_len
        device = q.device
        offset, keys_partial = 0, None
        if cfg.bidirectional:
            lowest, highest = -(2 * w - 1), 2 * w - 1
            lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=device)
            bands = [(groups_of(w), groups_of(w), -1, 1)]
            keys_partial = torch.arange(seq_len, device=device) >= lens.min()

            def mask_mod(b, h, q_idx, kv_idx):
                return ((kv_idx // w - q_idx // w).abs() <= 1) & (kv_idx < lens[b])

        else:
            lowest, highest = (-(w - 1), 0) if cfg.attend_self else (-w, -1)
            if previous is not None:
                prev_k, prev_v, prev_valid = previous
                k, v = torch.cat([prev_k.to(k.dtype), k], 1), torch.cat([prev_v.to(v.dtype), v], 1)
                offset = w
                keys_partial = torch.arange(w + seq_len, device=device) < w

                def mask_mod(b, h, q_idx, kv_idx):
                    rel = kv_idx - offset - q_idx
                    cached_ok = (kv_idx >= offset) | prev_valid[b, kv_idx.clamp(max=offset - 1)]
                    return (rel >= lowest) & (rel <= highest) & cached_ok

            else:

                def mask_mod(b, h, q_idx, kv_idx):
                    rel = kv_idx - q_idx
                    return (rel >= lowest) & (rel <= highest)

            bands = [(positions_of(), positions_of(offset), lowest, highest)]
        # Scaled T5 bias per reachable distance ``lowest .. highest`` (bias added before the learned scale).
        distances = torch.arange(lowest, highest + 1, device=device)
        table = (self.bias(distances).to(q.dtype) * self.scale.to(q.dtype)).t().contiguous()  # (H, n)
        last = table.shape[1] - 1

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, (kv_idx - offset - q_idx - lowest).clamp(0, last)]

        block_mask = tiled_block_mask(mask_mod, seq_len, k.shape[1], bands, device, keys_partial)
        return flex(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask, score_mod)

    def windowed(self, qb, kb, vb, layer_cache, positions, drop):
        """Causal block attention: queries `(B*nb, H, W, d)`, keys/values `(B, nb, W, H, d)` -> `(B, nb, W, H, d)`."""
        bsz, nb, w, heads, hd = kb.shape
        if layer_cache is not None and positions is not None:
            prev_k, prev_v, prev_valid = self.previous_block(layer_cache, positions)  # (B, W, H, d)
            # Rows that start a new document (BSTCache.reset_rows) have no previous block.
            continued_all = not maybe_any(~prev_valid)
        else:
            prev_k = prev_v = torch.zeros_like(kb[:, 0])
            prev_valid, continued_all = None, False
        kprev = torch.cat([prev_k[:, None], kb[:, :-1]], 1)
        vprev = torch.cat([prev_v[:, None], vb[:, :-1]], 1)
        kcat = torch.cat([kprev, kb], 2).view(bsz * nb, 2 * w, heads, hd).transpose(1, 2)
        vcat = torch.cat([vprev, vb], 2).view(bsz * nb, 2 * w, heads, hd).transpose(1, 2)
        # One call over all blocks; unless every row continues a cached block, block 0 (whose previous block is
        # absent or partly masked) is recomputed below and replaces the first block of the output.
        out = self.chunked(qb, kcat, vcat, drop)
        if continued_all:
            return out
        q_blocks = qb.view(bsz, nb, heads, w, hd)
        k_blocks = kcat.view(bsz, nb, heads, 2 * w, hd)
        v_blocks = vcat.view(bsz, nb, heads, 2 * w, hd)
        if prev_valid is None:
            # The first block has no previous block: attend over its own keys only.
            own_mask = self.block_mask(w, 0, w, qb.dtype, qb.device)  # (1, H, W, W)
            a_first = attention(self, q_blocks[:, 0], k_blocks[:, 0, :, w:], v_blocks[:, 0, :, w:], own_mask, drop)
            empty_first = torch.ones(bsz, dtype=torch.bool, device=qb.device)
        else:
            mask = self.block_mask(w, -w, w, qb.dtype, qb.device)  # (1, H, W, 2W)
            key_ok = torch.cat([prev_valid, torch.ones_like(prev_valid)], 1)  # (B, 2W)
            first_mask = mask + additive_mask(key_ok, mask.dtype)[:, None, None, :]
            a_first = attention(self, q_blocks[:, 0], k_blocks[:, 0], v_blocks[:, 0], first_mask, drop)
            empty_first = ~prev_valid.any(-1)
        if not self.config.attend_self:
            # The first token of a document has no previous token: zero output (meliad safe softmax).
            keep = (~empty_first).to(a_first.dtype)[:, None, None, None]
            a_first = torch.cat([a_first[:, :1] * keep, a_first[:, 1:]], 1)
        return torch.cat([a_first[:, None], out.view(bsz, nb, w, heads, hd)[:, 1:]], 1)

    def chunked(self, qb, kcat, vcat, drop):
        """Sliding-window attention of every block's W queries over its 2W keys (previous + own block).

        Each query sees only W of the 2W keys: with ``config.attention_query_chunk`` c < W, the queries are split
        into W/c chunks that attend over the W + c keys their windows can reach (slices, no copies), which skips
        (W - c) / 2W of the attention work. The keys left out are masked for those queries, so the result is the
        same. Every chunk has the same relative layout, so one (c, W + c) bias/mask serves all of them.
        """
        w = self.block_len
        chunk = min(self.config.resolved_attention_query_chunk, w)
        mask = self.block_mask(chunk, -w, chunk, qb.dtype, qb.device)  # (1, H, c, W + c)
        if chunk == w:
            return attention(self, qb, kcat, vcat, mask, drop)
        parts = []
        for start in range(0, w, chunk):
            keys = slice(start, start + w + chunk)
            parts.append(
                attention(self, qb[:, :, start : start + chunk], kcat[:, :, keys], vcat[:, :, keys], mask, drop)
            )
        return torch.cat(parts, 1)

    def bidirectional(self, qb, kb, vb, lengths, drop):
        """Bidirectional blocks attend to the previous, own and next block (no causal mask; padding masked)."""
        bsz, nb, w, heads, hd = kb.shape
        zeros = torch.zeros_like(kb[:, :1])
        kcat = torch.cat([torch.cat([zeros, kb[:, :-1]], 1), kb, torch.cat([kb[:, 1:], zeros], 1)], 2)
        vcat = torch.cat([torch.cat([zeros, vb[:, :-1]], 1), vb, torch.cat([vb[:, 1:], zeros], 1)], 2)
        key_pos = (torch.arange(nb, device=kb.device)[:, None] * w) + torch.arange(-w, 2 * w, device=kb.device)
        lens = lengths if lengths is not None else torch.full((bsz,), nb * w, device=kb.device)
        valid = (key_pos[None] >= 0) & (key_pos[None] < lens[:, None, None])  # (B, nb, 3W)
        bias = self.block_mask(w, -w, 2 * w, qb.dtype, qb.device)  # (1, H, W, 3W)
        mask = bias[None] + additive_mask(valid, qb.dtype)[:, :, None, None]
        return attention(
            self,
            qb,
            kcat.reshape(bsz * nb, 3 * w, heads, hd).transpose(1, 2),
            vcat.reshape(bsz * nb, 3 * w, heads, hd).transpose(1, 2),
            mask.reshape(bsz * nb, heads, w, 3 * w),
            drop,
        )

    def dense(self, q, k, v, num_positions, lengths, previous, dropout):
        """Self-attention of the first ``num_positions`` queries over all keys at once, returning its weights.

        The form used with ``output_attentions`` (eager): the same window, bias and masks as the block form, written
        as one `(T, K)` matrix per head, so that the returned weights are the ones the output is computed from.
        ``q``/``k``/``v`` `(B, T_pad, H, d)`; ``previous``: the cached previous block ``(k, v, valid)`` or None.
        Returns the output `(B, T_pad, H, d)` (zero beyond ``num_positions``) and the weights `(B, H, T, K)`.
        """
        cfg = self.config
        w, n = self.block_len, num_positions
        bsz, padded_len = q.shape[:2]
        device = q.device
        q, k, v = q[:, :n], k[:, :n], v[:, :n]
        q_pos = torch.arange(n, device=device)
        k_pos = q_pos
        key_ok = None
        if previous is not None:
            prev_k, prev_v, prev_valid = previous
            k, v = torch.cat([prev_k, k], 1), torch.cat([prev_v, v], 1)
            k_pos = torch.arange(-w, n, device=device)
            key_ok = torch.cat([prev_valid, torch.ones(bsz, n, dtype=torch.bool, device=device)], 1)  # (B, K)
        rel = k_pos[None] - q_pos[:, None]  # (T, K)
        if cfg.bidirectional:
            valid = (torch.div(k_pos, w, rounding_mode="floor")[None] - (q_pos // w)[:, None]).abs() <= 1
            if lengths is not None:
                key_ok = k_pos[None] < lengths[:, None]
        else:
            valid = self.window_valid(rel)
        ok = valid[None] if key_ok is None else valid[None] & key_ok[:, None, :]  # (B or 1, T, K)
        bias = (self.bias(rel).to(q.dtype) * self.scale.to(q.dtype)).permute(2, 0, 1)  # (H, T, K)
        logits = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) + bias  # (B, H, T, K)
        logits = logits.masked_fill(~ok[:, None], masked_fill_value(logits.dtype))
        weights = torch.softmax(upcast(logits), dim=-1).to(q.dtype)
        # A query without any key (a document's first token) gets zero weights (meliad's safe softmax).
        weights = weights * ok.any(-1)[:, None, :, None].to(weights.dtype)
        weights = F.dropout(weights, p=dropout, training=self.training)
        out = torch.matmul(weights, v.transpose(1, 2)).transpose(1, 2)  # (B, T, H, d)
        return F.pad(out, (0, 0, 0, 0, 0, padded_len - n)), weights

    # -- recurrent form ------------------------------------------------------------------------------------------
    def step(self, q, k, v, layer_cache: BSTLayerCache, positions, weights=False):
        """One token per row at ``positions`` `(B,)`: writes its key/value into the ring, then attends over the W
        previous (or most recent) tokens. ``q``/``k``/``v`` `(B, 1, H, d_h)` from [`project`].

        Returns the output `(B, 1, H * d_h)`, the weights `(B, H, 1, R)` over the ring (None unless ``weights``)
        and the ring ``(keys, values, key positions)`` after the write (a BRecT cell reads them at block ends).
        """
        p = positions
        bsz, _, heads, hd = q.shape
        ring_k, ring_v, kpos = layer_cache.attention.write(p, k[:, 0], v[:, 0])
        rel = kpos - p[:, None]  # (B, R)
        valid = (kpos >= 0) & self.window_valid(rel)
        # The ring holds distances 0 .. R-1 only: gather the scaled T5 bias from a per-distance table.
        table = self.step_bias_table(layer_cache, q.dtype)  # (H, R), column j = distance j
        bias = table[:, (-rel).clamp(0, self.ring - 1)].permute(1, 0, 2)  # (B, H, R)
        mask = torch.where(valid[:, None], bias, masked_fill_value(q.dtype))[:, :, None, :]  # (B, H, 1, R)
        out, probs = attention(
            self, q.transpose(1, 2), ring_k.transpose(1, 2), ring_v.transpose(1, 2), mask, 0.0, True
        )
        any_key = valid.any(-1).to(out.dtype)[:, None, None, None]
        out = out * any_key
        probs = probs * any_key if weights else None
        return out.reshape(bsz, 1, heads * hd), probs, (ring_k, ring_v, kpos)

    def step_bias_table(self, layer_cache, dtype):
        """Scaled T5 bias per distance 0 .. R-1, `(H, R)`; memoised in the cache while the parameters are unchanged."""

        def compute():
            distances = -torch.arange(self.ring, device=self.scale.device)
            return (self.bias(distances).to(dtype) * self.scale.to(dtype)).t().contiguous()

        params = (self.relative_bias.weight, self.scale)
        return decode_memo(layer_cache, "bias", (dtype,), params, compute)


class BSTCrossAttention(nn.Module):
    """The second attention of a BST or BRecT layer: its own queries (``q_proj``, L2-normalised, learned per-head
    scale) over keys/values that are not the tokens' (context states, or the recurrent state)."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        self.block_len = config.block_len
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.scale = nn.Parameter(torch.empty(heads))
        self.is_causal = False

    def query(self, xn):
        """Scaled queries `(B, T, H, d_h)` of the normalised input ``xn`` `(B, T, D)`."""
        cfg = self.config
        q = self.q_proj(xn).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        if cfg.qk_norm:
            q = l2_normalize(q)
        return q * self.scale.to(q.dtype)[:, None]


class BSTContextCrossAttention(BSTCrossAttention):
    """BST cross-attention (paper Sec. 3.2): every block's tokens attend to that block's context states, built by
    the SH / MH / MF builder of ``context_mode`` (``self.context``, from [`CONTEXT_BUILDERS`]) over the SSM."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.context = CONTEXT_BUILDERS[config.context_mode](config)

    def forward(
        self,
        xn,
        lengths=None,
        layer_cache=None,
        positions=None,
        fill_cache=False,
        num_positions=None,
        weights=False,
        ssm_x=None,
    ):
        """Full-sequence form: ``xn`` `(B, T, D)`, T a multiple of W (the context builder runs the SSM over it, or
        over ``ssm_x`` where given (``ssm_input="raw"``), and, with ``fill_cache``, writes its state). Returns
        `(B, T, H * d_h)` and the weights `(B, H, T, S_c)` (None unless ``weights``)."""
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w, heads, hd = self.block_len, cfg.num_attention_heads, cfg.head_dim
        nb = seq_len // w
        ssm_x = xn if ssm_x is None else ssm_x
        ctx_k, ctx_v, ctx_mask, zero_first = self.context.sequence(ssm_x, lengths, layer_cache, positions, fill_cache)
        drop = cfg.attention_dropout if self.training else 0.0
        s_c = ctx_k.shape[2]
        if not weights and use_flex(self, xn, drop, ctx_k, ctx_v):
            # Block-diagonal over the context states of each block (SH/MH: triangular within it; strict: a block's
            # first query sees none and gets zeros, as ``zero_first`` below).
            within = None if ctx_mask is None else cfg.cross_mask
            out = grouped_flex(self, self.query(xn), ctx_k.flatten(1, 2), ctx_v.flatten(1, 2), w, s_c, within)
            return out.reshape(bsz, seq_len, heads * hd), None
        q2 = self.query(xn).view(bsz * nb, w, heads, hd).transpose(1, 2)
        ck = ctx_k.reshape(bsz * nb, s_c, heads, hd).transpose(1, 2)
        cv = ctx_v.reshape(bsz * nb, s_c, heads, hd).transpose(1, 2)
        chunk = min(cfg.resolved_attention_query_chunk, w)
        probs = None
        if weights:
            out, cw = attention(self, q2, ck, cv, ctx_mask, drop, return_weights=True)  # cw (B*nb, H, W, S_c)
            if zero_first:
                cw = torch.cat([torch.zeros_like(cw[:, :, :1]), cw[:, :, 1:]], 2)
            probs = cw.view(bsz, nb, heads, w, s_c).transpose(1, 2).reshape(bsz, heads, seq_len, s_c)
            probs = probs[:, :, : seq_len if num_positions is None else num_positions]
        elif ctx_mask is not None and chunk < w:
            # Triangular SH/MH mask: queries of a chunk see only the context states up to the chunk's end.
            out = torch.cat(
                [
                    attention(
                        self,
                        q2[:, :, i : i + chunk],
                        ck[:, :, : i + chunk],
                        cv[:, :, : i + chunk],
                        ctx_mask[i : i + chunk, : i + chunk],
                        drop,
                    )
                    for i in range(0, w, chunk)
                ],
                1,
            )
        else:
            out = attention(self, q2, ck, cv, ctx_mask, drop)  # (B*nb, W, H, d)
        if zero_first:
            out = torch.cat([torch.zeros_like(out[:, :1]), out[:, 1:]], 1)
        return out.reshape(bsz, seq_len, heads * hd), probs

    def step(self, xn, layer_cache: BSTLayerCache, positions, weights=False, ssm_x=None):
        """Recurrent form for one token ``xn`` `(B, 1, D)`: the context builder advances the SSM (over ``ssm_x``
        where given) and context state in ``layer_cache``. Returns `(B, 1, H * d_h)` and the weights `(B, H, 1, S_c)`
        (None unless ``weights``)."""
        bsz = xn.shape[0]
        ssm_x = xn if ssm_x is None else ssm_x
        ctx_k, ctx_v, ctx_mask, any_valid = self.context.step(ssm_x, layer_cache, positions)
        q2 = self.query(xn).transpose(1, 2)  # (B, H, 1, d)
        out, probs = attention(self, q2, ctx_k.transpose(1, 2), ctx_v.transpose(1, 2), ctx_mask, 0.0, True)
        if any_valid is not None:
            keep = any_valid.to(out.dtype)[:, None, None, None]
            out = out * keep
            if weights:
                probs = probs * keep
        return out.reshape(bsz, 1, -1), probs if weights else None


class BSTRecurrentCrossAttention(BSTCrossAttention):
    """BRecT cross-attention: every block's tokens attend to the recurrent state before that block; the state
    (``self.recurrent``, a [`BSTRecurrentState`]) absorbs each block's tokens at its end."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.recurrent = BSTRecurrentState(config)

    def forward(
        self,
        xn,
        k,
        v,
        previous,
        lengths=None,
        layer_cache=None,
        positions=None,
        fill_cache=False,
        num_positions=None,
        weights=False,
    ):
        """Full-sequence form. ``xn`` `(B, T, D)`; ``k``/``v`` `(B, T, H, d_h)` the tokens' self-attention keys/values;
        ``previous`` the cached block before the sequence ``(k, v, valid)`` or None. With ``fill_cache`` the state
        after each row's real tokens goes into ``layer_cache``. Returns `(B, T, H * d_h)` and the weights
        `(B, H, T, S)` (None unless ``weights``)."""
        cfg = self.config
        bsz, seq_len, heads, hd = k.shape
        w = self.block_len
        nb = seq_len // w
        rec = self.recurrent
        kb, vb = k.view(bsz, nb, w, heads, hd), v.view(bsz, nb, w, heads, hd)
        if previous is not None:
            state = layer_cache.recurrent.state.to(kb.dtype)
            fresh = (positions == layer_cache.doc_start)[:, None, None]
            state = torch.where(fresh, rec.initial_state.to(kb.dtype), state)
        else:
            state = rec.initial_state.to(kb.dtype).expand(bsz, -1, -1)
            zeros = torch.zeros_like(kb[:, 0])
            previous = (zeros, zeros, torch.zeros(bsz, w, dtype=torch.bool, device=kb.device))
        all_states, sk, sv = rec.sequence(state, kb, vb, previous)  # (B, nb+1, S, D), (B, nb, S, H, d) x 2
        s = sk.shape[2]
        drop = cfg.attention_dropout if self.training else 0.0
        q2 = self.query(xn)
        probs = None
        if not weights and use_flex(self, q2, drop, sk, sv):
            # Every block's queries over the S state keys before that block (the state recurrence stays on SDPA).
            out = grouped_flex(self, q2, sk.flatten(1, 2), sv.flatten(1, 2), w, s)
        else:
            out, probs = attention(
                self,
                q2.view(bsz * nb, w, heads, hd).transpose(1, 2),
                sk.reshape(bsz * nb, s, heads, hd).transpose(1, 2),
                sv.reshape(bsz * nb, s, heads, hd).transpose(1, 2),
                None,
                drop,
                return_weights=True,
            )
        if fill_cache:
            lens = lengths if lengths is not None else torch.full((bsz,), nb * w, device=kb.device)
            rows = torch.arange(bsz, device=kb.device)
            new_state = all_states[rows, lens // w].detach()
            layer_cache.recurrent.set(new_state, *(t.detach() for t in rec.keys_values(new_state)))
        if weights:
            probs = probs.view(bsz, nb, heads, w, s).transpose(1, 2).reshape(bsz, heads, nb * w, s)
            probs = probs[:, :, : seq_len if num_positions is None else num_positions]
        return out.reshape(bsz, seq_len, heads * hd), probs if weights else None

    def step(self, xn, ring, layer_cache: BSTLayerCache, positions, weights=False):
        """Recurrent form for one token ``xn`` `(B, 1, D)`; ``ring``: the self-attention ring after this token's
        write ``(keys, values, key positions)``. Returns `(B, 1, H * d_h)` and the weights `(B, H, 1, S)`."""
        p = positions
        rec = self.recurrent
        fresh = p == layer_cache.doc_start
        if maybe_any(fresh):
            # First token of a document: the state starts from the learned initial state.
            state = layer_cache.recurrent.state
            init_state = rec.initial_state.to(state.dtype).expand_as(state)
            layer_cache.recurrent.set(init_state, *rec.keys_values(init_state), rows=fresh)
        q2 = self.query(xn).transpose(1, 2)
        out, probs = attention(
            self, q2, layer_cache.recurrent.k.transpose(1, 2), layer_cache.recurrent.v.transpose(1, 2), None, 0.0, True
        )
        # At the last token of a block, the state absorbs the previous and current block.
        block_end = (p - layer_cache.doc_start + 1).remainder(self.block_len) == 0
        if maybe_any(block_end):
            ring_k, ring_v, kpos = ring
            new_state = rec.update(layer_cache.recurrent.state, ring_k, ring_v, kpos >= 0)
            layer_cache.recurrent.set(new_state, *rec.keys_values(new_state), rows=block_end)
        return out.reshape(xn.shape[0], 1, -1), probs if weights else None


class BSTMLP(nn.Module):
    """ReLU MLP (meliad): ``down(relu(up(x)))``."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        # In-place ReLU on the fresh up_proj output (its backward needs only the ReLU output).
        return self.down_proj(F.relu(self.up_proj(x), inplace=True))


# Parameter names of the layout before core v2 (one flat decoder layer) -> names now, per layer kind; used by the
# load hooks (``BSTDecoderLayer`` for ``load_state_dict``, ``legacy_key_mapping`` for ``from_pretrained``).
LEGACY_PARAMETER_NAMES = {
    "block": {
        "q_proj.": "self_attn.q_proj.",
        "k_proj.": "self_attn.k_proj.",
        "v_proj.": "self_attn.v_proj.",
        "self_scale": "self_attn.scale",
        "relative_bias.": "self_attn.relative_bias.",
        "up_proj.": "mlp.up_proj.",
        "down_proj.": "mlp.down_proj.",
    },
}
LEGACY_PARAMETER_NAMES["bst"] = {
    **LEGACY_PARAMETER_NAMES["block"],
    "q2_proj.": "cross_attn.q_proj.",
    "cross_scale": "cross_attn.scale",
    "context.": "cross_attn.context.",
}
LEGACY_PARAMETER_NAMES["recurrent"] = {
    **LEGACY_PARAMETER_NAMES["block"],
    "q2_proj.": "cross_attn.q_proj.",
    "cross_scale": "cross_attn.scale",
    "recurrent.": "cross_attn.recurrent.",
}


def legacy_name(kind: str, name: str) -> str:
    """The current name of parameter ``name`` (relative to a layer of ``kind``) written by the pre-core-v2 layout;
    ``name`` unchanged if it is not such a name."""
    for old, new in LEGACY_PARAMETER_NAMES.get(kind, {}).items():
        if name == old or (old.endswith(".") and name.startswith(old)):
            return new + name[len(old) :]
    return name


def legacy_key_mapping(config: BSTConfig) -> dict[str, str]:
    """``from_pretrained``'s ``key_mapping`` (regex -> replacement) that loads checkpoints of the pre-core-v2 layout.

    Per layer kind, because a bare name is ambiguous: ``layers.N.v_proj`` is a self-attention projection in an
    attention layer but the gate projection of a GSS layer."""
    mapping = {}
    for kind, names in LEGACY_PARAMETER_NAMES.items():
        indices = [str(i) for i in range(config.num_hidden_layers) if config.layer_kind(i) == kind]
        if not indices:
            continue
        layers = rf"layers\.({'|'.join(indices)})\."
        for old, new in names.items():
            if old.endswith("."):
                mapping[layers + re.escape(old)] = rf"layers.\1.{new}"
            else:
                mapping[layers + re.escape(old) + "$"] = rf"layers.\1.{new}"
    return mapping


class BSTDecoderLayer(GradientCheckpointingLayer):
    """One layer, Llama-shaped: norm -> block self-attention -> context (BST) or recurrent (BRecT) cross-attention ->
    concat -> one projection -> residual -> MLP (a "block" layer, Slide, has no cross-attention).

    Full-sequence form (training, prefill, aligned chunk continuation) and recurrent form (one token) share all
    parameters; each sub-module has both. ``forward`` dispatches once on ``hidden_states.shape[1] == 1`` with a
    filled cache.
    """

    cross_attention_classes = {"bst": BSTContextCrossAttention, "recurrent": BSTRecurrentCrossAttention}

    def __init__(self, config: BSTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.layer_kind(layer_idx)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        ring = 2 * config.block_len if self.kind == "recurrent" else config.block_len + 1
        self.input_norm = BSTRMSNorm(d, config.rms_norm_eps)
        self.self_attn = BSTBlockSelfAttention(config, ring)
        cross = self.cross_attention_classes.get(self.kind)
        self.cross_attn = cross(config) if cross is not None else None
        self.o_proj = nn.Linear((1 if cross is None else 2) * heads * hd, d, bias=False)
        self.post_attention_norm = BSTRMSNorm(d, config.rms_norm_eps)
        self.mlp = BSTMLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.register_load_state_dict_pre_hook(BSTDecoderLayer._rename_legacy_keys)

    @staticmethod
    def _rename_legacy_keys(module, state_dict, prefix, *args):
        """``load_state_dict`` of a state dict of the pre-core-v2 layout: rename this layer's keys in place."""
        for key in [k for k in state_dict if k.startswith(prefix)]:
            new = legacy_name(module.kind, key[len(prefix) :])
            if prefix + new != key:
                state_dict[prefix + new] = state_dict.pop(key)

    def forward(
        self,
        hidden_states: torch.Tensor,
        lengths: torch.Tensor | None = None,
        layer_cache: BSTLayerCache | None = None,
        positions: torch.Tensor | None = None,
        fill_cache: bool = False,
        num_positions: int | None = None,
        output_attentions: bool = False,
    ):
        """
        Args:
            hidden_states (`torch.Tensor` of shape `(B, T, D)`): rows aligned to start at their first real token; in
                the full-sequence form T is a multiple of W and rows are right-padded.
            lengths (`torch.LongTensor` of shape `(B,)`, *optional*): real tokens per row (None: all T are real).
            layer_cache ([`BSTLayerCache`], *optional*): read (continuation / decoding) and written (``fill_cache``).
            positions (`torch.LongTensor` of shape `(B,)`, *optional*): tokens already in ``layer_cache`` per row.
            fill_cache (`bool`): write this layer's state after the input into ``layer_cache``.
            num_positions (`int`, *optional*): how many leading positions the caller asked for (the rest pads the
                input to whole blocks); the attention weights cover these.
            output_attentions (`bool`): also return the attention weights (eager attention).

        Returns:
            ``hidden_states`` `(B, T, D)`; with ``output_attentions`` the tuple ``(hidden_states,
            self_attention_weights, cross_attention_weights)`` (cross: None for a block layer).
        """
        step = layer_cache is not None and positions is not None and hidden_states.shape[1] == 1
        xn = self.input_norm(hidden_states)
        raw = self.kind == "bst" and self.config.ssm_input == "raw"  # the SSM reads the un-normed layer input
        if step:
            # Recurrent form: one token per row at ``positions``; the cache advances in place.
            q, k, v = self.self_attn.project(xn)  # (B, 1, H, d)
            a_self, self_w, ring = self.self_attn.step(q, k, v, layer_cache, positions, output_attentions)
            if isinstance(self.cross_attn, BSTRecurrentCrossAttention):
                cross = self.cross_attn.step(xn, ring, layer_cache, positions, output_attentions)
            elif self.cross_attn is not None:
                ssm_x = hidden_states if raw else None
                cross = self.cross_attn.step(xn, layer_cache, positions, output_attentions, ssm_x=ssm_x)
        else:
            # Full-sequence form. A continued sequence (cache filled, rows block-aligned) sees the cached previous
            # block and the cached SSM / recurrent state.
            xn = self.dropout(xn)
            q, k, v = self.self_attn.project(xn)  # (B, T, H, d)
            a_self, self_w = self.self_attn(q, k, v, lengths, layer_cache, positions, num_positions, output_attentions)
            if isinstance(self.cross_attn, BSTRecurrentCrossAttention):
                continued = layer_cache is not None and positions is not None
                previous = self.self_attn.previous_block(layer_cache, positions) if continued else None
                cross = self.cross_attn(
                    xn, k, v, previous, lengths, layer_cache, positions, fill_cache, num_positions, output_attentions
                )
            elif self.cross_attn is not None:
                ssm_x = self.dropout(hidden_states) if raw else None
                cross = self.cross_attn(
                    xn, lengths, layer_cache, positions, fill_cache, num_positions, output_attentions, ssm_x=ssm_x
                )
            if fill_cache:
                self.self_attn.write_cache(layer_cache, k, v, lengths, positions)
        cross_w = None
        if self.cross_attn is not None:
            a_cross, cross_w = cross
            a_self = torch.cat([a_self, a_cross], -1)  # (B, T, 2 H d_h)
        attn = self.o_proj(a_self)
        h = hidden_states + (attn if step else self.dropout(attn))
        h = h + self.dropout(self.mlp(self.post_attention_norm(h)))
        return (h, self_w, cross_w) if output_attentions else h


class BSTGSSLayer(GradientCheckpointingLayer):
    """Gated State Space layer (GSS; Mehta et al., 2022), the SSM layer of the paper's GSS-Hybrid baseline.

    ``u = gelu(x_n W_u)`` (D -> D_s), ``v = gelu(x_n W_v)`` (D -> F), ``y = SSM(u)``,
    ``out = x + ((y W_y) * v) W_o`` with an S4D kernel over D_s channels. Same call contract as
    [`BSTDecoderLayer`]: full-sequence form, and a recurrent step that reads/writes ``layer_cache.ssm``.
    """

    def __init__(self, config: BSTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.kind = "gss"
        d, ds = config.hidden_size, config.hidden_size // 4
        width = config.gss_expansion * d
        self.input_norm = BSTRMSNorm(d, config.rms_norm_eps)
        self.u_proj = nn.Linear(d, ds, bias=False)
        self.v_proj = nn.Linear(d, width, bias=False)
        self.ssm = S4DKernel(ds, 1, config.ssm_state_size, config)
        self.y_proj = nn.Linear(ds, width, bias=False)
        self.o_proj = nn.Linear(width, d, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden_states,
        lengths=None,
        layer_cache=None,
        positions=None,
        fill_cache=False,
        num_positions=None,
        output_attentions=False,
    ):
        """Same contract as [`BSTDecoderLayer.forward`]; a GSS layer has no attention weights (``None``)."""
        xn = self.input_norm(hidden_states)
        u = F.gelu(self.u_proj(xn))  # (B, T, Ds)
        v = F.gelu(self.v_proj(xn))  # (B, T, F)
        if layer_cache is not None and positions is not None and hidden_states.shape[1] == 1:
            # Recurrent form
            constants = decode_memo(layer_cache, "ssm", (), self.ssm.parameters(), self.ssm.step_constants)
            y, state = self.ssm.step(u[:, 0], layer_cache.ssm.state, constants)  # y (B, 1, Ds)
            layer_cache.ssm.set(state)
        else:
            # Full sequence form
            state0 = None
            if layer_cache is not None and positions is not None:
                state0 = layer_cache.ssm.state
            if lengths is not None and self.config.bidirectional:
                u = u * (torch.arange(u.shape[1], device=u.device)[None] < lengths[:, None]).to(u.dtype)[..., None]
            y = self.ssm(u, state0)[:, :, 0]  # (B, T, Ds)
            if fill_cache:
                bsz, seq_len, _ = u.shape
                lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=u.device)
                idx = torch.arange(seq_len, device=u.device)[None] - (seq_len - lens[:, None])
                u_right = gather_rows(u, idx.clamp(min=0)) * (idx >= 0).to(u.dtype)[..., None]
                layer_cache.ssm.set(self.ssm.final_state(u_right.detach(), state0).detach())
        gated = self.y_proj(y.to(v.dtype)) * v
        h = hidden_states + self.dropout(self.o_proj(gated))
        return (h, None, None) if output_attentions else h


# The module of each layer kind (``BSTConfig.layer_kind``): one lookup per layer.
DECODER_LAYER_CLASSES = {
    "block": BSTDecoderLayer,
    "bst": BSTDecoderLayer,
    "recurrent": BSTDecoderLayer,
    "gss": BSTGSSLayer,
}


# from_pretrained arguments that locate a checkpoint's config (the rest are the model's).
_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "proxies",
)


# Standard deviation of a unit normal truncated at +-2 (meliad's variance_scaling correction).
TRUNCATED_NORMAL_STD = 0.87962566103423978


def fan_in_std(fan_in: int, config) -> float:
    """The std of the truncated normal that gives variance 1/fan_in (``init_truncation_correction``), else the
    uncorrected 1/sqrt(fan_in) (variance ~0.77/fan_in)."""
    std = 1.0 / math.sqrt(fan_in)
    return std / TRUNCATED_NORMAL_STD if config.init_truncation_correction else std


class BSTPreTrainedModel(PreTrainedModel):
    config: BSTConfig
    config_class = BSTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BSTDecoderLayer", "BSTGSSLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    # Full-sequence block / context / recurrent-state attention on FlexAttention (see [`use_flex`]).
    _supports_flex_attn = True
    # Not "stateful" for generate(): BSTCache.crop takes back drafted positions, so assisted decoding works.
    _is_stateful = False
    # SSM parameters (state matrix, dt, filters) stay float32 when the model is loaded in fp16 or bf16.
    _keep_in_fp32_modules_strict = ["ssm"]

    @torch.no_grad()
    def _init_weights(self, module):
        cfg = self.config
        if isinstance(module, nn.Linear):
            std = fan_in_std(module.in_features, cfg)
            init.trunc_normal_(module.weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if (
                module.num_embeddings == cfg.relative_attention_num_buckets
                and module.embedding_dim == cfg.num_attention_heads
            ):
                init.normal_(module.weight, 0.0, 0.1)
            else:
                init.normal_(module.weight, 0.0, cfg.initializer_range)
        elif isinstance(module, BSTRMSNorm):
            init.ones_(module.weight)
        if isinstance(module, (BSTBlockSelfAttention, BSTCrossAttention)):
            init.constant_(module.scale, cfg.resolved_attn_scale_init)
        elif isinstance(module, S4DKernel):
            module.reset_parameters()
        elif isinstance(module, UnstructFilter):
            module.reset_positional_features()
            init.constant_(module.sin.freq, module.sin.init_freq)
            init.normal_(module.bias, 0.0, 1.0)
        elif isinstance(module, BSTContextStates):
            if isinstance(module.up_proj, nn.Parameter):
                std = fan_in_std(module.up_proj.shape[1], cfg)
                init.trunc_normal_(module.up_proj, mean=0.0, std=std, a=-2 * std, b=2 * std)
            if isinstance(module.k_proj, nn.Parameter):
                std = fan_in_std(module.k_proj.shape[1], cfg)
                init.trunc_normal_(module.k_proj, mean=0.0, std=std, a=-2 * std, b=2 * std)
                init.trunc_normal_(module.v_proj, mean=0.0, std=std, a=-2 * std, b=2 * std)
            if module.mode == "mf":
                init.normal_(module.context_ids, 0.0, 1.0)
                init.normal_(module.initial_context, 0.0, 1.0)
        elif isinstance(module, BSTRecurrentState):
            init.normal_(module.initial_state, 0.0, 0.1)
            init.normal_(module.state_pos, 0.0, 1.0)
            init.normal_(module.gate_bias, 0.0, 0.1)
            init.constant_(module.self_scale, cfg.resolved_attn_scale_init)
            init.constant_(module.cross_scale, cfg.resolved_attn_scale_init)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """[`PreTrainedModel.from_pretrained`]; checkpoints of the layout before core v2 (issue #12: one flat
        decoder layer) load through a ``key_mapping`` built from their config's layer types ([`legacy_key_mapping`]),
        unless the caller passes one."""
        if kwargs.get("key_mapping") is None and pretrained_model_name_or_path is not None:
            config = kwargs.get("config")
            if not isinstance(config, PreTrainedConfig):
                hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
                config = BSTConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
            kwargs["key_mapping"] = legacy_key_mapping(config)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(self, save_directory, *args, save_original_format: bool = False, **kwargs):
        """[`PreTrainedModel.save_pretrained`], writing the current parameter names: a model loaded from an old
        checkpoint is saved in the new layout (transformers' default, ``save_original_format=True``, would write the
        names the checkpoint was loaded from)."""
        return super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)

    def resize_token_embeddings(self, *args, **kwargs):
        """As transformers' (which sets ``config.vocab_size``), keeping ``config.logit_scale``: a trained model's
        logits keep their scale when tokens are added."""
        scale = self.config.logit_scale
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.config.logit_scale = scale
        return embeddings

    def ssm_parameter_names(self) -> list[str]:
        """Parameters that train with their own learning rate (``config.ssm_lr``) and no weight decay (S4 practice;
        docs/paper-mapping.md, "Optimiser"), in ``named_parameters`` order. Per SSM kernel (every ``S4DKernel`` and
        ``UnstructFilter``: BST context states, GSS layers, classification S4 layers):

        * S4D: the state matrix Lambda (``A_log_real``, ``A_imag``), ``B`` and ``log_dt`` (S4's ``_optim`` set);
        * unstruct: the whole implicit filter, as safari's Hyena filter: ``pos_emb`` (the trainable positional
          features), ``sin.freq``, ``mlp.{i}.weight`` and ``mlp.{i}.bias``, ``out.weight`` (the decay envelope is
          fixed, not a parameter).

        The read-outs train with the other parameters: S4D's ``C``, ``C_backward`` and ``D``, and unstruct's D-term
        ``bias`` (like Hyena's). No parameter outside an SSM kernel is an SSM parameter."""
        ssm = set()
        for prefix, module in self.named_modules():
            if isinstance(module, S4DKernel):
                ssm.update(f"{prefix}.{n}" for n in ("A_log_real", "A_imag", "B", "log_dt"))
            elif isinstance(module, UnstructFilter):
                ssm.update(f"{prefix}.{n}" for n, _ in module.named_parameters() if n != "bias")
        return [name for name, _ in self.named_parameters() if name in ssm]


class _Layout:
    """Maps a padded batch in the caller's columns onto rows that start at their first real token and are padded
    on the right to a multiple of W (the layout of the full-sequence form), and back.

    ``attention_mask`` may mark real tokens anywhere (left, right or holes in the middle): each row's real tokens
    are packed in order, so a row equals the sequence of its real tokens alone.
    """

    def __init__(self, attention_mask, shape, block_len: int, device, check: bool):
        bsz, seq_len = shape
        self.seq_len = seq_len
        self.padded_len = -(-seq_len // block_len) * block_len
        self.mask = None
        if attention_mask is None:
            self.lengths = torch.full((bsz,), seq_len, dtype=torch.long, device=device)
        else:
            mask = attention_mask[:, -seq_len:].bool()
            if check and not bool(mask.any(-1).all()):
                raise ValueError("attention_mask has a row without any real token.")
            self.mask = mask
            self.lengths = mask.sum(-1)
            # Real tokens first, in order: aligned index j of row b holds column order[b, j].
            self.order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)
            # Aligned index of every column (valid where mask).
            self.column_index = (mask.long().cumsum(-1) - 1).clamp(min=0)
            self.real = torch.arange(seq_len, device=device)[None] < self.lengths[:, None]  # (B, T) aligned
        # Layers need per-row lengths only when some positions are not real tokens.
        self.layer_lengths = self.lengths if (self.mask is not None or self.padded_len != seq_len) else None

    def to_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """Caller's layout `(B, T, D)` -> aligned, right-padded `(B, T_pad, D)`; padding positions are zero."""
        if self.mask is not None:
            hidden = gather_rows(hidden, self.order) * self.real[..., None].to(hidden.dtype)
        return F.pad(hidden, (0, 0, 0, self.padded_len - self.seq_len))

    def from_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """Inverse of [`to_blocks`]: `(B, T_pad, D)` -> `(B, T, D)`; padding positions get zero hidden states."""
        hidden = hidden[:, : self.seq_len]
        if self.mask is not None:
            hidden = gather_rows(hidden, self.column_index) * self.mask[..., None].to(hidden.dtype)
        return hidden


def _step_weights_by_column(weights: torch.Tensor, kpos: torch.Tensor, positions: torch.Tensor, newest: int):
    """Decode-step self-attention weights over the ring `(B, H, 1, R)` laid out by key column `(B, H, 1, newest+1)`:
    the key at position ``kpos`` sits ``positions - kpos`` columns before the newest one (exact for left padding)."""
    column = kpos - positions[:, None] + newest  # (B, R)
    valid = (kpos >= 0) & (column >= 0)
    out = weights.new_zeros(weights.shape[:-1] + (newest + 1,))
    index = column.clamp(min=0)[:, None, None, :].expand_as(weights)
    return out.scatter_add(-1, index, weights * valid[:, None, None, :].to(weights.dtype))


class BSTModel(BSTPreTrainedModel):
    """The BST decoder stack: ``embed_tokens`` -> ``layers`` -> ``norm`` (no absolute positions).

    One output contract for its three forms (full sequence; block-aligned chunk continuing a cache; recurrent steps):
    ``last_hidden_state`` `(B, T, D)` in the caller's columns (zero at padding); ``hidden_states`` (when asked):
    ``num_hidden_layers + 1`` tensors `(B, T, D)`: the embeddings, each later layer's input and the normed output,
    each the very tensor the next computation reads (gradients reach them); ``attentions`` (eager
    attention only): per layer the self-attention weights, `(B, H, T, K)` over K key positions (full-sequence form:
    K = T, or W + T continuing a cache; recurrent steps: K = processed positions + 1, by column); ``cross_attentions``:
    per BST/BRecT layer the cross-attention weights `(B, H, T, S_c)` over the context states of the query's block
    (SH/MH: S_c = W, state j = the block's j-th token; MF: the S filters; BRecT: the recurrent states). Padded inputs
    report weights in the packed (aligned) order of real tokens. GSS layers report ``None``.
    """

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DECODER_LAYER_CLASSES[config.layer_kind(i)](config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = BSTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, cache):
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if input_ids is not None:
            if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
                raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}.")
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must have shape (batch, sequence), got {tuple(input_ids.shape)}.")
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        if shape[1] == 0 or shape[0] == 0:
            raise ValueError(f"Empty input: got a batch of shape {tuple(shape)}; need at least one token per row.")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(shape):
            if not (cache is not None and attention_mask.shape[0] == shape[0]):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but the input has shape {tuple(shape)}."
                )
        if cache is not None:
            if not cache.is_empty and cache.positions.shape[0] != shape[0]:
                raise ValueError(
                    f"The cache (`cache`/`past_key_values`) holds {cache.positions.shape[0]} rows but the input has {shape[0]}."
                )
        decode_step = cache is not None and not cache.is_empty and shape[1] == 1
        if input_ids is not None and self._validate_ids(input_ids, decode_step):
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"input_ids contains token id {bad} outside [0, vocab_size={cfg.vocab_size}).")
        return shape

    def _validate_ids(self, input_ids, decode_step: bool) -> bool:
        """Token ids are range-checked in eager mode: always on CPU (no device sync), on accelerators only where one
        sync is cheap (an evaluation or prefill forward), never in training steps or decode steps (hot paths)."""
        if tracing():
            return False
        return input_ids.device.type == "cpu" or not (self.training or decode_step)

    def _check_unstruct_length(self, seq_len, cache, continuing):
        cfg = self.config
        if cfg.ssm_kind != "unstruct" or not cfg.bst_layer_indices or cfg.unstruct_finite_filter:
            return
        done = 0
        if continuing and not tracing():
            # Unstruct decoding reads the longest document length anyway (its O(t) step). A traced step cannot check a
            # position (its graph serves every position): only the eager calls check.
            done = int((cache.positions - cache.doc_start).max())
        if seq_len + done > cfg.max_position_embeddings:
            raise ValueError(
                f"unstruct BST models handle at most max_position_embeddings={cfg.max_position_embeddings} "
                f"tokens (the filter length); got {seq_len + done}. Use ssm_kind='s4' for longer sequences."
            )

    @staticmethod
    def _call_layer(layer, hidden, output_attentions, **kwargs):
        """``(hidden, self_weights, cross_weights)`` of one layer call (weights None unless asked)."""
        if output_attentions:
            return layer(hidden, output_attentions=True, **kwargs)
        return layer(hidden, **kwargs), None, None

    def _recorded_prefill(
        self, input_ids, attention_mask, cache, inputs_embeds, output_hidden_states, output_attentions
    ):
        """A prefill into a recording cache: the full-sequence form up to the last ``MAX_ROLLBACK`` positions, then
        recorded steps over those, so that ``cache.crop`` can take any of them back (assisted decoding drafts at the
        end of the first input). Outputs as one forward over the whole input."""
        seq_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        split = seq_len - min(seq_len - 1, MAX_ROLLBACK)
        parts = []
        for cols, record in ((slice(None, split), False), (slice(split, None), True)):
            cache.record_past = record
            parts.append(
                self(
                    input_ids=input_ids[:, cols] if input_ids is not None else None,
                    inputs_embeds=inputs_embeds[:, cols] if inputs_embeds is not None else None,
                    attention_mask=attention_mask if attention_mask is None or record else attention_mask[:, cols],
                    cache=cache,
                    use_cache=True,
                    output_hidden_states=output_hidden_states,
                    output_attentions=output_attentions,
                )
            )
        first, second = parts

        def join(a, b, pad_keys=False):
            if a is None or b is None:
                return None
            if pad_keys:  # attention weights: (B, H, T, K), the second part sees more keys
                return torch.cat([F.pad(a, (0, b.shape[-1] - a.shape[-1])), b], -2)
            return torch.cat([a, b], -2 if a.dim() == 4 else 1)

        def join_all(a, b, pad_keys=False):
            return None if a is None else tuple(join(x, y, pad_keys) for x, y in zip(a, b))

        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=join(first.last_hidden_state, second.last_hidden_state),
            **{CACHE_NAME: cache},
            hidden_states=join_all(first.hidden_states, second.hidden_states),
            attentions=join_all(first.attentions, second.attentions, True),
            cross_attentions=join_all(first.cross_attentions, second.cross_attentions),
        )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: BSTCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        past_key_values: BSTCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """``cache``: a [`BSTCache`] to continue (``past_key_values`` is its name before transformers 5.24; either
        works). The output holds the cache under the installed transformers' name (``cache`` from 5.24 on)."""
        cache = given = resolve_cache_argument(cache, past_key_values)
        cfg = self.config
        use_cache = use_cache if use_cache is not None else (cfg.use_cache and not self.training)
        if cfg.bidirectional:
            use_cache = False
            cache = given = None
        if cache is not None:
            cache = BSTCache.of(cache, cfg)  # a DynamicCache of BST layers (made by generate) reads as a BSTCache
        output_hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        output_attentions = output_attentions if output_attentions is not None else cfg.output_attentions
        if output_attentions and cfg._attn_implementation != "eager":
            logger.warning_once(
                f"BST: output_attentions=True needs the eager attention; attn_implementation="
                f"{cfg._attn_implementation!r} returns no attention weights. Load the model with "
                "attn_implementation='eager' to get them."
            )
            output_attentions = False
        bsz, seq_len = self._check_inputs(input_ids, inputs_embeds, attention_mask, cache)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and cache is None:
            cache = BSTCache(cfg, bsz)
        continuing = cache is not None and not cache.is_empty
        if cache is not None and cache.record_past and not continuing and seq_len > 1:
            return self._recorded_prefill(
                input_ids, attention_mask, cache, inputs_embeds, output_hidden_states, output_attentions
            )
        self._check_unstruct_length(seq_len, cache, continuing)
        all_hidden = [] if output_hidden_states else None
        all_attn = [] if output_attentions else None
        all_cross = [] if output_attentions else None

        if not continuing:
            # Full-sequence form: rows packed to start at position 0, right-padded to whole blocks.
            layout = _Layout(attention_mask, (bsz, seq_len), cfg.block_len, hidden.device, host_can_branch(hidden))
            if all_hidden is not None:
                all_hidden.append(hidden)
            hidden = self.dropout(layout.to_blocks(hidden))
            for layer_idx, layer in enumerate(self.layers):
                if all_hidden is not None and layer_idx > 0:
                    # The recorded tensor is the one the next layer reads (gradients reach it).
                    hidden = layout.from_blocks(hidden)
                    all_hidden.append(hidden)
                    hidden = layout.to_blocks(hidden)
                hidden, attn, cross = self._call_layer(
                    layer,
                    hidden,
                    output_attentions,
                    lengths=layout.layer_lengths,
                    layer_cache=cache.layers[layer_idx] if cache is not None else None,
                    fill_cache=cache is not None,
                    num_positions=seq_len,
                )
                if all_attn is not None:
                    all_attn.append(attn)
                    all_cross.append(cross)
            hidden = layout.from_blocks(self.norm(hidden))
            if cache is not None:
                common = seq_len
                if layout.mask is not None:
                    lengths = layout.lengths
                    same = host_can_branch(lengths) and bool((lengths == lengths[0]).all())
                    common = int(lengths[0]) if same else None
                cache.start(layout.lengths, seq_len, common)
        else:
            positions = cache.positions
            if seq_len > 1 and attention_mask is not None and host_can_branch(attention_mask):
                if not bool(attention_mask[:, -seq_len:].all()):
                    raise ValueError(
                        "Padding inside a continued sequence cannot be honoured by the recurrent cache: pad the "
                        "first chunk only."
                    )
            w = cfg.block_len
            # A recording cache steps every position (each step records what it overwrites, for BSTCache.crop). A
            # decode step (seq_len 1) reads no host mirror of a position: one traced step serves every position.
            aligned = (
                seq_len > 1
                and seq_len % w == 0
                and not cache.record_past
                and cache.common_position is not None
                and cache.common_position % w == 0
                and cache.docs_on_grid
            )
            undo = [[{} for _ in self.layers] for _ in range(seq_len)] if cache.record_past and not aligned else None
            for layer_idx, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers)):
                if all_hidden is not None:
                    all_hidden.append(hidden)
                if aligned:
                    # A block-aligned chunk: full-sequence form seeded with the cached state.
                    hidden, attn, cross = self._call_layer(
                        layer,
                        hidden,
                        output_attentions,
                        layer_cache=layer_cache,
                        positions=positions,
                        fill_cache=True,
                        num_positions=seq_len,
                    )
                else:
                    # Recurrent form, one token at a time (layer by layer: each layer reads its whole input).
                    outs, attns, crosses = [], [], []
                    for t in range(seq_len):
                        if undo is not None:
                            undo[t][layer_idx] = layer_cache.capture(positions + t)
                        h_t, attn, cross = self._call_layer(
                            layer,
                            hidden[:, t : t + 1],
                            output_attentions,
                            layer_cache=layer_cache,
                            positions=positions + t,
                        )
                        outs.append(h_t)
                        if output_attentions and attn is not None:
                            attn = _step_weights_by_column(
                                attn, layer_cache.attention.pos, positions + t, cache.seen_tokens + t
                            )
                            attns.append(F.pad(attn, (0, seq_len - 1 - t)))
                            crosses.append(cross)
                    hidden = outs[0] if seq_len == 1 else torch.cat(outs, 1)
                    attn = (attns[0] if seq_len == 1 else torch.cat(attns, 2)) if attns else None
                    cross = None
                    if crosses and crosses[0] is not None:
                        cross = crosses[0] if seq_len == 1 else torch.cat(crosses, 2)
                if all_attn is not None:
                    all_attn.append(attn)
                    all_cross.append(cross)
            hidden = self.norm(hidden)
            if undo is not None:
                cache.push_undo(undo)
            cache.advance(seq_len)
        if all_hidden is not None:
            all_hidden.append(hidden)
        if cache is not None and self.training:
            cache.detach()
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden,
            **{CACHE_NAME: cache if use_cache or given is not None else None},
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_attn) if all_attn is not None else None,
            cross_attentions=tuple(all_cross) if all_cross is not None else None,
        )


class BSTForCausalLM(BSTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def create_masks_for_generate(self, attention_mask=None, is_first_iteration=True, **kwargs):
        """``generate`` asks for 4-D attention masks when its cache is compileable (a static BST cache). BST builds
        its block masks itself from the 2-D padding mask, which only the first forward needs: a decoded token is
        always real, so decode steps get no mask (one compiled step then serves every position)."""
        return attention_mask if is_first_iteration else None

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.model = BSTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # meliad's final dropout before the logits (``final_dropout``, default ``dropout``).
        self.final_dropout = nn.Dropout(config.resolved_final_dropout)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: BSTCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: BSTCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithCrossAttentions:
        """Causal LM forward. ``labels`` `(B, T)` are the input ids (shifted inside; -100 is ignored). ``cache`` as
        in [`BSTModel.forward`] (``past_key_values`` is its name before transformers 5.24)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = self.final_dropout(hidden[:, slice_indices, :])
        scale = self.config.resolved_logit_scale
        if getattr(self.lm_head, "bias", None) is None:
            # meliad scales the logits; scaling the (T, D) input of a bias-free head is the same product and V / D
            # times less work than scaling the (T, V) logits (5% of a training step at V = 32k, D = 512).
            logits = self.lm_head(hidden * scale)
        else:
            logits = self.lm_head(hidden) * scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
        )


class BSTS4Layer(nn.Module):
    """A plain S4 layer (S4 repository block): RMS norm -> S4D over the full width -> GELU -> linear -> residual.

    Used on top of the BST stack in the LRA classifier; bidirectional when ``config.bidirectional``.
    """

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.norm = BSTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ssm = S4DKernel(config.hidden_size, 1, config.ssm_state_size, config)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states, valid: torch.Tensor | None = None):
        """``hidden_states`` `(B, T, D)`, ``valid`` `(B, T)` bool (padding excluded from the convolution)."""
        x = self.norm(hidden_states)
        if valid is not None:
            x = x * valid[..., None].to(x.dtype)
        y = self.ssm(x)[:, :, 0].to(hidden_states.dtype)  # (B, T, D)
        return hidden_states + self.dropout(self.out_proj(F.gelu(y)))


class BSTForSequenceClassification(BSTPreTrainedModel):
    """BST encoder (+ ``num_s4_head_layers`` S4 layers) + mean pooling over non-padding tokens + a linear classifier.

    The paper's LRA model is ``bidirectional=True`` with BST layers only, plus two S4 layers on top.
    """

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = BSTModel(config)
        self.s4_layers = nn.ModuleList([BSTS4Layer(config) for _ in range(config.num_s4_head_layers)])
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden = outputs.last_hidden_state  # (B, T, D); padded positions are zero
        valid = attention_mask.bool() if attention_mask is not None else None
        for layer in self.s4_layers:
            hidden = layer(hidden, valid)
        if attention_mask is None:
            pooled = hidden.mean(1)
        else:
            m = attention_mask.to(hidden.dtype)[..., None]
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "BSTPreTrainedModel",
    "BSTModel",
    "BSTForCausalLM",
    "BSTForSequenceClassification",
    "BSTS4Layer",
    "BSTCache",
]
