"""The RMS norm module and the full-sequence attentions on FlexAttention (``attn_implementation="flex_attention"``),
with block masks built from a mask's band structure (docs/architecture.md)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.integrations.flex_attention import compile_friendly_flex_attention
from transformers.utils import logging

from .functional_bst import rms_norm


logger = logging.get_logger(__name__)


class BSTRMSNorm(nn.Module):
    """RMS norm computed in float32 (meliad "LayerNorm": no mean, no bias, learned scale)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_flex(module, q: torch.Tensor, dropout: float, *tensors: torch.Tensor) -> bool:
    """Whether a full-sequence attention runs on FlexAttention (``flex_attention``, an exact kernel, no dropout)."""
    if module.config._attn_implementation != "flex_attention" or dropout > 0:
        return False
    if flex_kernel(q.device.type) is None:
        logger.warning_once(
            f"BST: flex_attention has no exact kernel on {q.device.type} (torch's compiled CPU FlexAttention gives "
            "wrong outputs at some lengths); the full-sequence attention runs on SDPA, with the same result."
        )
        return False
    if q.device.type != "cpu":
        return True
    grads = any(t.requires_grad for t in (q, *tensors)) or any(p.requires_grad for p in module.parameters())
    if q.dtype in FLEX_DTYPES and torch.is_grad_enabled() and grads:
        logger.warning_once("BST: flex_attention has no backward on CPU; attention with gradients runs on SDPA.")
    return q.dtype in FLEX_DTYPES and not (torch.is_grad_enabled() and grads)


def flex_kernel(device_type: str):
    """transformers' ``compile_friendly_flex_attention``; None on the CPU (torch 2.13's is wrong at lengths = 8 mod 16)."""
    return None if device_type == "cpu" else compile_friendly_flex_attention


def flex(module, q, k, v, block_mask, score_mod=None):
    """Unscaled FlexAttention, ``q``/``k``/``v`` `(B, L, H, d)` -> `(B, Lq, H, d)`; a query without keys gets zeros."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kernel = flex_kernel(q.device.type)
    out = kernel(q, k, v, training=module.training, score_mod=score_mod, block_mask=block_mask, scale=1.0)
    return out.transpose(1, 2)


def tiled_block_mask(mask_mod, q_len: int, kv_len: int, bands, device, keys_partial=None, tile: int = 128):
    """The ``BlockMask`` of ``mask_mod`` from the ``bands`` ``(f, g, lo, hi)`` it implies, ``lo <= g(kv) - f(q) <=
    hi`` (``f``/``g`` non-decreasing), and ``keys_partial``, keys it masks per row (docs/architecture.md)."""
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
    return lambda idx: idx - offset


def groups_of(size: int):
    return lambda idx: torch.div(idx, size, rounding_mode="floor")


def grouped_flex(module, q, k, v, q_group: int, kv_group: int, causal_within: str | None = None):
    """Query block ``i // q_group`` over key group ``j // kv_group`` (``causal_within``: ``"inclusive"`` j <= i or
    ``"strict"`` j < i, for ``q_group == kv_group``). ``q`` `(B, T, H, d)`, ``k``/``v`` `(B, S, H, d)`."""
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

    return flex(module, q, k, v, tiled_block_mask(mask_mod, q_len, kv_len, bands, q.device))


def flex_block_attention(module, q, k, v, lengths, previous):
    """The block self-attention over ``q``/``k``/``v`` `(B, T, H, d)` after the cached block ``previous`` ``(k, v,
    valid)`` or None: the window as the band, held keys and padding in ``mask_mod``, the T5 bias as ``score_mod``."""
    cfg, (bsz, seq_len), device = module.config, q.shape[:2], q.device
    w, offset, keys_partial = cfg.block_len, 0, None
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
    distances = torch.arange(lowest, highest + 1, device=device)
    table = (module.bias(distances).to(q.dtype) * module.scale.to(q.dtype)).t().contiguous()  # (H, n)
    last = table.shape[1] - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - offset - q_idx - lowest).clamp(0, last)]

    block_mask = tiled_block_mask(mask_mod, seq_len, k.shape[1], bands, device, keys_partial)
    return flex(module, q, k, v, block_mask, score_mod)
