"""BSTCache's typed per-layer parts: which layer has which, saved names, save/load round trip, older saved caches."""

import torch
from conftest import tiny_config

from modeling_bst import BSTCache, BSTForCausalLM
from modeling_bst.cache_bst import (
    AttentionCache,
    BlockContextCache,
    RecurrentStateCache,
    SSMStateCache,
    TokenContextCache,
)


def model_with_every_layer_type(context_mode="sh"):
    config = tiny_config(
        vocab_size=61,
        num_hidden_layers=4,
        layer_types=["bst_context", "bst_block", "bst_recurrent", "bst_gss"],
        bst_layer_indices=None,
        context_mode=context_mode,
    )
    torch.manual_seed(0)
    return BSTForCausalLM(config).double().eval()


def test_each_layer_type_gets_its_typed_parts():
    for mode, context_cls in (("sh", TokenContextCache), ("mf", BlockContextCache)):
        cache = BSTCache(model_with_every_layer_type(mode).config, 2)
        bst, block, recurrent, gss = cache.layers
        assert isinstance(bst.attention, AttentionCache) and isinstance(bst.ssm, SSMStateCache)
        assert isinstance(bst.context, context_cls) and bst.recurrent is None
        assert block.attention is not None and (block.ssm, block.context, block.recurrent) == (None, None, None)
        assert isinstance(recurrent.recurrent, RecurrentStateCache) and recurrent.ssm is None
        assert gss.attention is None and isinstance(gss.ssm, SSMStateCache)


def test_saved_names_round_trip_and_older_saved_caches_load():
    model = model_with_every_layer_type("mf")
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        cache = model(ids[:, :9], use_cache=True).past_key_values
        tensors = {k: t.clone() for k, t in cache.to_tensors().items()}  # as written to disk
        names = {key.split(".", 2)[2] for key in tensors if key.startswith("layers.")}
        assert names == {"k", "v", "kpos", "ssm_state", "ctx_k", "ctx_v", "mf_last", "rec_state", "rec_k", "rec_v"}
        want = model(ids[:, 9:], past_key_values=cache).logits
        got = model(ids[:, 9:], past_key_values=BSTCache.from_tensors(model.config, tensors)).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        # Saved by the previous layout: the S4D state as a real view, no seen_tokens.
        old = {k: (torch.view_as_real(t) if t.is_complex() else t) for k, t in tensors.items() if k != "seen_tokens"}
        loaded = BSTCache.from_tensors(model.config, old)
        assert loaded.get_seq_length() == 9 and loaded.layers[0].ssm.state.is_complex()
        torch.testing.assert_close(model(ids[:, 9:], past_key_values=loaded).logits, want, atol=0, rtol=0)
