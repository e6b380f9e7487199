"""PyTorch Block-State Transformer (Fathi, Pilault et al., 2023): attentions, layers, models (docs/architecture.md)."""

import math
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import capture_outputs

from .attention_bst import BSTRMSNorm
from .cache_bst import ATTENTION_RING, BSTCache, BSTLayerCache, own_layers
from .configuration_bst import BSTConfig
from .context_bst import CONTEXT_BUILDERS, SSM_KERNELS, BSTContextStates, fill_ssm_state
from .functional_bst import (
    additive_mask,
    gated_state_update,
    l2_normalize,
    masked_fill_value,
    t5_relative_bucket,
    window_valid,
)
from .layout_bst import StepPlan, _Chunk, _Documents
from .ssm_bst import ChunkTables, S4DKernel, UnstructFilter
from .utils_bst import constant_memo, host_can_branch, maybe_any, on_accelerator, step_memo, tracing


logger = logging.get_logger(__name__)

# The cache's name in the installed transformers' outputs: ``cache`` from 5.24 on, ``past_key_values`` in 5.23 (whose
# generate passes that name: accepted without a warning, ``cache_argument``).
CACHE_NAME = (
    "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPastAndCrossAttentions)} else "past_key_values"
)
cache_argument = deprecate_kwarg("past_key_values", "5.23", new_name="cache", raise_if_both_names=True)


def eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0, absent=None, **kwargs):
    """Unscaled attention written out (SDPA's math path: half precision in float32, no copy beyond one per input),
    ``query`` `(N, H, Lq, d)`, ``key``/``value`` `(N, H, Lk, d)` -> `(N, Lq, H, d)` and the weights."""
    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        q, k, v = (_contiguous_as(x, compute) for x in (query, key, value))  # the layout the matmuls read
        scores = torch.matmul(q, k.transpose(-1, -2))
        if attention_mask is not None:
            scores.add_(attention_mask.to(compute))
        if absent is not None:
            scores.masked_fill_(absent, masked_fill_value(compute))
        weights = torch.softmax(scores, dim=-1)
        if dropout > 0:
            weights = F.dropout(weights, p=dropout)
        return _contiguous_as(torch.matmul(weights, v).transpose(1, 2), dtype), weights


def attention(module, q, k, v, mask, dropout, absent=None):
    """Unscaled attention on the model's interface, `(N, H, L, d)` -> `(N, Lq, H, d)` and the weights (eager: in the
    compute dtype; else None)."""
    implementation = module.config._attn_implementation
    if implementation == "eager" or (mask is not None and learned_mask_path(module, mask)):
        return eager_attention_forward(module, q, k, v, mask, dropout, absent)
    if absent is not None:
        mask = mask.masked_fill(absent, masked_fill_value(mask.dtype))
    if torch.compiler.is_compiling():  # inductor may hand CPU flash attention a strided key: wrong values
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    return interface(module, q, k, v, mask, dropout=dropout, scaling=1.0, is_causal=False)


def _input_shape(input_ids, inputs_embeds) -> tuple[int, int]:
    """`(B, T)` of the model's input (`(0, 0)` without one: the model itself raises for that)."""
    x = input_ids if input_ids is not None else inputs_embeds
    return tuple(x.shape[:2]) if x is not None else (0, 0)


def query_chunk(config: BSTConfig, q: torch.Tensor) -> int:
    """Queries per window of the full-sequence attentions (``attention_query_chunk``; W on an accelerator)."""
    if config.attention_query_chunk is not None:
        return config.attention_query_chunk
    return config.block_len if on_accelerator(q) else config.resolved_attention_query_chunk


def plain_linears(*modules) -> bool:
    """Whether ``modules`` are plain bias-free ``nn.Linear`` (no hooks, one dtype and device): weights may be stacked."""
    return all(
        type(m) is nn.Linear and type(m.weight) is nn.Parameter and m.bias is None
        and not (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__)
        and (m.weight.dtype, m.weight.device) == (modules[0].weight.dtype, modules[0].weight.device)
        for m in modules
    )  # fmt: skip


