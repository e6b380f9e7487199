"""Where the paper is silent, meliad's choices as config fields (issue #12): final dropout before the logits, MF
context-ID embeddings after the norm, truncated-normal init with the variance correction; and what the SSM reads
(``ssm_input``, an ablation of issue #13)."""

import math

import pytest
import torch
from conftest import SEQ_LEN, make_model, tiny_config

from modeling_bst import BSTForCausalLM


def _lm_head_inputs(model, ids):
    seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model(ids, use_cache=False)
    hook.remove()
    return seen[0]


def test_final_dropout_before_the_logits():
    assert tiny_config(dropout=0.1).resolved_final_dropout == 0.1  # default: the model's dropout (meliad)
    ids = torch.randint(0, 97, (4, 16))
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(dropout=0.0, attention_dropout=0.0, final_dropout=0.5)).train()
    zeros = (_lm_head_inputs(model, ids) == 0).float().mean()
    assert 0.4 < zeros < 0.6
    assert (_lm_head_inputs(model.eval(), ids) != 0).all()
    model.final_dropout.p = 0.0
    assert (_lm_head_inputs(model.train(), ids) != 0).all()


def test_mf_context_ids_before_or_after_the_norm():
    torch.manual_seed(0)
    for after in (False, True):
        model = BSTForCausalLM(tiny_config(context_mode="mf", mf_context_ids_after_norm=after)).double()
        ctx = model.model.layers[0].context
        y = torch.randn(2, ctx.up_proj.shape[0], ctx.up_proj.shape[1], dtype=torch.float64)
        lifted = torch.einsum("bsc,scd->bsd", y, ctx.up_proj)
        c = ctx.norm(lifted) + ctx.context_ids if after else ctx.norm(lifted + ctx.context_ids)
        k, v = ctx.mf_context(y, (2,), torch.float64)
        torch.testing.assert_close(v, ctx.v_proj(c).unflatten(-1, v.shape[-2:]), atol=1e-12, rtol=0)


def test_truncated_normal_init_has_variance_one_over_fan_in():
    for corrected in (True, False):
        torch.manual_seed(0)
        config = tiny_config(hidden_size=256, intermediate_size=1024, init_truncation_correction=corrected)
        weight = BSTForCausalLM(config).model.layers[1].mlp.down_proj.weight  # fan_in 1024, 256k samples
        ratio = weight.std().item() * math.sqrt(1024)
        assert abs(ratio - (1.0 if corrected else 0.8796)) < 0.01, ratio
        assert weight.abs().max() <= 2 * (1.0 if not corrected else 1 / 0.8796) / math.sqrt(1024) + 1e-6


def test_mf_independent_filters_step_exactly_and_span_more_than_a_shared_state():
    """MF with one SSM per filter: decoding equals the parallel forward, the block-end fast path equals the FFT path,
    and the S outputs at block ends span more than the N + 1 dimensions per channel a shared state allows."""
    overrides = dict(context_mode="mf", num_context_states=8, ssm_state_size=4, ssm_hidden_size=2)
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(mf_independent_filters=True, **overrides)).double().eval()
    ids = torch.randint(0, 97, (2, 18))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = model(ids[:, :5], use_cache=True).past_key_values
        stepped = torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 18)], 1)
        torch.testing.assert_close(stepped, full[:, 5:], atol=1e-9, rtol=0)
        ranks = {}
        for independent in (False, True):
            torch.manual_seed(0)
            ssm = BSTForCausalLM(tiny_config(mf_independent_filters=independent, **overrides)).double()
            ssm = ssm.model.layers[0].ssm
            z = torch.randn(64, 16, 2, dtype=torch.float64)
            ends = ssm.block_end_outputs(z, 4)  # (64, 4, S, Ds)
            torch.testing.assert_close(ends, ssm(z)[:, 3::4], atol=1e-10, rtol=0)
            sv = torch.linalg.svdvals(ends[:, -1, :, 0])  # samples x S filters, channel 0
            ranks[independent] = int((sv > 1e-9 * sv[0]).sum())
        # A shared state bounds the span by N + 1 = 5 whatever the parameters; independent filters exceed it (at
        # init their dt differ while Lambda and B start equal, so some directions are small but present).
        assert ranks[False] <= 5 < ranks[True], ranks


