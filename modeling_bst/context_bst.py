"""The SSM sublayer and context states of a BST layer (paper Sec. 3.3-3.4): the SH / MH / MF builders of the
context keys and values the block cross-attention reads, each in a full-sequence and a one-token form."""

import torch
import torch.nn.functional as F
from torch import nn

from .attention_bst import BSTRMSNorm
from .cache_bst import CONTEXT_RING
from .configuration_bst import BSTConfig
from .functional_bst import additive_mask, context_valid, l2_normalize
from .ssm_bst import PerFilterS4D, S4DKernel, UnstructFilter, compute_dtype
from .utils_bst import constant_memo, gather_rows, maybe_any, step_memo, tracing


MH_SEGMENT_LEN = 256  # tokens per segment of MH's segmented S4 path ([`TokenContextStates.segmented_context`])


def fill_ssm_state(ssm, z, lengths, state0, layer_cache):
    """The SSM state after each row's real tokens (``lengths`` `(B,)`; None: all) of ``z`` `(B, T, Ds)` into
    ``layer_cache`` (rows right-aligned); returns the lengths."""
    bsz, seq_len, _ = z.shape
    lens = lengths if lengths is not None else torch.full((bsz,), seq_len, device=z.device)
    idx = torch.arange(seq_len, device=z.device)[None] - (seq_len - lens[:, None])
    z_right = gather_rows(z, idx.clamp(min=0)) * (idx >= 0).to(z.dtype)[..., None]
    layer_cache.set_ssm(ssm.final_state(z_right.detach(), state0).detach())
    return lens


class BSTContextStates(nn.Module):
    """The part of the context-state builders shared by SH/MH/MF: ``z = x_n P_down``, the layer's SSM kernel
    ``ssm`` (passed to every call) and the ``sequence`` / ``step`` contract (docs/architecture.md)."""

    def __init__(self, config: BSTConfig):
        super().__init__()
        self.config = config
        self.mode = config.context_mode
        self.block_len = config.block_len
        d, ds = config.hidden_size, config.ssm_channels
        self.down_proj = nn.Linear(d, ds, bias=False)
        self.norm = BSTRMSNorm(d, config.rms_norm_eps)
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
        if plan is None:
            return self.sequence(ssm, xn, lengths, layer_cache, positions, doc_start, fill_cache, tables)
        return self.step(ssm, xn, layer_cache, plan)

    def _heads(self, x):
        return x.unflatten(-1, (self.config.num_attention_heads, self.config.head_dim))

    @staticmethod
    def step_constants(ssm, memo: dict | None):
        """The SSM's [`step_constants`], kept in a decoding run's ``memo`` while its parameters are unchanged."""
        return step_memo(memo, (id(ssm), "ssm"), (), ssm.parameters(), ssm.step_constants)

    def _sequence_input(self, xn, lengths, layer_cache, positions):
        """The SSM input ``z``, the SSM state it continues (None: fresh) and whether it continues a cache."""
        z = self.down_proj(xn)  # (B, T, Ds)
        if lengths is not None and self.config.bidirectional:
            z = z * (torch.arange(z.shape[1], device=z.device)[None] < lengths[:, None]).to(z.dtype)[..., None]
        continued = layer_cache is not None and positions is not None
        return z, (layer_cache.ssm_state if continued else None), continued

    def _step_ssm(self, ssm, xn, layer_cache, plan, output: bool = True, chunked: bool = False):
        """One SSM step: ``y_t`` `(B, C, Ds)` (None if not ``output``), the cache's state advanced; ``chunked``:
        unstruct decoding in chunks of M steps ([`_unstruct_chunk`])."""
        z = self.down_proj(xn)[:, 0]  # (B, Ds)
        constants = self.step_constants(ssm, plan.memo)
        if self.config.ssm_kind != "unstruct":
            y, state = ssm.step(z, layer_cache.ssm_state, constants)
            layer_cache.set_ssm(state)
            return y
        seen = None if tracing() else int(plan.offset.max()) + 1  # O(longest document so far) per step
        if seen is not None and seen > self.config.max_position_embeddings and not self.config.unstruct_finite_filter:
            raise ValueError(
                f"unstruct BST models generate at most max_position_embeddings={self.config.max_position_embeddings} "
                "tokens (the filter has no taps beyond it); use an S4 model for longer generation."
            )
        pending = self._unstruct_chunk(ssm, layer_cache, constants, seen, plan.memo) if chunked and output else None
        y, state = ssm.step(z, layer_cache.ssm_state, constants, seen, output=output, pending=pending)
        if pending is None:  # eager: a view into its slack buffer; traced: copied in place (CUDA graphs)
            layer_cache.set_ssm(state, contiguous=tracing())
        else:
            layer_cache.set_ssm(state, pending[0], pending[1] + 1, contiguous=False)
        return y

    def _unstruct_chunk(self, ssm, layer_cache, constants, seen, memo):
        """The current unstruct decoding chunk ``(pending outputs, step in it)``, or None (a dot product)."""
        if seen is None:
            return None
        chunk = layer_cache.chunk(ssm.decode_chunk)
        if chunk is not None or seen <= ssm.decode_chunk:
            return chunk
        n = min(seen - 1, ssm.max_len)  # the previous inputs that can be non-zero
        return ssm.pending_outputs(layer_cache.ssm_state, n, constants, memo), 0