def learned_mask_path(module, mask) -> bool:
    """Whether [`attention`] on SDPA writes it out ([`eager_attention_forward`]): CPU, a mask that needs a gradient."""
    return (
        module.config._attn_implementation == "sdpa"
        and mask.requires_grad
        and torch.is_grad_enabled()
        and not on_accelerator(mask)
        and not torch.compiler.is_compiling()
    )


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous, in one copy at most (a cast alone keeps ``x``'s strides)."""
    return x.to(dtype, memory_format=torch.contiguous_format) if x.dtype != dtype else x.contiguous()


def _split_heads(config, x):
    return x.unflatten(-1, (config.num_attention_heads, config.head_dim))


class BSTRecurrentState(nn.Module):
    """BRecT:fixed:skip recurrent cell: ``z = [attn(Qr, Kr, Vr) ; attn(Q2r, K, V)] Wo_r``, ``s' = g s + (1 - g) z``."""

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

    def keys_values(self, state: torch.Tensor):
        """Keys/values the tokens read from the state: `(B, S, D)` -> 2 x `(B, S, H, d_h)`."""
        sn = self.norm(state) + self.state_pos.to(state.dtype)
        k = _split_heads(self.config, self.k_proj(sn))
        return l2_normalize(k) if self.config.qk_norm else k, _split_heads(self.config, self.v_proj(sn))

    def store(self, layer_cache, rows, state):
        """Writes ``state`` and the keys/values read from it into ``layer_cache`` (in ``rows``; None: all)."""
        rec_k, rec_v = self.keys_values(state)
        layer_cache.set(rows, rec_state=state, rec_k=rec_k, rec_v=rec_v)

    def update(self, state, token_k, token_v, token_valid, state_kv=None):
        """Next state from the token keys/values `(B, 2W, H, d_h)` and their validity `(B, 2W)`."""
        cfg = self.config
        sn = self.norm(state) + self.state_pos.to(state.dtype)
        q, q2 = _split_heads(cfg, self.q_proj(sn)), _split_heads(cfg, self.q2_proj(sn))
        k, v = state_kv if state_kv is not None else self.keys_values(state)
        if cfg.qk_norm:
            q, q2 = l2_normalize(q), l2_normalize(q2)
        q = q * self.self_scale.to(q.dtype)[:, None]
        q2 = q2 * self.cross_scale.to(q2.dtype)[:, None]
        r_self = attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0.0)[0]
        mask = additive_mask(token_valid, q2.dtype)[:, None, None, :]
        r_cross = attention(self, q2.transpose(1, 2), token_k.transpose(1, 2), token_v.transpose(1, 2), mask, 0.0)[0]
        r_cross = r_cross * token_valid.any(-1).to(r_cross.dtype)[:, None, None, None]
        z = self.o_proj(torch.cat([r_self.flatten(-2), r_cross.flatten(-2)], -1))
        return gated_state_update(state, z, self.gate_bias)

    def forward(self, k, v, previous, layer_cache, chunk: _Chunk):
        """The state keys/values `(B, nb, S, H, d_h)` each block reads, from the tokens' `(B, T, H, d_h)`, in a loop."""
        (bsz, seq_len), w = k.shape[:2], self.config.block_len
        if previous is not None:
            fresh = (chunk.positions == chunk.doc_start)[:, None, None]
            state = torch.where(fresh, self.initial_state.to(k.dtype), layer_cache.rec_state.to(k.dtype))
        else:  # a fresh sequence: an empty block before the first
            state = self.initial_state.to(k.dtype).expand(bsz, -1, -1)
            zeros = k.new_zeros(bsz, w, *k.shape[2:])
            previous = (zeros, zeros, torch.zeros(bsz, w, dtype=torch.bool, device=k.device))
        # block b's update reads the tokens b W - W .. b W + W - 1 of these
        keys, values = torch.cat([previous[0], k], 1), torch.cat([previous[1], v], 1)
        valid = F.pad(previous[2], (0, seq_len), value=True)
        states, read = [state], []
        for start in range(0, seq_len, w):
            read.append(self.keys_values(states[-1]))  # read by the block's tokens and by the update
            two = slice(start, start + 2 * w)
            states.append(self.update(states[-1], keys[:, two], values[:, two], valid[:, two], read[-1]))
        if chunk.fill_cache:  # the state after each row's real tokens
            with torch.no_grad():
                last = torch.stack(states, 1)[torch.arange(bsz, device=k.device), chunk.row_lengths // w]
                self.store(layer_cache, None, last)
        return tuple(torch.stack(x, 1) for x in zip(*read))


class BSTBlockSelfAttention(nn.Module):
    """Block self-attention (paper Sec. 3.1) over the W previous tokens, T5 bias, L2-normalised q/k, per-head scale."""

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

    def project(self, xn):
        """Scaled queries, keys, values `(B, T, H, d_h)` of ``xn`` `(B, T, D)` (plain projections: one matmul)."""
        heads, hd = self.config.num_attention_heads, self.config.head_dim
        if plain_linears(self.q_proj, self.k_proj, self.v_proj):
            weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            qk, v = F.linear(xn, weight).unflatten(-1, (3 * heads, hd)).split([2 * heads, heads], -2)
            q, k = (l2_normalize(qk) if self.config.qk_norm else qk).chunk(2, -2)
        else:
            q, k, v = (_split_heads(self.config, proj(xn)) for proj in (self.q_proj, self.k_proj, self.v_proj))
            if self.config.qk_norm:
                q, k = l2_normalize(q), l2_normalize(k)
        return q * self.scale.to(q.dtype)[:, None], k, v

    def buckets(self, relative_position):
        cfg = self.config
        num_buckets, max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        return t5_relative_bucket(relative_position, cfg.bidirectional, num_buckets, max_distance)

    def bias(self, relative_position):
        """T5 bias for relative positions `(...)` -> `(..., H)`."""
        return self.relative_bias(self.buckets(relative_position))

    def forward(self, q, k, v, previous=None, lengths=None, weights: int = 0):
        """`(B, T, H, d_h)` each (``previous``: the cached block's keys, values, held) -> `(B, T, H * d_h)`, and with
        ``weights`` = n the first n queries' `(B, H, n, K)` by key column (K = n, or W + n after a cached block)."""
        bsz, seq_len, heads, hd = q.shape
        drop = self.config.attention_dropout if self.training else 0.0
        out, probs = self.windowed(q, k, v, previous, lengths, drop, weights)
        return out.reshape(bsz, seq_len, heads * hd), probs

    def window_bias(self, chunk: int, span: int, dtype, device) -> torch.Tensor:
        """Additive mask `(H, c, K)` of c queries over ``span`` keys from -W on (docs/architecture.md)."""
        w = self.block_len

        def build():  # parameter-free: the bucket of every distance a window spans, which are outside the window
            distances = torch.arange(-w - chunk + 1, span - w, device=device)
            outside = ~window_valid(distances, w, self.config.attend_self)[:, None]
            return self.buckets(distances), None if self.config.bidirectional else outside

        buckets, outside = constant_memo(self, ("window", chunk, span, str(device)), build)
        per_distance = (self.relative_bias(buckets) * self.scale).to(dtype)  # (n, H)
        if outside is not None:
            per_distance = per_distance.masked_fill(outside, masked_fill_value(dtype))
        per_distance = per_distance.t()  # (H, n), n = K + c - 1
        if chunk == 1:
            return per_distance.unsqueeze(1)
        n = per_distance.shape[1]
        tiled = torch.roll(per_distance, -(chunk - 1), dims=1).repeat(1, chunk)  # (H, c n)
        return tiled[:, : chunk * (n - 1)].view(-1, chunk, n - 1)[:, :, :span]

    def keys_absent(self, previous, lengths, bsz: int, seq_len: int, chunk: int, span: int, device):
        """Which of each window's keys are not held, `(B * T / c, 1, 1, K)` (before the sequence, or padding)."""
        if previous is not None:
            return F.pad(~previous[2], (0, seq_len)).unfold(1, span, chunk).reshape(-1, 1, 1, span)

        def outside(length):  # keys before the sequence or at/after ``length``, per window: (..., T / c, K)
            pos = torch.arange(-self.block_len, seq_len + span - self.block_len - chunk, device=device)
            return ((pos < 0) | (pos >= length)).unfold(-1, span, chunk)

        if lengths is not None and self.config.bidirectional:
            return outside(lengths[:, None]).reshape(-1, 1, 1, span)
        absent = constant_memo(self, ("absent", seq_len, chunk, span, str(device)), lambda: outside(seq_len))
        return absent.expand(bsz, -1, -1).reshape(-1, 1, 1, span)

    def windowed(self, q, k, v, previous, lengths, dropout, weights: int = 0):
        """Queries in windows of c ([`query_chunk`]; with ``weights``, one window) over the keys each reaches, in one
        attention call -> `(B, T, H, d_h)` and the weights [`forward`] returns (or None)."""
        bsz, seq_len, heads, hd = q.shape
        w, bidirectional = self.block_len, self.config.bidirectional
        chunk = seq_len if weights else w if bidirectional else query_chunk(self.config, q)
        span = w + chunk + (w if bidirectional else 0)
        n = bsz * (seq_len // chunk)
        if previous is None:
            pad = (0, 0, 0, 0, w, span - w - chunk)
            kp, vp = F.pad(k, pad), F.pad(v, pad)  # (B, W + T (+ W), H, d)
        else:
            kp, vp = torch.cat([previous[0].to(k.dtype), k], 1), torch.cat([previous[1].to(v.dtype), v], 1)
        # window i holds the keys at padded positions i c .. i c + K - 1
        keys, values = (x.unfold(1, span, chunk).permute(0, 1, 2, 4, 3).reshape(n, heads, span, hd) for x in (kp, vp))
        queries = q.reshape(n, chunk, heads, hd).transpose(1, 2)  # (n, H, c, d)
        absent = self.keys_absent(previous, lengths, bsz, seq_len, chunk, span, q.device)
        if weights and bidirectional:  # one window: each query over its own and the adjacent blocks
            block = torch.arange(-w, seq_len + w, device=q.device) // w
            absent = absent | ((block[None] - block[w : w + seq_len, None]).abs() > 1)
        bias = self.window_bias(chunk, span, q.dtype, q.device)  # (H, c, K)
        if weights or bidirectional or on_accelerator(q) or learned_mask_path(self, bias):
            out, probs = attention(self, queries, keys, values, bias, dropout, absent=absent)
            if bidirectional:  # a query without any key gets zeros
                keep = (~absent).any(-1).transpose(1, 2)[..., None].to(out.dtype)  # (n, c, 1, 1)
                out, probs = out * keep, (probs.transpose(1, 2) * keep).transpose(1, 2) if weights else None
            if weights:  # the first n queries' output from the weights returned (zeros after)
                probs = self.first_query(probs.to(q.dtype).transpose(1, 2), previous).transpose(1, 2)
                # keys from the first token's (fresh) or from the cached block's (continued)
                keys_from = slice(w if previous is None else 0, w + weights)
                probs = probs[:, :, :weights, keys_from]
                out = torch.matmul(probs, values[:, :, keys_from]).transpose(1, 2)
                return F.pad(out, (0, 0, 0, 0, 0, seq_len - weights)), probs
            return self.first_query(out.view(bsz, seq_len, heads, hd), previous), None
        # CPU inference: every window under the shared 4-D bias (SDPA's fused kernel), then block 0's windows again
        # with their absent keys masked
        out = attention(self, queries, keys, values, bias[None], dropout)[0].view(bsz, seq_len, heads, hd)
        first, per_row = w // chunk, seq_len // chunk

        def block0(x):
            return x.view(bsz, per_row, *x.shape[1:])[:, :first].reshape(bsz * first, *x.shape[1:])

        head = attention(self, block0(queries), block0(keys), block0(values), bias, dropout, absent=block0(absent))[0]
        return self.first_query(torch.cat([head.reshape(bsz, w, heads, hd), out[:, w:]], 1), previous), None

    def first_query(self, out, previous):
        """Without ``attend_self`` the first query sees only the cached block: zeros where none of it is held."""
        if self.config.attend_self or self.config.bidirectional:
            return out
        if previous is None:
            return F.pad(out[:, 1:], (0, 0, 0, 0, 1, 0))
        keep = previous[2].any(-1).to(out.dtype)[:, None, None, None]
        return torch.cat([out[:, :1] * keep, out[:, 1:]], 1)

    def step(self, q, k, v, layer_cache: BSTLayerCache, plan: StepPlan):
        """One token per row over the ring -> `(B, 1, H d_h)`, weights, the ring ``(keys, values, positions)``."""
        bsz, _, heads, hd = q.shape
        p = plan.positions
        ring_k, ring_v, kpos = layer_cache.write_ring(
            ATTENTION_RING, plan.rows, plan.slot(self.ring), p, k[:, 0], v[:, 0]
        )

        def window():  # each ring key's column of the bias table (R: outside the window), rows with any key
            rel = kpos - p[:, None]
            valid = (kpos >= 0) & window_valid(rel, self.block_len, self.config.attend_self)
            return torch.where(valid, -rel, self.ring), valid.any(-1)[:, None, None, None]

        column, any_key = plan.get(("window", self.ring), window)
        bias = self.step_bias_table(plan.memo, q.dtype)[:, column].transpose(0, 1)[:, :, None, :]  # (B, H, 1, R)
        out, probs = attention(self, q.transpose(1, 2), ring_k.transpose(1, 2), ring_v.transpose(1, 2), bias, 0.0)
        probs = probs.to(q.dtype) * any_key if plan.weights else None
        return (out * any_key).reshape(bsz, 1, heads * hd), probs, (ring_k, ring_v, kpos)

    def step_bias_table(self, memo, dtype):
        """Scaled T5 bias per distance 0 .. R-1 and a masked column R, `(H, R + 1)`, memoised for a decoding run."""

        def compute():
            table = (
                self.bias(-torch.arange(self.ring, device=self.scale.device)).to(dtype) * self.scale.to(dtype)
            ).t()
            return F.pad(table, (0, 1), value=masked_fill_value(dtype)).contiguous()

        return step_memo(memo, (id(self), "bias"), (dtype,), (self.relative_bias.weight, self.scale), compute)


class BSTCrossAttention(nn.Module):
    """The second attention of a BST or BRecT layer: block b's queries over block b's context or recurrent states."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        self.block_len = config.block_len
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.scale = nn.Parameter(torch.empty(heads))

    def query(self, xn):
        """Scaled queries `(B, T, H, d_h)` of the normalised input ``xn`` `(B, T, D)`."""
        q = _split_heads(self.config, self.q_proj(xn))
        q = l2_normalize(q) if self.config.qk_norm else q
        return q * self.scale.to(q.dtype)[:, None]

    def forward(self, xn, keys, values, mask=None, zero_first=False, weights=False):
        """``xn`` `(B, T, D)` over `(B, nb, S, H, d_h)` states, ``mask`` `(W, S)` -> `(B, T, H d_h)`, weights."""
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w, heads, hd = self.block_len, cfg.num_attention_heads, cfg.head_dim
        nb, s = seq_len // w, keys.shape[2]
        drop = cfg.attention_dropout if self.training else 0.0
        q = self.query(xn)
        qb = q.view(bsz * nb, w, heads, hd).transpose(1, 2)
        kb, vb = (x.reshape(bsz * nb, s, heads, hd).transpose(1, 2) for x in (keys, values))
        chunk = w if weights or mask is None else query_chunk(cfg, q)
        if chunk == w:
            out, probs = attention(self, qb, kb, vb, mask, drop)
        else:  # triangular mask: a chunk's queries see the states up to the chunk's end
            parts = [
                attention(self, qb[:, :, i : i + chunk], kb[:, :, : i + chunk], vb[:, :, : i + chunk],
                          mask[i : i + chunk, : i + chunk], drop)[0]
                for i in range(0, w, chunk)
            ]  # fmt: skip
            out, probs = torch.cat(parts, 1), None
        if zero_first:  # each block's first query gets zeros
            out = F.pad(out[:, 1:], (0, 0, 0, 0, 1, 0))
            probs = F.pad(probs[:, :, 1:], (0, 0, 1, 0)) if weights else None
        if weights:  # (B nb, H, W, S) -> (B, H, T, S)
            probs = (
                probs.to(q.dtype)
                .view(bsz, nb, heads, w, s)
                .transpose(1, 2)
                .reshape(bsz, heads, seq_len, s)[:, :, :weights]
            )
        return out.reshape(bsz, seq_len, heads * hd), probs if weights else None

    def step(self, xn, keys, values, mask=None, any_valid=None, weights=False):
        """One token `(B, 1, D)` over `(B, S, H, d_h)` states -> `(B, 1, H d_h)` (zeros without ``any_valid``)."""
        q = self.query(xn).transpose(1, 2)  # (B, H, 1, d)
        out, probs = attention(self, q, keys.transpose(1, 2), values.transpose(1, 2), mask, 0.0)
        probs = probs.to(q.dtype) if weights else None
        if any_valid is not None:
            keep = any_valid.to(out.dtype)[:, None, None, None]
            out, probs = out * keep, probs * keep if weights else None
        return out.reshape(xn.shape[0], 1, -1), probs


class BSTMLP(nn.Module):
    """ReLU MLP (meliad): ``down(relu(up(x)))``."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x), inplace=True))  # in place: its backward needs only the output


class BSTLayer(GradientCheckpointingLayer):
    """The call every decoder layer shares, ``layer(hidden_states, layer_cache, chunk)`` (docs/architecture.md)."""

    def __init__(self, config: BSTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_kind(layer_idx)
        self.input_norm = BSTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states: torch.Tensor, layer_cache: BSTLayerCache | None = None, chunk=None):
        if chunk is None:  # one fresh sequence of whole blocks
            chunk = _Chunk(None, None, hidden_states.shape[:2], self.config, hidden_states.device, False)
        out = chunk.run(self, layer_cache, hidden_states)
        return out if chunk.weights else out[0]


class BSTDecoderLayer(BSTLayer):
    """A block (Slide), BST or BRecT layer, by ``layer_type``: norm, self-attention, second attention, MLP."""

    def __init__(self, config: BSTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        # The decoding ring: the W-token window and the newest token; BRecT's state update reads two blocks.
        ring = 2 * config.block_len if self.layer_type == "recurrent" else config.block_len + 1
        self.self_attn = BSTBlockSelfAttention(config, ring)
        if self.layer_type == "bst":
            self.ssm = SSM_KERNELS[config.ssm_kind](config.ssm_channels, config.ssm_output_channels, config)
            self.context = CONTEXT_BUILDERS[config.context_mode](config)
        elif self.layer_type == "recurrent":
            self.recurrent = BSTRecurrentState(config)
        self.cross_attn = None if self.layer_type == "block" else BSTCrossAttention(config)
        self.o_proj = nn.Linear(heads * hd * (1 if self.cross_attn is None else 2), d, bias=False)
        self.post_attention_norm = BSTRMSNorm(d, config.rms_norm_eps)
        self.mlp = BSTMLP(config)

    def sequence(self, hidden_states, layer_cache, chunk: _Chunk):
        xn = self.dropout(self.input_norm(hidden_states))  # meliad's dropout on the norm
        q, k, v = self.self_attn.project(xn)  # (B, T, H, d_h)
        positions, weights = chunk.positions, chunk.head if chunk.weights else 0
        previous = None if positions is None else layer_cache.window(positions, self.config.block_len)
        a_self, self_w = self.self_attn(q, k, v, previous, chunk.lengths, weights)
        second = None
        if self.layer_type == "bst":  # step 3: SSM -> context states -> cross-attention
            x = self.dropout(hidden_states) if self.config.ssm_input == "raw" else xn
            keys, values, mask, zero_first = self.context(
                self.ssm, x, layer_cache, positions, chunk.doc_start, chunk.lengths, chunk.fill_cache,
                tables=chunk.ssm_tables,
            )  # fmt: skip
            second = self.cross_attn(xn, keys, values, mask, zero_first, weights)
        elif self.layer_type == "recurrent":  # step 3: the recurrent state's keys/values per block -> cross-attention
            keys, values = self.recurrent(k, v, previous, layer_cache, chunk)
            second = self.cross_attn(xn, keys, values, weights=weights)
        if chunk.fill_cache:  # the keys/values of each row's real tokens
            ring = self.self_attn.ring
            layer_cache.fill_ring(ATTENTION_RING, k.detach(), v.detach(), chunk.row_lengths, ring, positions)
        return self.output(hidden_states, a_self, self_w, second, self.dropout)

    def step(self, hidden_states, layer_cache, plan: StepPlan):
        xn = self.input_norm(hidden_states)
        q, k, v = self.self_attn.project(xn)
        a_self, self_w, ring = self.self_attn.step(q, k, v, layer_cache, plan)  # ring: after this token's write
        second, rec = None, getattr(self, "recurrent", None)
        if self.layer_type == "bst":
            x = hidden_states if self.config.ssm_input == "raw" else xn
            keys, values, mask, any_valid = self.context(self.ssm, x, layer_cache, plan=plan)
            second = self.cross_attn.step(xn, keys, values, mask, any_valid, plan.weights)
        elif self.layer_type == "recurrent":
            if maybe_any(plan.fresh):  # a document starting here reads the initial state
                state = layer_cache.rec_state
                rec.store(layer_cache, plan.fresh, rec.initial_state.to(state.dtype).expand_as(state))
            second = self.cross_attn.step(xn, layer_cache.rec_k, layer_cache.rec_v, weights=plan.weights)
            if maybe_any(plan.block_end):  # at a block's end the state absorbs the ring (keys, values, positions)
                rec.store(layer_cache, plan.block_end, rec.update(layer_cache.rec_state, *ring[:2], ring[2] >= 0))
        return self.output(hidden_states, a_self, self_w, second, None)

    def output(self, hidden_states, a_self, self_w, second, dropout):
        """Steps 4 and 5 (``dropout`` on the attention output: the full-sequence form's, unless meliad's)."""
        second_w = None
        if second is not None:
            a_second, second_w = second
            a_self = torch.cat([a_self, a_second], -1)  # (B, T, 2 H d_h)
        attn = self.o_proj(a_self)
        h = hidden_states + (attn if dropout is None or self.config.meliad_dropout else dropout(attn))
        h = h + self.dropout(self.mlp(self.post_attention_norm(h)))
        return h, self_w, second_w


class BSTGSSLayer(BSTLayer):
    """Gated State Space layer (GSS-Hybrid): ``x + ((S4D(gelu(x_n W_u)) W_y) * gelu(x_n W_v)) W_o``."""

    def __init__(self, config: BSTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d, ds = config.hidden_size, config.hidden_size // 4
        width = config.gss_expansion * d
        self.u_proj = nn.Linear(d, ds, bias=False)
        self.v_proj = nn.Linear(d, width, bias=False)
        self.ssm = S4DKernel(ds, 1, config.ssm_state_size, config)
        self.y_proj = nn.Linear(ds, width, bias=False)
        self.o_proj = nn.Linear(width, d, bias=False)

    def gates(self, hidden_states):
        xn = self.input_norm(hidden_states)
        return F.gelu(self.u_proj(xn)), F.gelu(self.v_proj(xn))

    def output(self, hidden_states, y, v):
        return hidden_states + self.dropout(self.o_proj(self.y_proj(y.to(v.dtype)) * v)), None, None

    def sequence(self, hidden_states, layer_cache, chunk: _Chunk):
        u, v = self.gates(hidden_states)
        seq_len, lens = u.shape[1], chunk.lengths
        state0 = None if chunk.positions is None else layer_cache.ssm_state
        if lens is not None and self.config.bidirectional:
            u = u * (torch.arange(seq_len, device=u.device)[None] < lens[:, None]).to(u.dtype)[..., None]
        y = self.ssm(u, state0)[:, :, 0]  # (B, T, Ds)
        if chunk.fill_cache:
            fill_ssm_state(self.ssm, u, chunk.row_lengths, state0, layer_cache)
        return self.output(hidden_states, y, v)

    def step(self, hidden_states, layer_cache, plan: StepPlan):
        u, v = self.gates(hidden_states)
        constants = BSTContextStates.step_constants(self.ssm, plan.memo)
        y, state = self.ssm.step(u[:, 0], layer_cache.ssm_state, constants)  # y (B, 1, Ds)
        layer_cache.set_ssm(state)
        return self.output(hidden_states, y, v)


class BSTPreTrainedModel(PreTrainedModel):
    config: BSTConfig
    config_class = BSTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BSTDecoderLayer", "BSTGSSLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _is_stateful = False  # BSTCache.crop takes back drafted positions: assisted decoding works
    # SSM kernels stay float32 under fp16/bf16 and are never quantized (quantizers skip _keep_in_fp32_modules).
    _keep_in_fp32_modules_strict = ["ssm"]
    _keep_in_fp32_modules = [r"(.*\.)?ssm"]
    _can_record_outputs = {"hidden_states": BSTLayer}  # the attention weights are collected in chunk_forward

    def post_init(self):
        if not any(name.rsplit(".", 1)[-1] == "ssm" for name, _ in self.named_modules()):
            self._keep_in_fp32_modules_strict = self._keep_in_fp32_modules = []
        super().post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        cfg = self.config

        def trunc_normal(param, fan_in):
            std = 1.0 / math.sqrt(fan_in)  # with the correction, over the std of a unit normal truncated at +-2
            std = std / 0.87962566103423978 if cfg.init_truncation_correction else std
            init.trunc_normal_(param, mean=0.0, std=std, a=-2 * std, b=2 * std)

        if isinstance(module, nn.Linear):
            trunc_normal(module.weight, module.in_features)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            t5 = module.weight.shape == (cfg.relative_attention_num_buckets, cfg.num_attention_heads)
            init.normal_(module.weight, 0.0, 0.1 if t5 else cfg.initializer_range)
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
                trunc_normal(module.up_proj, module.up_proj.shape[1])
            if isinstance(module.k_proj, nn.Parameter):
                trunc_normal(module.k_proj, module.k_proj.shape[1])
                trunc_normal(module.v_proj, module.k_proj.shape[1])
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
        """[`PreTrainedModel.from_pretrained`]; each decoder layer a ``device_map`` offloaded loads all its weights
        when called (accelerate's ``preload_module_classes``, which transformers does not pass)."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        for name, layer in model.named_modules():
            hooks = [h for m in layer.modules() if getattr(h := getattr(m, "_hf_hook", None), "offload", False)]
            if type(layer).__name__ not in model._no_split_modules or not hooks:
                continue
            from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

            hook = hooks[0]
            remove_hook_from_submodules(layer)
            attach_align_device_hook(
                layer, execution_device=hook.execution_device, offload=True, weights_map=hook.weights_map.dataset,
                offload_buffers=hook.offload_buffers, module_name=name, skip_keys=hook.skip_keys,
                preload_module_classes=[type(layer).__name__], tied_params_map=hook.tied_params_map,
            )  # fmt: skip
        return loaded

    def resize_token_embeddings(self, *args, **kwargs):
        """As transformers', keeping ``config.logit_scale``."""
        scale = self.config.logit_scale
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.config.logit_scale = scale
        return embeddings

    def ssm_parameter_names(self) -> list[str]:
        """The SSM kernel parameters that train with ``config.ssm_lr`` and no weight decay, in parameter order."""
        ssm = set()
        for prefix, module in self.named_modules():
            if isinstance(module, S4DKernel):
                ssm.update(f"{prefix}.{n}" for n in ("A_log_real", "A_imag", "B", "log_dt"))
            elif isinstance(module, UnstructFilter):
                ssm.update(f"{prefix}.{n}" for n, _ in module.named_parameters() if n != "bias")
        return [name for name, _ in self.named_parameters() if name in ssm]


class BSTModel(BSTPreTrainedModel):
    """The BST decoder stack: ``embed_tokens`` -> ``layers`` -> ``norm`` (outputs: docs/architecture.md)."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        kinds = map(config.layer_kind, range(config.num_hidden_layers))
        self.layers = nn.ModuleList(
            (BSTGSSLayer if k == "gss" else BSTDecoderLayer)(config, i) for i, k in enumerate(kinds)
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
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if input_ids is not None and (
            input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool
        ):
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}.")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {tuple(input_ids.shape)}.")
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        if shape[1] == 0 or shape[0] == 0:
            raise ValueError(f"Empty input: got a batch of shape {tuple(shape)}; need at least one token per row.")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(shape):
            if cache is None or attention_mask.shape[0] != shape[0]:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but the input has shape {tuple(shape)}."
                )
        rows = None if cache is None or cache.layers[0].is_empty else cache.layers[0]
        if rows is not None and rows.positions.shape[0] != shape[0]:
            raise ValueError(
                f"The cache (`cache`/`past_key_values`) holds {rows.positions.shape[0]} rows but the input has {shape[0]}."
            )
        if input_ids is not None and self._validate_ids(input_ids, rows is not None and shape[1] == 1):
            bad = [i for i in (int(input_ids.min()), int(input_ids.max())) if not 0 <= i < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids contains token id {bad[0]} outside [0, vocab_size={self.config.vocab_size})."
                )
        return shape

    def _validate_ids(self, input_ids, decode_step: bool) -> bool:
        """Whether to range-check token ids: eager, and on accelerators outside training and decode steps (a sync)."""
        return not tracing() and (not on_accelerator(input_ids) or not (self.training or decode_step))

    def _check_unstruct_length(self, seq_len, cache, continuing):
        cfg = self.config
        if cfg.ssm_kind != "unstruct" or not cfg.bst_layer_indices or cfg.unstruct_finite_filter:
            return
        # (a traced step serves every position: only eager calls check a continued sequence)
        rows = cache.layers[0] if continuing and not tracing() else None
        done = 0 if rows is None else int((rows.positions - rows.doc_start).max())
        if seq_len + done > cfg.max_position_embeddings:
            raise ValueError(
                f"unstruct BST models handle at most max_position_embeddings={cfg.max_position_embeddings} "
                f"tokens (the filter length); got {seq_len + done}. Use ssm_kind='s4' for longer sequences."
            )

    @cache_argument
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
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """``cache`` (or ``past_key_values``): a [`BSTCache`] to continue; a packed row runs per document."""
        cfg = self.config
        cache = None if cfg.bidirectional else cache
        if cache is not None:
            own_layers(cache, cfg)  # a BSTCache, or a DynamicCache / StaticCache of BST layers (made by generate)
        shape = self._check_inputs(input_ids, inputs_embeds, attention_mask, cache)
        hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        weights = output_attentions if output_attentions is not None else cfg.output_attentions
        if weights and cfg._attn_implementation != "eager":
            logger.warning_once(
                f"BST: attn_implementation={cfg._attn_implementation!r} returns no attention weights (output_attentions"
                "=True): load the model with attn_implementation='eager' to get them."
            )
            weights = False
        # (the causal LM head passes the documents it found: ``_document_starts``)
        starts = kwargs.get("_document_starts", ...)
        starts = _Documents.starts(kwargs, attention_mask, shape) if starts is ... else starts
        if starts is None:
            return self.chunk_forward(
                input_ids, attention_mask, cache, inputs_embeds, use_cache, output_hidden_states=hidden_states,
                output_attentions=bool(weights), return_dict=True,
            )  # fmt: skip
        if cache is not None or use_cache or weights:
            raise ValueError(
                "A packed row (position_ids restarting inside a row, or cu_seq_lens_q/k) holds separate sequences: it "
                "fills or continues no cache and returns no attention weights. Pass use_cache=False and "
                "output_attentions=False; generate from one row per sequence."
            )
        docs = _Documents(starts, cfg.block_len)
        inner = [
            self.chunk_forward(ids, mask, None, embeds, False, output_hidden_states=hidden_states, return_dict=True)
            for ids, embeds, mask in zip(docs.rows(input_ids), docs.rows(inputs_embeds), docs.masks)
        ]
        per_layer = zip(*(out.hidden_states for out in inner)) if inner[0].hidden_states is not None else None
        hidden = None if per_layer is None else tuple(None if h[0] is None else docs.columns(h) for h in per_layer)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=docs.columns([out.last_hidden_state for out in inner]), hidden_states=hidden
        )

    @capture_outputs
    def chunk_forward(
        self, input_ids, attention_mask, cache, inputs_embeds, use_cache, output_attentions=False, **kwargs
    ):
        """One chunk continuing ``cache`` ([`_Chunk`]): [`forward`] without packed rows."""
        cfg = self.config
        given = cache
        use_cache = (cfg.use_cache and not self.training if use_cache is None else use_cache) and not cfg.bidirectional
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        bsz, seq_len = hidden.shape[:2]
        if use_cache and cache is None:
            cache = BSTCache(cfg, bsz)
        memo = self.__dict__.setdefault("step_memo", {})  # parameter-derived constants for one decoding run
        if cache is not None and cache.layers[0].is_empty:
            memo.clear()
        chunk = _Chunk(
            cache, attention_mask, (bsz, seq_len), cfg, hidden.device, host_can_branch(hidden), memo,
            output_attentions, bool(kwargs.get("output_hidden_states")),
        )  # fmt: skip
        self._check_unstruct_length(seq_len, cache, not chunk.fresh)
        if not (self.gradient_checkpointing and self.training):  # (a checkpointed layer recomputes its own)
            chunk.ssm_tables = ChunkTables(layer.ssm for layer in self.layers if layer.layer_type == "bst")
        if not cfg.meliad_dropout:  # embedding dropout, on every chunk (a streamed segment continuing a cache too)
            hidden = self.dropout(hidden)
        blocks = chunk.fresh and not chunk.columns  # between layers: the block layout, else the caller's columns
        hidden = chunk.to_blocks(hidden) if blocks else hidden
        weights = []  # per layer (self-attention, second attention)
        for layer_idx, layer in enumerate(self.layers):
            out = layer(hidden, cache.layers[layer_idx] if cache is not None else None, chunk)
            hidden, *layer_weights = out if output_attentions else (out, None, None)
            weights.append(layer_weights)
        chunk.finish()
        hidden = self.norm(chunk.from_blocks(hidden) if blocks else hidden)
        for layer_cache in cache.layers if cache is not None and self.training else ():
            layer_cache.detach()
        attentions, cross_attentions = zip(*weights) if output_attentions else (None, None)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden, **{CACHE_NAME: cache if use_cache or given is not None else None},
            attentions=attentions, cross_attentions=cross_attentions,
        )  # fmt: skip


class BSTForCausalLM(BSTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        self.model = BSTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_dropout = nn.Dropout(config.resolved_final_dropout)  # meliad's, before the logits
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def create_masks_for_generate(self, attention_mask=None, is_first_iteration=True, **kwargs):
        """The 2-D padding mask on the first forward only (decoded tokens are real: one compiled step serves all)."""
        return attention_mask if is_first_iteration else None

    @cache_argument
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
        **kwargs,
    ) -> CausalLMOutputWithCrossAttentions:
        """Causal LM forward; ``labels`` `(B, T)` are the input ids (shifted inside; -100 ignored)."""
        starts = _Documents.starts(kwargs, attention_mask, _input_shape(input_ids, inputs_embeds))
        outputs = self.model(
            input_ids, attention_mask, cache, inputs_embeds, use_cache, output_hidden_states, output_attentions,
            _document_starts=starts,
        )  # fmt: skip
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = self.final_dropout(outputs.last_hidden_state[:, slice_indices, :])
        scale = self.config.logit_scale
        if getattr(self.lm_head, "bias", None) is None:  # the same product as scaling the logits, V / D times cheaper
            logits = self.lm_head(hidden * scale)
        else:
            logits = self.lm_head(hidden) * scale
        loss = None
        if labels is not None:
            if starts is not None:
                labels = labels.masked_fill(starts, -100)  # a document's first token: not a target of the previous
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithCrossAttentions(
            loss=loss, logits=logits, **{k: v for k, v in outputs.items() if k != "last_hidden_state"}
        )


class BSTS4Layer(nn.Module):
    """A plain S4 layer (the LRA classifier's head): RMS norm -> S4D -> GELU -> linear -> residual."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.norm = BSTRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ssm = S4DKernel(config.hidden_size, 1, config.ssm_state_size, config)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states, valid: torch.Tensor | None = None):
        """``hidden_states`` `(B, T, D)`, ``valid`` `(B, T)` bool (padding excluded from the convolution)."""
        x = self.norm(hidden_states)
        x = x if valid is None else x * valid[..., None].to(x.dtype)
        y = self.ssm(x)[:, :, 0].to(hidden_states.dtype)  # (B, T, D)
        return hidden_states + self.dropout(self.out_proj(F.gelu(y)))


class BSTForSequenceClassification(BSTPreTrainedModel):
    """BST encoder, ``num_s4_head_layers`` S4 layers, mean pooling over real tokens, a linear classifier (LRA)."""

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
        if _Documents.starts(kwargs, attention_mask, _input_shape(input_ids, inputs_embeds)) is not None:
            raise ValueError("A packed row (several documents per row) cannot be classified: pass one per row.")
        outputs = self.model(
            input_ids, attention_mask, None, inputs_embeds, False, output_hidden_states, output_attentions
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
        loss = None if labels is None else self.loss_function(labels, logits, self.config)
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
