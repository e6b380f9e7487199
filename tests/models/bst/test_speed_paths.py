"""Speed paths must stay exact: query-chunked window attention, kernel spectra memoised across evaluation forwards,
per-step constants memoised for a decoding run, ring buffers written in place while decoding."""

import pytest
import torch
from conftest import SEQ_LEN, VARIANTS, make_model
from huggingface_hub.errors import StrictDataclassError

from modeling_bst.ssm_bst import S4DKernel, UnstructFilter


def ssm_modules(model):
    return [m for m in model.modules() if isinstance(m, (S4DKernel, UnstructFilter))]


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-unstruct", "sh-unstruct"])
def test_spectrum_memo_is_reused_and_follows_parameter_edits(variant):
    model = make_model(variant, dtype=torch.float64)
    ids = torch.randint(0, 97, (2, SEQ_LEN))
    with torch.no_grad():
        first = model(ids).logits
        memos = [m.__dict__.get("_spectrum_memo") for m in ssm_modules(model)]
        assert all(memo is not None for memo in memos)
        again = model(ids).logits
        assert all(m.__dict__["_spectrum_memo"] is memo for m, memo in zip(ssm_modules(model), memos))
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        # An edit that bypasses autograd's version counter must still invalidate the memo.
        for m in ssm_modules(model):
            param = m.C if isinstance(m, S4DKernel) else m.bias
            param.data.mul_(1.5)
        edited = model(ids).logits
        model.train()  # dropout is 0: train mode computes everything afresh, no memo
        fresh = model(ids).logits
    assert not torch.allclose(edited, first)
    torch.testing.assert_close(edited, fresh, rtol=0, atol=1e-12)


def test_spectrum_memo_not_used_when_gradients_flow():
    model = make_model("sh-s4")
    ids = torch.randint(0, 97, (1, SEQ_LEN))
    with torch.no_grad():
        model(ids)  # fills the memo
    model(ids, labels=ids).loss.backward()  # eval mode, but gradients enabled
    kernel = ssm_modules(model)[0]
    assert kernel.log_dt.grad is not None and kernel.log_dt.grad.abs().sum() > 0
    assert kernel.C.grad is not None and kernel.C.grad.abs().sum() > 0


