"""Segment streaming with a cache (Transformer-XL / BRecT training and evaluation) and per-row document resets."""

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTCache, BSTForCausalLM


VARIANTS = {
    "slide": dict(bst_layer_indices=[]),
    "brect": dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
    "sh-s4": dict(context_mode="sh"),
    "mh-s4": dict(context_mode="mh"),
    "mf-s4": dict(context_mode="mf"),
    "sh-unstruct": dict(context_mode="sh", ssm_kind="unstruct"),
    "mf-unstruct": dict(context_mode="mf", ssm_kind="unstruct"),
    "mixed": dict(bst_layer_indices=[0], recurrent_layer_indices=[2], context_mode="mf"),
}


def make_model(**overrides):
    torch.manual_seed(0)
    return BSTForCausalLM(tiny_config(**{"vocab_size": 61, **overrides})).double().eval()


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("segment", [4, 8], ids=["seg4", "seg8"])
def test_streamed_segments_with_reset_equal_documents_alone(variant, segment):
    model = make_model(**VARIANTS[variant])
    torch.manual_seed(1)
    doc_a, doc_b, doc_c = (torch.randint(0, 61, (n,)) for n in (16, 8, 24))
    row0 = torch.cat([doc_a, doc_b])  # a new document starts at position 16 in row 0
    stream = torch.stack([row0, doc_c])
    with torch.no_grad():
        ref_a = model(doc_a[None]).logits[0]
        ref_b = model(doc_b[None]).logits[0]
        ref_c = model(doc_c[None]).logits[0]
        cache, outs = None, []
        for start in range(0, 24, segment):
            if cache is not None and start == 16:
                cache.reset_rows(torch.tensor([True, False]))
            out = model(stream[:, start : start + segment], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            outs.append(out.logits)
    logits = torch.cat(outs, 1)
    torch.testing.assert_close(logits[0, :16], ref_a, atol=1e-9, rtol=0)
    torch.testing.assert_close(logits[0, 16:], ref_b, atol=1e-9, rtol=0)
    torch.testing.assert_close(logits[1], ref_c, atol=1e-9, rtol=0)


@pytest.mark.parametrize("variant", ["sh-s4", "brect", "mf-s4"])
def test_reset_off_the_block_grid_is_stepped_exactly(variant):
    model = make_model(**VARIANTS[variant])
    torch.manual_seed(2)
    first, second = torch.randint(0, 61, (1, 6)), torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        ref = model(second).logits
        cache = model(first, use_cache=True).past_key_values
        cache.reset_rows(torch.tensor([True]))
        out = model(second, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)


def test_training_stream_detaches_cache_and_backpropagates():
    model = make_model(**VARIANTS["brect"]).train()
    x = torch.randint(0, 61, (2, 16))
    out = model(x[:, :8], labels=x[:, :8], use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, BSTCache)
    assert all(not t.requires_grad for layer in cache.layers for _, t in layer.tensors())
    out2 = model(x[:, 8:], labels=x[:, 8:], past_key_values=cache, use_cache=True)
    out2.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
