"""The SSM sublayer and context states of a BST layer (paper Sec. 3.3-3.4): the SSM input projection, the SSM
kernel of ``ssm_kind`` over the whole sequence (``ssm_bst.py``), and the SH / MH / MF builders of ``context_mode``
that turn its outputs into the context keys and values the block cross-attention reads. Each has a full-sequence
form and a one-token step form over the cache layer passed in.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .attention_bst import BSTRMSNorm
from .cache_bst import CONTEXT_RING
from .configuration_bst import BSTConfig
from .functional_bst import additive_mask, context_valid, l2_normalize
from .ssm_bst import PerFilterS4D, S4DKernel, UnstructFilter, compute_dtype
from .utils_bst import constant_memo, gather_rows, maybe_any, step_memo, tracing


# Largest unstruct taps spectrum kept for decoding chunks (per layer; recomputed per chunk beyond it).
CHUNK_SPECTRUM_MEMO_BYTES = 128 * 2**20
# Tokens per segment of MH's segmented S4 path ([`TokenContextStates.segmented_context`]; 0: off).
MH_SEGMENT_LEN = 256


class BSTContextStates(nn.Module):
    """Context-state builder of a BST layer (paper Sec. 3.3-3.4), the part shared by SH/MH/MF: ``z = x_n P_down``
    (D -> D_s), the layer's SSM kernel ``ssm`` (a sibling module, passed to every call) over the whole sequence, and
    the context keys/values of its outputs (subclasses), behind one contract:

    * ``sequence(...)``: keys and values `(B, nb, S_c, H, d)` per block, an additive cross mask `(W, S_c)` or None,
      and whether every block's first query has no context (strict mask); with ``fill_cache`` it writes the state;
    * ``step(ssm, xn, layer_cache, plan)``: one token; keys/values `(B, S_c, H, d)`, a mask `(B, 1, 1, S_c)` or
      None, and which rows see any context (None: all);
    * ``forward`` calls one of them, so that hooks on the module (PEFT's ``target_parameters``, offloading) run.

    SSM outputs are cast to the activation dtype (``xn``'s), never to a weight's (which may be int8).
    """

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        self.mode = config.context_mode
        self.block_len = config.block_len
        d, ds = config.hidden_size, config.ssm_channels
        self.down_proj = nn.Linear(d, ds, bias=False)
        self.norm = BSTRMSNorm(d, config.rms_norm_eps)
        # meliad_dropout: dropout on the normed context states before the K/V projections (as meliad's cross KVQ).
        self.dropout = nn.Dropout(config.dropout) if config.meliad_dropout else nn.Identity()

    def forward(
        self,
        ssm,
        xn,
        layer_cache,
        positions=None,
        doc_start=None,
        lengths=None,
        fill_cache=False,
        plan=None,
        tables=None,
    ):
        """[`step`] (given a ``plan``) or [`sequence`] (``tables``: the forward's S4D [`ChunkTables`], or None)."""
        if plan is not None:
            return self.step(ssm, xn, layer_cache, plan)
        return self.sequence(ssm, xn, lengths, layer_cache, positions, doc_start, fill_cache, tables)

    def _heads(self, x):
        return x.unflatten(-1, (self.config.num_attention_heads, self.config.head_dim))

    @staticmethod
    def step_constants(ssm, memo: dict | None):
        """The SSM's [`step_constants`], kept in ``memo`` (a decoding run's) while its parameters are unchanged."""
        return step_memo(memo, (id(ssm), "ssm"), (), ssm.parameters(), ssm.step_constants)

    def _ssm_input(self, xn, lengths):
        z = self.down_proj(xn)  # (B, T, Ds)
        if lengths is not None and self.config.bidirectional:
            z = z * (torch.arange(z.shape[1], device=z.device)[None] < lengths[:, None]).to(z.dtype)[..., None]
        return z

    def _sequence_input(self, xn, lengths, layer_cache, positions):
        """The SSM input ``z`` of a full sequence, the SSM state it continues from (None: a fresh sequence) and
        whether it continues a cached one."""
        continued = layer_cache is not None and positions is not None
        return self._ssm_input(xn, lengths), (layer_cache.ssm_state if continued else None), continued

    def _fill_ssm_state(self, ssm, z, lengths, state0, layer_cache):
        """The SSM state after each row's real tokens into ``layer_cache`` (rows right-aligned for ``final_state``)."""
        bsz, seq_len, _ = z.shape
        lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=z.device)
        idx = torch.arange(seq_len, device=z.device)[None] - (seq_len - lens[:, None])
        z_right = gather_rows(z, idx.clamp(min=0)) * (idx >= 0).to(z.dtype)[..., None]
        layer_cache.set_ssm(ssm.final_state(z_right.detach(), state0).detach())
        return lens

    def _step_ssm(self, ssm, xn, layer_cache, plan, output: bool = True, chunked: bool = False):
        """One SSM step: ``y_t`` `(B, C, Ds)` (None if not ``output``); the cache's SSM state advances. ``chunked``
        (unstruct with outputs at every step: SH/MH): decode in chunks of M steps ([`_unstruct_chunk`])."""
        z = self.down_proj(xn)[:, 0]  # (B, Ds)
        seen = None
        if self.config.ssm_kind == "unstruct":
            if not tracing():
                # Unstruct steps cost O(longest document so far): one read of the position per step.
                seen = int(plan.offset.max()) + 1
                if seen > self.config.max_position_embeddings and not self.config.unstruct_finite_filter:
                    raise ValueError(
                        f"unstruct BST models generate at most max_position_embeddings="
                        f"{self.config.max_position_embeddings} tokens (the filter has no taps beyond it); use an S4 "
                        "model for longer generation."
                    )
        constants = self.step_constants(ssm, plan.memo)
        if self.config.ssm_kind != "unstruct":
            y, state = ssm.step(z, layer_cache.ssm_state, constants, seen)
            layer_cache.set_ssm(state)
            return y
        pending = self._unstruct_chunk(ssm, layer_cache, constants, seen, plan.memo) if chunked and output else None
        y, state = ssm.step(z, layer_cache.ssm_state, constants, seen, output=output, pending=pending)
        if pending is None:
            # Eager: the history stays a view into its slack buffer (``append_history``: O(1) per step). Traced: the
            # step built a new history anyway; written over the old one in place (a fixed address for CUDA graphs).
            layer_cache.set_ssm(state, contiguous=tracing())
        else:
            layer_cache.set_ssm(state, pending[0], pending[1] + 1, contiguous=False)
        return y

    def _unstruct_chunk(self, ssm, layer_cache, constants, seen, memo):
        """The current decoding chunk ``(pending outputs, step in it)`` of an unstruct step, or None (a direct dot
        product over the ``seen`` newest inputs: traced steps, rows of at most M inputs). A new chunk starts when the
        last one is used up ([`UnstructFilter.pending_outputs`]): O(M) per step plus O(seen log seen) / M."""
        if seen is None:
            return None
        chunk = layer_cache.chunk(ssm.decode_chunk)
        if chunk is not None or seen <= ssm.decode_chunk:
            return chunk
        n = min(seen - 1, ssm.max_len)  # the previous inputs that can be non-zero
        size = ssm.pending_fft_size(n)
        spectrum = step_memo(
            memo,
            (id(ssm), "unstruct_chunk"),
            (size,),
            ssm.parameters(),
            lambda: ssm.pending_spectrum(size, constants),
            CHUNK_SPECTRUM_MEMO_BYTES,
        )
        return ssm.pending_outputs(layer_cache.ssm_state, n, spectrum), 0


class TokenContextStates(BSTContextStates):
    """SH / MH: one context state per token; block b cross-attends to its own W context states (triangular mask).
    The decoding cache keeps the current block's context keys/values in a W-slot ring."""

    # Tokens per segment of the segmented S4 path ([`segmented_context`]); 0: the whole-sequence path.
    segment_len = 0

    def lift_and_project(self, y: torch.Tensor):
        """SSM outputs ``y`` `(..., C, Ds)` -> context keys, values `(..., 1, H, d_h)`."""
        raise NotImplementedError

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        """[`lift_and_project`] of SSM outputs `(C, Ds, B * n)` -> keys, values `(B, n, H, d_h)` (MH's segments)."""
        raise NotImplementedError

    def use_segments(self, ssm) -> bool:
        """Whether [`sequence`] runs [`segmented_context`]: ``segment_len`` set, a causal chunked S4D kernel, eager
        (a traced graph keeps no length-dependent loop)."""
        return (
            self.segment_len > 0
            and isinstance(ssm, S4DKernel)
            and ssm.chunk_len > 0
            and not ssm.bidirectional
            and not tracing()
        )

    def segmented_context(self, ssm, z: torch.Tensor, state: torch.Tensor | None, dtype: torch.dtype, tables=None):
        """``lift_and_project(ssm(z, state))`` `(B, T, H, d_h)` segment by segment (``segment_len`` tokens), from the
        chunk-start states of one scan: no `(B, T, C, Ds)` SSM output or `(B, T, H, D)` lift is ever built."""
        bsz, length = z.shape[0], z.shape[1]
        chunk = ssm.chunk_len
        nc = -(-length // chunk)
        zc = F.pad(
            z.to(compute_dtype(ssm.log_dt)), (0, 0, 0, nc * chunk - length)
        )  # causal: zeros at the end are inert
        constants = ssm.chunked_constants(
            chunk, zc.dtype, nc, tables
        )  # one discretisation for the states and segments
        x0 = ssm.chunk_start_states(zc, chunk, state, constants)  # (Ds, B, nc, 2 N2)
        per = max(1, self.segment_len // chunk)  # chunks per segment
        keys, values = [], []
        for c0 in range(0, nc, per):
            c1 = min(nc, c0 + per)
            # (C, Ds, B*n): the segment's SSM outputs, lifted and projected at once
            y = ssm.channel_major_chunks(zc[:, c0 * chunk : c1 * chunk], x0[:, :, c0:c1], chunk, constants)
            k, v = self.lift_channel_major(y.to(dtype), bsz)
            keys.append(k)
            values.append(v)
        return torch.cat(keys, 1)[:, :length], torch.cat(values, 1)[:, :length]

    def sequence(self, ssm, xn, lengths, layer_cache, positions, doc_start, fill_cache, tables=None):
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w = self.block_len
        nb = seq_len // w
        z, state0, continued = self._sequence_input(xn, lengths, layer_cache, positions)
        if self.use_segments(ssm):
            ck, cv = self.segmented_context(ssm, z, state0, xn.dtype, tables)  # (B, T, H, d)
        else:
            ck, cv = self.lift_and_project(ssm(z, state0, tables).to(xn.dtype))  # (B, T, C, Ds) -> (B, T, 1, H, d)
        ctx_k, ctx_v = ck.view(bsz, nb, w, *ck.shape[-2:]), cv.view(bsz, nb, w, *cv.shape[-2:])
        if cfg.bidirectional:
            mask, zero_first = None, False
        else:

            def build():
                i = torch.arange(w, device=z.device)
                return additive_mask(context_valid(i[None], i[:, None], cfg.cross_mask), ck.dtype)

            mask = constant_memo(self, ("cross", ck.dtype, str(z.device)), build)  # (W, W), built once
            zero_first = cfg.cross_mask == "strict"
        if fill_cache:
            lens = self._fill_ssm_state(ssm, z, lengths, state0, layer_cache)
            offset = positions if continued else None
            layer_cache.fill_ring(
                CONTEXT_RING, ctx_k.flatten(1, 2).detach(), ctx_v.flatten(1, 2).detach(), lens, w, offset
            )
        return ctx_k, ctx_v, mask, zero_first

    def step(self, ssm, xn, layer_cache, plan):
        y = self._step_ssm(ssm, xn, layer_cache, plan, chunked=True)
        ck, cv = self.lift_and_project(y.to(xn.dtype))  # (B, 1, H, d)
        p = plan.positions
        ctx_k, ctx_v, cpos = layer_cache.write_ring(
            CONTEXT_RING, plan.rows, plan.slot(self.block_len), p, ck[:, 0], cv[:, 0]
        )
        mask, any_valid = plan.get(("context", ck.dtype), lambda: self.step_mask(cpos, plan, ck.dtype))
        return ctx_k, ctx_v, mask, any_valid

    def step_mask(self, cpos, plan, dtype):
        """The additive mask `(B, 1, 1, W)` of the context ring's positions ``cpos`` `(B, W)` that a step's token
        sees (its block's, up to itself; blocks count from each row's document start) and which rows see any."""
        p = plan.positions[:, None]
        block_start = p - plan.offset.remainder(self.block_len)[:, None]
        valid = (cpos >= block_start) & context_valid(cpos, p, self.config.cross_mask)  # (B, W)
        return additive_mask(valid, dtype)[:, None, None, :], valid.any(-1)


class SHContextStates(TokenContextStates):
    """SH (single head, Listing 2): ``c_t = Norm(P_up y_t)``, projected to H heads by the context K/V projections."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.up_proj = nn.Linear(config.ssm_channels, d, bias=False)
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)

    def lift_and_project(self, y: torch.Tensor):
        c = self.dropout(self.norm(self.up_proj(y[..., 0, :])))  # (..., D)
        k = self._heads(self.k_proj(c)).unsqueeze(-3)
        v = self._heads(self.v_proj(c)).unsqueeze(-3)
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., 1, H, d_h)


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
        c = self.dropout(self.norm(torch.einsum("...hs,hsd->...hd", y, self.up_proj.to(y.dtype))))  # (..., H, D)
        k = torch.einsum("...hd,hde->...he", c, self.k_proj.to(c.dtype)).unsqueeze(-3)
        v = torch.einsum("...hd,hde->...he", c, self.v_proj.to(c.dtype)).unsqueeze(-3)
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., 1, H, d_h)

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        # Contracted in the layout y has: (H, B*n, Ds) is a transposed view of (H, Ds, B*n), no copy.
        c = self.dropout(self.norm(torch.bmm(y.transpose(1, 2), self.up_proj.to(y.dtype))))  # (H, B*n, D)
        kv = torch.bmm(c, torch.cat([self.k_proj, self.v_proj], -1).to(c.dtype))  # (H, B*n, 2 d_h)
        k, v = kv.unflatten(1, (bsz, -1)).permute(1, 2, 0, 3).split(self.config.head_dim, -1)  # (B, n, H, d_h)
        return (l2_normalize(k) if self.config.qk_norm else k), v


class MFContextStates(BSTContextStates):
    """MF (multi-filter, Listing 4): block b attends to the S SSM outputs at the last token of block b-1 (block 0: a
    learned initial context), each lifted by its own projection, plus learned context IDs; no mask. The decoding
    cache keeps the block's context keys/values and the latest SSM outputs (``mf_last``)."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd, s = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_context_states
        self.up_proj = nn.Parameter(torch.empty(s, config.ssm_channels, d))  # (S, Ds, D)
        self.context_ids = nn.Parameter(torch.empty(s, d))
        # Block 0's context: lifted (S, D), or in the SSM's output space (S, Ds) and lifted (``mf_initial_context``).
        self.initial_context = nn.Parameter(
            torch.empty(s, d if config.mf_initial_context == "lifted" else config.ssm_channels)
        )
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)

    def mf_context(self, y_prev: torch.Tensor | None, batch_shape, dtype: torch.dtype):
        """Context keys/values from the previous block's last SSM outputs ``y_prev`` `(..., S, Ds)` (None: block 0),
        in the activation ``dtype``."""
        if y_prev is None and self.config.mf_initial_context == "lifted":
            c = self.initial_context.to(dtype).expand(*batch_shape, -1, -1)
        else:
            if y_prev is None:
                y_prev = self.initial_context.expand(*batch_shape, -1, -1)
            c = torch.einsum("...sc,scd->...sd", y_prev.to(dtype), self.up_proj.to(dtype))
        if self.config.mf_context_ids_after_norm:
            c = self.norm(c) + self.context_ids.to(c.dtype)
        else:
            c = self.norm(c + self.context_ids.to(c.dtype))
        # One batch dimension: bitsandbytes' 8-bit matmul takes inputs of at most 3 dimensions.
        c = self.dropout(c).flatten(0, -3)
        k, v = (self._heads(proj(c)).unflatten(0, batch_shape) for proj in (self.k_proj, self.v_proj))
        return (l2_normalize(k) if self.config.qk_norm else k), v  # (..., S, H, d_h)

    def sequence(self, ssm, xn, lengths, layer_cache, positions, doc_start, fill_cache, tables=None):
        cfg = self.config
        bsz, seq_len, _ = xn.shape
        w = self.block_len
        nb = seq_len // w
        z, state0, continued = self._sequence_input(xn, lengths, layer_cache, positions)
        if cfg.bidirectional:
            y_end = ssm(z, state0, tables)[:, w - 1 :: w]
        else:
            # Causal S4: states at block ends, read out by the S filters (no FFT per filter).
            y_end = ssm.block_end_outputs(z, w, state0, tables)  # (B, nb, S, Ds)
        first_k, first_v = self.mf_context(None, (bsz,), xn.dtype)
        if continued:
            cont_k, cont_v = self.mf_context(layer_cache.mf_last, (bsz,), xn.dtype)
            fresh = (positions == doc_start)[:, None, None, None]
            first_k = torch.where(fresh, first_k.to(cont_k.dtype), cont_k)
            first_v = torch.where(fresh, first_v.to(cont_v.dtype), cont_v)
        rest_k, rest_v = self.mf_context(y_end[:, :-1], (bsz, nb - 1), xn.dtype)
        ctx_k = torch.cat([first_k[:, None].to(rest_k.dtype), rest_k], 1)
        ctx_v = torch.cat([first_v[:, None].to(rest_v.dtype), rest_v], 1)
        if fill_cache:
            lens = self._fill_ssm_state(ssm, z, lengths, state0, layer_cache)
            rows = torch.arange(bsz, device=z.device)
            blk = ((lens - 1) // w).clamp(min=0)
            # mf_last is needed at the next block start (lens % W == 0): the output at the last token, a block end.
            layer_cache.set(
                ctx_k=ctx_k[rows, blk].detach(),
                ctx_v=ctx_v[rows, blk].detach(),
                mf_last=y_end[rows, (lens // w - 1).clamp(min=0)].detach(),
            )
        return ctx_k, ctx_v, None, False

    def step(self, ssm, xn, layer_cache, plan):
        # Blocks are counted from the start of each row's current document.
        if maybe_any(plan.block_start):
            # A new block starts: its context is built from the previous block's last SSM outputs.
            k_new, v_new = self.mf_context(layer_cache.mf_last, (xn.shape[0],), xn.dtype)
            k0, v0 = self.mf_context(None, (xn.shape[0],), xn.dtype)
            first = plan.fresh[:, None, None, None]
            k_new, v_new = torch.where(first, k0, k_new), torch.where(first, v0, v_new)
            layer_cache.set(plan.block_start, ctx_k=k_new, ctx_v=v_new)
        # The SSM output matters only at block ends (unstruct computes it only there).
        output = self.config.ssm_kind == "s4" or maybe_any(plan.block_end)
        y = self._step_ssm(ssm, xn, layer_cache, plan, output=output)
        if y is not None:
            layer_cache.set(plan.block_end, mf_last=y)
        return layer_cache.ctx_k, layer_cache.ctx_v, None, None


# The SSM kernel of each ``ssm_kind`` and the context builder of each ``context_mode``.
def _s4_kernel(channels, out_channels, config):
    """S4D with a state shared by the C read-outs, or (MF, ``mf_independent_filters``) one SSM per filter."""
    per_filter = config.context_mode == "mf" and config.mf_independent_filters
    return (PerFilterS4D if per_filter else S4DKernel)(channels, out_channels, config.ssm_state_size, config)


SSM_KERNELS = {"s4": _s4_kernel, "unstruct": UnstructFilter}
CONTEXT_BUILDERS = {"sh": SHContextStates, "mh": MHContextStates, "mf": MFContextStates}