def decoded_one_token(variant):
    """A float64 model of ``variant`` after a prefill and one decoding step: (model, layer 0, its cache)."""
    model = make_model(variant, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache = model(ids[:, :1], past_key_values=cache, use_cache=True).past_key_values
    return model, model.model.layers[0], cache.layers[0]


def test_step_memos_follow_parameter_edits():
    model, layer, layer_cache = decoded_one_token("sh-s4")
    with torch.no_grad():
        memo = model.model.step_memo
        assert {(id(layer.ssm), "ssm"), (id(layer.self_attn), "bias")} <= set(memo)
        layer.self_attn.relative_bias.weight.data.add_(0.25)
        layer.ssm.log_dt.data.add_(0.1)
        table = layer.self_attn.step_bias_table(memo, torch.float64)[:, :-1]
        constants = layer.context.step_constants(layer.ssm, memo)
        # Reference: computed without any memo.
        distances = -torch.arange(layer.self_attn.ring)
        expected = (layer.self_attn.bias(distances) * layer.self_attn.scale).t()
        torch.testing.assert_close(table, expected, rtol=0, atol=0)
        for got, want in zip(constants, layer.ssm.step_constants()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_step_with_gradients_writes_cache_out_of_place():
    model = make_model("sh-s4")
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    before = cache.layers[0].k.clone()
    held = cache.layers[0].k
    out = model(ids[:, :1], past_key_values=cache, use_cache=True)
    out.logits.sum().backward()
    assert model.model.layers[0].self_attn.k_proj.weight.grad is not None
    assert cache.layers[0].k.requires_grad and cache.layers[0].k is not held
    torch.testing.assert_close(held, before, rtol=0, atol=0)  # the old buffer was not written under autograd


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_query_chunked_window_attention_is_exact(variant):
    """Chunks of c queries over the W + c keys they reach == one call per block, forward, gradients and decoding."""
    block_len = VARIANTS[variant].get("block_len", 4)
    chunk = 1 if block_len == 4 else 6
    whole = make_model(variant, dtype=torch.float64, attention_query_chunk=block_len)
    chunked = make_model(variant, dtype=torch.float64, attention_query_chunk=chunk)
    chunked.load_state_dict(whole.state_dict())
    seq_len = max(SEQ_LEN, 2 * block_len + 3)
    ids = torch.randint(0, 97, (2, seq_len))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    for model in (whole, chunked):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    torch.testing.assert_close(
        chunked(ids, attention_mask=mask).logits, whole(ids, attention_mask=mask).logits, rtol=0, atol=1e-12
    )
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-11, msg=name)
    with torch.no_grad():
        ref = whole(ids).logits
        # Prefill, a block-aligned chunk continued in parallel form, then token by token.
        cut = 2 * block_len
        cache = chunked(ids[:, :block_len], use_cache=True).past_key_values
        parts = [chunked(ids[:, :block_len]).logits]
        out = chunked(ids[:, block_len:cut], past_key_values=cache, use_cache=True)
        parts.append(out.logits)
        for t in range(cut, seq_len):
            out = chunked(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=0, atol=1e-10)


def test_default_query_chunk_follows_the_block_length():
    from conftest import tiny_config

    assert tiny_config(block_len=512).resolved_attention_query_chunk == 128
    assert tiny_config(block_len=128).resolved_attention_query_chunk == 64
    assert tiny_config(block_len=4).resolved_attention_query_chunk == 4
    assert tiny_config(block_len=4, attention_query_chunk=2).resolved_attention_query_chunk == 2
    with pytest.raises(StrictDataclassError, match="attention_query_chunk"):
        tiny_config(block_len=4, attention_query_chunk=3)
    with pytest.raises(StrictDataclassError, match="attention_query_chunk"):
        tiny_config(block_len=4, attention_query_chunk=0)


def test_unstruct_step_taps_follow_parameter_edits():
    model, layer, layer_cache = decoded_one_token("sh-unstruct")
    with torch.no_grad():
        assert (id(layer.ssm), "ssm") in model.model.step_memo
        ssm = layer.ssm
        ssm.out.weight.data.mul_(-2.0)
        expected = ssm.step_constants()  # computed afresh
        torch.testing.assert_close(
            layer.context.step_constants(layer.ssm, model.model.step_memo), expected, rtol=0, atol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_out_attention_equals_sdpa(dtype):
    """The written-out path for a mask that needs a gradient computes what SDPA computes (its math path), in the
    output and in every gradient, the mask's included; bf16 is upcast the same way."""
    import torch.nn.functional as F

    from modeling_bst.modeling_bst import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, n, 16, generator=gen, dtype=dtype, requires_grad=True) for n in (8, 24, 24))
    mask = torch.randn(1, 4, 8, 24, generator=gen, dtype=dtype)
    mask[..., -5:] = torch.finfo(dtype).min  # finite masked keys, as the block masks have
    mask.requires_grad_(True)
    grad = torch.randn(3, 8, 4, 16, generator=gen, dtype=dtype)
    ours = eager_attention_forward(None, q, k, v, mask)[0]
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0).transpose(1, 2)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=1e-2)
    torch.testing.assert_close(ours, sdpa, **tol)
    for a, b in zip(
        torch.autograd.grad(ours, (q, k, v, mask), grad), torch.autograd.grad(sdpa, (q, k, v, mask), grad)
    ):
        torch.testing.assert_close(a, b, **tol)


def test_training_block_attention_takes_the_learned_mask_path_with_sdpa_gradients(monkeypatch):
    """Training a Slide/BST model on SDPA writes the attention out (``eager_attention_forward``, for the mask's
    gradient) and gives the same loss and gradients as the model on eager attention (the reference)."""
    import modeling_bst.modeling_bst as mb

    calls = []
    original = mb.eager_attention_forward
    monkeypatch.setattr(mb, "eager_attention_forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.randint(0, 97, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    grads = {}
    for implementation in ("sdpa", "eager"):
        calls.clear()
        model = make_model("sh-s4", dtype=torch.float64, attn_implementation=implementation)
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[implementation] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        assert calls, f"{implementation} training did not write the attention out"
    torch.testing.assert_close(grads["sdpa"][0], grads["eager"][0], rtol=0, atol=1e-12)
    for name, g in grads["eager"][1].items():
        torch.testing.assert_close(grads["sdpa"][1][name], g, rtol=0, atol=1e-10, msg=name)


def test_logit_scale_is_applied_once_with_or_without_a_head_bias():
    model = make_model("sh-s4", dtype=torch.float64)
    ids = torch.randint(0, 97, (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    scale = model.config.logit_scale
    assert scale != 1.0
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        expected = model.lm_head(hidden) * scale
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-12)
        biased = torch.nn.Linear(hidden.shape[-1], model.config.vocab_size, bias=True, dtype=torch.float64)
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.normal_()
        model.set_output_embeddings(biased)
        torch.testing.assert_close(model(ids).logits, biased(hidden) * scale, rtol=0, atol=1e-12)
