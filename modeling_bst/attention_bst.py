"""The RMS norm module and FlexAttention for ``attn_implementation="flex_attention"``: which calls take it
([`use_flex`]), the kernel, block masks built from a mask's band structure ([`tiled_block_mask`]), the block
self-attention ([`flex_block_attention`]) and the block-diagonal cross-attentions ([`grouped_flex`]) on it."""

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


# -- FlexAttention (attn_implementation="flex_attention") ----------------------------------------------------------
# The full-sequence forms of the block self-attention and of both cross-attentions run as one FlexAttention call over
# the whole sequence: the window / block structure is a ``BlockMask`` whose tiles are derived analytically
# ([`tiled_block_mask`]), row-dependent masks (cached previous block, padding) and the T5 bias are ``mask_mod`` /
# ``score_mod`` functions. Everything else (decode steps, the BRecT state update) stays on SDPA; see
# docs/paper-mapping.md "Attention backends".

FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_flex(module, q: torch.Tensor, dropout: float, *tensors: torch.Tensor) -> bool:
    """Whether a full-sequence attention of ``module`` runs on FlexAttention: ``attn_implementation="flex_attention"``
    and none of what flex cannot do here (dropout; a device without an exact kernel, the CPU; float64; a backward on
    the CPU), else SDPA (same result)."""
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


def flex_kernel(device_type: str):
    """The FlexAttention kernel for ``device_type``: transformers' ``compile_friendly_flex_attention`` on accelerators;
    None on the CPU (torch 2.13's compiled CPU kernel is wrong at some lengths, e.g. every length = 8 mod 16
    measured)."""
    return None if device_type == "cpu" else compile_friendly_flex_attention


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


def flex_block_attention(module, q, k, v, lengths, previous):
    """The block self-attention's full-sequence form on FlexAttention: one call over all queries and keys (after the
    cached block's W keys), the window (bidirectional: the previous / own / next block) as the ``BlockMask``'s band,
    held keys and padding as ``mask_mod`` terms, the scaled T5 bias as a ``score_mod``. ``q``/``k``/``v`` `(B, T, H,
    d)`, ``previous`` ``(k, v, valid)`` or None -> `(B, T, H, d)`; a query without any key gets zeros."""
    cfg = module.config
    bsz, seq_len = q.shape[:2]
    w = cfg.block_len
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
    table = (module.bias(distances).to(q.dtype) * module.scale.to(q.dtype)).t().contiguous()  # (H, n)
    last = table.shape[1] - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - offset - q_idx - lowest).clamp(0, last)]

    block_mask = tiled_block_mask(mask_mod, seq_len, k.shape[1], bands, device, keys_partial)
    return flex(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask, score_mod)