@pytest.mark.parametrize("context_mode", ["sh", "mf"])
def test_ssm_input_raw_reads_the_layer_input_before_the_norm_and_decodes_exactly(context_mode):
    """``ssm_input="raw"``: a BST layer's SSM reads its input before the RMS norm (its attention still reads the normed
    input); every other layer is unchanged, and decoding equals the parallel forward across block boundaries."""
    ids = torch.randint(0, 97, (2, 21))
    models = {}
    for mode in ("normed", "raw"):
        torch.manual_seed(0)
        models[mode] = BSTForCausalLM(tiny_config(context_mode=context_mode, ssm_input=mode)).double().eval()
    layer = models["raw"].model.layers[0]
    assert layer.layer_type == "bst"
    seen = []
    hook = layer.context.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    embeddings = models["raw"].model.embed_tokens(ids)
    with torch.no_grad():
        models["raw"](ids, use_cache=False)
        hook.remove()
        torch.testing.assert_close(seen[0][:, : ids.shape[1]], embeddings, atol=0, rtol=0)  # not normed
        a, b = (models[m](ids, use_cache=False).logits for m in ("normed", "raw"))
        assert (a - b).abs().max() > 1e-3  # the same weights read another input
        model = models["raw"]
        full = model(ids, use_cache=False).logits
        cache = model(ids[:, :3], use_cache=True).past_key_values
        stepped = torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(3, 21)], 1)
        torch.testing.assert_close(stepped, full[:, 3:], atol=1e-9, rtol=0)


def test_mf_initial_context_in_the_ssm_output_space_is_lifted_and_decodes_exactly():
    """``mf_initial_context="ssm_output"`` (Listing 4): block 0's context is a learned (S, D_s) SSM output, lifted by
    the same projection as every later block's; decoding equals the parallel forward across block boundaries."""
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(context_mode="mf", mf_initial_context="ssm_output")).double().eval()
    ctx = model.model.layers[0].context
    assert ctx.initial_context.shape == ctx.up_proj.shape[:2]  # (S, D_s)
    for got, want in zip(
        ctx.mf_context(None, (2,), torch.float64),
        ctx.mf_context(ctx.initial_context.expand(2, -1, -1), (2,), torch.float64),
    ):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    ids = torch.randint(0, 97, (2, 14))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = model(ids[:, :3], use_cache=True).past_key_values
        stepped = torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(3, 14)], 1)
    torch.testing.assert_close(stepped, full[:, 3:], atol=1e-9, rtol=0)
    assert BSTForCausalLM(tiny_config(context_mode="mf")).model.layers[0].context.initial_context.shape[1] == 32


@pytest.mark.parametrize("meliad", [False, True])
def test_meliad_dropout_placement(meliad):
    """``meliad_dropout``: no dropout on the embeddings nor on the attention output, dropout on the normed context
    states before the cross-attention's K/V projections; the default drops the former and not the latter."""
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(dropout=0.5, meliad_dropout=meliad)).train()
    calls = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.register_forward_hook(lambda m, args, out, name=name: calls.update({name: calls.get(name, 0) + 1}))
    model(torch.randint(0, 97, (2, 8)), use_cache=False)
    layer = "model.layers.0"  # a BST layer of the tiny config
    assert ("model.dropout" in calls) is not meliad
    assert calls[f"{layer}.dropout"] == (2 if meliad else 3)  # normed input, MLP output (+ attention output)
    assert (f"{layer}.context.dropout" in calls) is meliad
    if meliad:
        model.eval()
        with torch.no_grad():  # inactive in evaluation, as every dropout
            a = model(torch.arange(8)[None], use_cache=False).logits
            b = model(torch.arange(8)[None], use_cache=False).logits
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("variant", ["trsf-xl", "brect"])
def test_embedding_dropout_drops_every_streamed_segment(variant):
    """Streamed training (Transformer-XL / BRecT segments continuing the cache) drops the embeddings of every
    segment, not only the first (the default placement; ``meliad_dropout=True`` has none)."""
    model = make_model(variant, dropout=0.5).train()
    seen = []
    model.model.dropout.register_forward_hook(lambda module, args, out: seen.append((args[0].numel(), out)))
    segments = torch.randint(0, 97, (2, 2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    cache = None
    for segment in segments:
        seen.clear()
        out = model(segment, use_cache=True, past_key_values=cache)
        cache = out.past_key_values
        dropped = [o for n, o in seen if n]
        assert dropped and any(bool((o == 0).any()) for o in dropped), "no embedding dropout on this segment"
    assert cache is not None and not cache.layers[0].is_empty