class TokenContextStates(BSTContextStates):
    """SH / MH: one context state per token, block b attends to its own W (triangular mask); a W-slot ring in the
    cache. SH (Listing 2): ``c_t = Norm(P_up y_t)`` projected to H heads; MH (Listing 3): H SSM outputs, each lifted
    by its own D_s -> D projection to that head's K/V."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        if self.mode == "mh":
            self.up_proj = nn.Parameter(torch.empty(heads, config.ssm_channels, d))  # (H, Ds, D)
            self.k_proj = nn.Parameter(torch.empty(heads, d, hd))
            self.v_proj = nn.Parameter(torch.empty(heads, d, hd))
        else:
            self.up_proj = nn.Linear(config.ssm_channels, d, bias=False)
            self.k_proj = nn.Linear(d, heads * hd, bias=False)
            self.v_proj = nn.Linear(d, heads * hd, bias=False)
        self.segment_len = MH_SEGMENT_LEN if self.mode == "mh" else 0  # tokens per [`segmented_context`] segment

    def lift_and_project(self, y: torch.Tensor):
        """SSM outputs `(..., C, Ds)` -> keys, values `(..., 1, H, d_h)`."""
        if self.mode == "mh":
            c = self.dropout(self.norm(torch.einsum("...hs,hsd->...hd", y, self.up_proj.to(y.dtype))))  # (..., H, D)
            k = torch.einsum("...hd,hde->...he", c, self.k_proj.to(c.dtype)).unsqueeze(-3)
            v = torch.einsum("...hd,hde->...he", c, self.v_proj.to(c.dtype)).unsqueeze(-3)
        else:
            c = self.dropout(self.norm(self.up_proj(y[..., 0, :])))  # (..., D)
            k = self._heads(self.k_proj(c)).unsqueeze(-3)
            v = self._heads(self.v_proj(c)).unsqueeze(-3)
        return (l2_normalize(k) if self.config.qk_norm else k), v

    def lift_channel_major(self, y: torch.Tensor, bsz: int):
        """MH's [`lift_and_project`] of SSM outputs `(H, Ds, B * n)` -> keys, values `(B, n, H, d_h)`."""
        c = self.dropout(self.norm(torch.bmm(y.transpose(1, 2), self.up_proj.to(y.dtype))))  # (H, B*n, D)
        kv = torch.bmm(c, torch.cat([self.k_proj, self.v_proj], -1).to(c.dtype))  # (H, B*n, 2 d_h)
        k, v = kv.unflatten(1, (bsz, -1)).permute(1, 2, 0, 3).split(self.config.head_dim, -1)  # (B, n, H, d_h)
        return (l2_normalize(k) if self.config.qk_norm else k), v

    def use_segments(self, ssm) -> bool:
        """Whether [`sequence`] runs [`segmented_context`]: ``segment_len`` set, a causal chunked S4D kernel, eager."""
        chunked = isinstance(ssm, S4DKernel) and ssm.chunk_len > 0 and not ssm.bidirectional
        return self.segment_len > 0 and chunked and not tracing()

    def segmented_context(self, ssm, z: torch.Tensor, state: torch.Tensor | None, dtype: torch.dtype, tables=None):
        """``lift_and_project(ssm(z, state))`` `(B, T, H, d_h)` segment by segment from the chunk-start states of one
        scan (``lift_channel_major``: no `(B, T, C, Ds)` output or `(B, T, H, D)` lift is built)."""
        length, chunk = z.shape[1], ssm.chunk_len
        nc = -(-length // chunk)
        zc = F.pad(z.to(compute_dtype(ssm.log_dt)), (0, 0, 0, nc * chunk - length))  # zeros at the end are inert
        constants = ssm.chunk_tables(chunk, nc, True, tables)
        x0 = ssm.chunk_start_states(zc, chunk, state, constants)  # (Ds, B, nc, 2 N2)
        per = max(1, self.segment_len // chunk)  # chunks per segment
        kv = []
        for c in range(0, nc, per):  # a segment's SSM outputs (C, Ds, B*n), lifted and projected at once
            y = ssm.channel_major_chunks(zc[:, c * chunk : (c + per) * chunk], x0[:, :, c : c + per], chunk, constants)
            kv.append(self.lift_channel_major(y.to(dtype), z.shape[0]))
        return tuple(torch.cat(t, 1)[:, :length] for t in zip(*kv))

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

        def build():  # the (W, W) cross mask, built once
            i = torch.arange(w, device=z.device)
            return additive_mask(context_valid(i[None], i[:, None], cfg.cross_mask), ck.dtype)

        mask = None if cfg.bidirectional else constant_memo(self, ("cross", ck.dtype, str(z.device)), build)
        if fill_cache:
            lens = fill_ssm_state(ssm, z, lengths, state0, layer_cache)
            ctx = ctx_k.flatten(1, 2).detach(), ctx_v.flatten(1, 2).detach()
            layer_cache.fill_ring(CONTEXT_RING, *ctx, lens, w, positions if continued else None)
        return ctx_k, ctx_v, mask, not cfg.bidirectional and cfg.cross_mask == "strict"

    def step(self, ssm, xn, layer_cache, plan):
        y = self._step_ssm(ssm, xn, layer_cache, plan, chunked=True)
        ck, cv = self.lift_and_project(y.to(xn.dtype))  # (B, 1, H, d)
        slot = plan.slot(self.block_len)
        ctx_k, ctx_v, cpos = layer_cache.write_ring(CONTEXT_RING, plan.rows, slot, plan.positions, ck[:, 0], cv[:, 0])
        mask, any_valid = plan.get(("context", ck.dtype), lambda: self.step_mask(cpos, plan, ck.dtype))
        return ctx_k, ctx_v, mask, any_valid

    def step_mask(self, cpos, plan, dtype):
        """The additive mask `(B, 1, 1, W)` over the ring positions ``cpos`` a step sees, and which rows see any."""
        p = plan.positions[:, None]
        block_start = p - plan.offset.remainder(self.block_len)[:, None]
        valid = (cpos >= block_start) & context_valid(cpos, p, self.config.cross_mask)  # (B, W)
        return additive_mask(valid, dtype)[:, None, None, :], valid.any(-1)


class MFContextStates(BSTContextStates):
    """MF (multi-filter, Listing 4): block b attends to the S lifted SSM outputs at the end of block b-1 (block 0: a
    learned initial context) plus context IDs; the cache keeps the block's keys/values and ``mf_last``."""

    def __init__(self, config: BSTConfig):
        super().__init__(config)
        d, heads, hd, s = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_context_states
        self.up_proj = nn.Parameter(torch.empty(s, config.ssm_channels, d))  # (S, Ds, D)
        self.context_ids = nn.Parameter(torch.empty(s, d))
        lifted = config.mf_initial_context == "lifted"
        self.initial_context = nn.Parameter(torch.empty(s, d if lifted else config.ssm_channels))
        self.k_proj = nn.Linear(d, heads * hd, bias=False)
        self.v_proj = nn.Linear(d, heads * hd, bias=False)

    def mf_context(self, y_prev: torch.Tensor | None, batch_shape, dtype: torch.dtype):
        """Context keys/values from the previous block's last SSM outputs ``y_prev`` `(..., S, Ds)` (None: block 0)."""
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
        first = self.first_context(layer_cache.mf_last if continued else None, positions == doc_start, bsz, xn.dtype)
        rest = self.mf_context(y_end[:, :-1], (bsz, nb - 1), xn.dtype)
        ctx_k, ctx_v = (torch.cat([f[:, None].to(r.dtype), r], 1) for f, r in zip(first, rest))
        if fill_cache:
            lens = fill_ssm_state(ssm, z, lengths, state0, layer_cache)
            rows, blk = torch.arange(bsz, device=z.device), ((lens - 1) // w).clamp(min=0)
            # mf_last: the output at the last token if it ends a block (needed at the next block start)
            last = y_end[rows, (lens // w - 1).clamp(min=0)].detach()
            layer_cache.set(ctx_k=ctx_k[rows, blk].detach(), ctx_v=ctx_v[rows, blk].detach(), mf_last=last)
        return ctx_k, ctx_v, None, False

    def first_context(self, y_prev, fresh, bsz: int, dtype):
        """A block's context keys/values from ``y_prev`` (None: block 0), the initial ones in ``fresh`` rows."""
        k0, v0 = self.mf_context(None, (bsz,), dtype)
        if y_prev is None:
            return k0, v0
        k, v = self.mf_context(y_prev, (bsz,), dtype)
        fresh = fresh[:, None, None, None]
        return torch.where(fresh, k0.to(k.dtype), k), torch.where(fresh, v0.to(v.dtype), v)

    def step(self, ssm, xn, layer_cache, plan):
        if maybe_any(plan.block_start):  # (blocks count from each row's document start)
            k_new, v_new = self.first_context(layer_cache.mf_last, plan.fresh, xn.shape[0], xn.dtype)
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
CONTEXT_BUILDERS = {"sh": TokenContextStates, "mh": TokenContextStates, "mf": MFContextStates}
