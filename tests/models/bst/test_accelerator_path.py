"""The accelerator code path (issue #44) computes what the CPU path computes.

On a GPU the model takes other forms than on the CPU: the causal block self-attention and the cross-attention in one
call per layer (queries in windows of W instead of W / 4), the learned T5 bias through SDPA (CUDA's kernel returns its
gradient) instead of the written-out math attention, no host reads of tensor values. ``accelerator_code_path()``
makes CPU tensors take that path, so it is checked here in float64 against the CPU path: logits and every gradient,
fresh and continued sequences, every variant. The stacked q/k/v projection falls back to the modules where they are
wrapped or hooked (PEFT, quantisation), and the constants kept between forwards follow device and dtype.
"""

import pytest
import torch
from conftest import VARIANTS, make_model

from modeling_bst import BSTCache
from modeling_bst.utils_bst import accelerator_code_path, on_accelerator


CAUSAL = [v for v in VARIANTS if v != "trsf-xl"] + ["trsf-xl"]


def logits_and_grads(model, ids, labels=True):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels else None)
    loss = out.loss if labels else out.logits.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("variant", CAUSAL)
def test_accelerator_path_equals_cpu_path_in_float64(variant):
    model = make_model(variant, dtype=torch.float64, block_len=8, attention_query_chunk=None).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    ref_logits, ref_grads = logits_and_grads(model, ids)
    with accelerator_code_path():
        assert on_accelerator(ids)
        logits, grads = logits_and_grads(model, ids)
    assert not on_accelerator(ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-11)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
def test_windowed_attention_is_the_same_for_every_query_chunk(chunk):
    """Windows of c queries over the W + c keys they reach (c = W: one window per block) give the same numbers."""
    ref = make_model("slide", dtype=torch.float64, block_len=8, attention_query_chunk=8).train()
    model = make_model("slide", dtype=torch.float64, block_len=8, attention_query_chunk=chunk).train()
    ids = torch.randint(0, ref.config.vocab_size, (2, 40))
    ref_logits, ref_grads = logits_and_grads(ref, ids)
    logits, grads = logits_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-11)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "slide", "brect"])
def test_continued_sequence_on_the_accelerator_path(variant):
    """A block-aligned chunk continuing a cache (the previous block partly held: left padding) gives the same
    logits on both paths; the first query of a row without a held previous key gets zeros on both."""
    model = make_model(variant, dtype=torch.float64, block_len=8)
    ids = torch.randint(1, model.config.vocab_size, (2, 32))
    mask = torch.ones_like(ids[:, :12])
    mask[1, :7] = 0  # row 1: left padding inside the first chunk's last block
    outs = []
    for accel in (False, True):
        with accelerator_code_path(accel), torch.no_grad():
            cache = BSTCache(model.config)
            model(input_ids=ids[:, :12], attention_mask=mask, past_key_values=cache, use_cache=True)
            full_mask = torch.cat([mask, torch.ones_like(ids[:, 12:])], 1)
            outs.append(model(input_ids=ids[:, 12:], attention_mask=full_mask, past_key_values=cache).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-11)


def test_hooked_projection_runs_as_a_module():
    """A wrapped or hooked q/k/v projection is called (its hook runs, its effect is in the output), so adapters
    and quantised layers are never bypassed by the stacked matmul."""
    model = make_model("slide", dtype=torch.float64, block_len=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    calls = []

    def double(module, args, output):
        calls.append(module)
        return output * 2

    attn = model.model.layers[0].self_attn
    handle = attn.k_proj.register_forward_hook(double)
    with torch.no_grad():
        hooked = model(input_ids=ids).logits
    handle.remove()
    assert calls == [attn.k_proj]
    # keys are L2-normalised, so doubling them changes nothing; values are not: hook v_proj instead
    torch.testing.assert_close(hooked, before)
    handle = attn.v_proj.register_forward_hook(double)
    with torch.no_grad():
        changed = model(input_ids=ids).logits
    handle.remove()
    assert not torch.allclose(changed, before)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)


def test_kept_constants_follow_dtype_and_device_changes():
    """The index maps and masks kept between forwards are keyed by device and dtype: a model converted after a
    forward gives the converted model's numbers."""
    model = make_model("sh-s4", dtype=torch.float32, block_len=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        model(input_ids=ids)
        model.double()
        logits = model(input_ids=ids).logits
    fresh = make_model("sh-s4", dtype=torch.float64, block_len=8)
    with torch.no_grad():
        torch.testing.assert_close(logits, fresh(input_ids=ids).logits, rtol=0, atol=1e-12)
