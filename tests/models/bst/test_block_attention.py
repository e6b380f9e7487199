"""The full-sequence form of the block self-attention (``BSTBlockSelfAttention.forward``) against a per-query
reference: every query over exactly the keys its window reaches (the cached previous block where given, padding of
a bidirectional model masked), T5 bias times the learned scale added to the logits, zeros for a query without keys.

Covers every case of the form: fresh, continued from a fully / partly / not held cached block, causal with and
without ``attend_self``, bidirectional with padding, query chunks, eager and SDPA, and the weights returned with
``output_attentions`` laid out by key column.
"""

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTForCausalLM
from modeling_bst.functional_bst import window_valid


W, T, B = 4, 16, 3


def self_attention(implementation="sdpa", **overrides):
    config = tiny_config(block_len=W, bst_layer_indices=[], num_hidden_layers=1, **overrides)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = BSTForCausalLM(config).double().eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.relative_bias.weight.normal_(0.0, 1.0)  # a bias that matters
        attn.scale.uniform_(0.5, 2.0)
    return attn


def inputs(attn, seed=1):
    g = torch.Generator().manual_seed(seed)
    heads, hd = attn.config.num_attention_heads, attn.config.head_dim
    return [torch.randn(B, T, heads, hd, generator=g, dtype=torch.float64) for _ in range(3)]


def previous_block(attn, held):
    """A cached previous block ``(k, v, valid)``: every key held, some rows partly held, or none held."""
    g = torch.Generator().manual_seed(2)
    heads, hd = attn.config.num_attention_heads, attn.config.head_dim
    k, v = (torch.randn(B, W, heads, hd, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(B, W, dtype=torch.bool)
    if held == "partly":
        valid[1, :2] = False  # a row whose document started inside the previous block
        valid[2] = False  # a row whose document starts here
    elif held == "none":
        valid[:] = False
    return k, v, valid


def reference(attn, q, k, v, previous=None, lengths=None):
    """Output `(B, T, H, d)` and weights `(B, H, T, K)` by key column, one query at a time."""
    cfg = attn.config
    key_pos = torch.arange(T)
    key_ok = torch.ones(B, T, dtype=torch.bool)
    if previous is not None:
        k, v = torch.cat([previous[0], k], 1), torch.cat([previous[1], v], 1)
        key_pos = torch.arange(-W, T)
        key_ok = torch.cat([previous[2], key_ok], 1)
    if lengths is not None:
        key_ok = key_ok & (key_pos[None] < lengths[:, None])
    out = torch.zeros_like(q)
    weights = torch.zeros(B, q.shape[2], T, k.shape[1], dtype=q.dtype)
    for p in range(T):
        rel = key_pos - p
        if cfg.bidirectional:
            window = (torch.div(key_pos, W, rounding_mode="floor") - p // W).abs() <= 1
        else:
            window = window_valid(rel, attn.block_len, attn.config.attend_self)
        ok = window[None] & key_ok  # (B, K)
        bias = (attn.bias(rel) * attn.scale).t()  # (H, K)
        logits = torch.einsum("bhd,bkhd->bhk", q[:, p], k) + bias
        probs = torch.softmax(logits.masked_fill(~ok[:, None], float("-inf")), -1).nan_to_num(0.0)
        weights[:, :, p] = probs
        out[:, p] = torch.einsum("bhk,bkhd->bhd", probs, v)
    return out, weights


def run(attn, q, k, v, previous=None, lengths=None, weights=0):
    with torch.no_grad():
        out, probs = attn(q, k, v, previous, lengths, weights=weights)
    return out.view(q.shape), probs


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("chunk", [1, 2, W])
@pytest.mark.parametrize("attend_self", [False, True])
@pytest.mark.parametrize("held", [None, "all", "partly", "none"])
def test_causal_form_equals_the_reference(implementation, chunk, attend_self, held):
    attn = self_attention(implementation, attend_self=attend_self, attention_query_chunk=chunk)
    q, k, v = inputs(attn)
    previous = None if held is None else previous_block(attn, held)
    expected, _ = reference(attn, q, k, v, previous)
    out, probs = run(attn, q, k, v, previous)
    assert probs is None
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("lengths", [None, [T, 9, 1]])
def test_bidirectional_form_equals_the_reference(implementation, lengths):
    attn = self_attention(implementation, bidirectional=True)
    q, k, v = inputs(attn)
    lengths = None if lengths is None else torch.tensor(lengths)
    expected, _ = reference(attn, q, k, v, lengths=lengths)
    out, _ = run(attn, q, k, v, lengths=lengths)
    real = torch.ones(B, T, dtype=torch.bool) if lengths is None else torch.arange(T)[None] < lengths[:, None]
    torch.testing.assert_close(out[real], expected[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "overrides, held",
    [
        (dict(attend_self=False), None),
        (dict(attend_self=True), "partly"),
        (dict(attend_self=False), "none"),
        (dict(bidirectional=True), None),
    ],
)
def test_weights_by_key_column_equal_the_reference(overrides, held):
    """``output_attentions``: the weights `(B, H, T, K)` (K = T, or W + T after a cached block) the output is made
    of, and the same output as without weights."""
    attn = self_attention("eager", attention_query_chunk=2, **overrides)
    q, k, v = inputs(attn)
    previous = None if held is None else previous_block(attn, held)
    expected_out, expected_weights = reference(attn, q, k, v, previous)
    out, probs = run(attn, q, k, v, previous, weights=T)
    assert probs.shape == (B, attn.config.num_attention_heads, T, T + (0 if previous is None else W))
    torch.testing.assert_close(probs, expected_weights, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    without, _ = run(attn, q, k, v, previous)
    torch.testing.assert_close(out, without, rtol=1e-10, atol=1e-10)


def test_weights_cover_the_leading_positions():
    attn = self_attention("eager")
    q, k, v = inputs(attn)
    with torch.no_grad():
        _, full = attn(q, k, v, weights=T)
        _, leading = attn(q, k, v, weights=T - 3)
    assert leading.shape[-2:] == (T - 3, T - 3)
    torch.testing.assert_close(leading, full[:, :, : T - 3, : T - 3], rtol=0, atol=0)
