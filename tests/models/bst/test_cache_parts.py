"""A BST cache layer per layer type: which states each holds, saved names, snapshot save/load round trip."""

import torch
from conftest import tiny_config

from modeling_bst import BSTCache, BSTForCausalLM
from training.cache_snapshot import cache_from_tensors, cache_to_tensors


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


def test_each_layer_type_holds_its_states():
    for mode, context in (("sh", ("ctx_k", "ctx_v", "ctx_pos")), ("mf", ("ctx_k", "ctx_v", "mf_last"))):
        cache = BSTCache(model_with_every_layer_type(mode).config, 2)
        bst, block, recurrent, gss = cache.layers
        assert bst.names == ("k", "v", "kpos", "ssm_state", *context)
        assert block.names == ("k", "v", "kpos")
        assert recurrent.names == ("k", "v", "kpos", "rec_state", "rec_k", "rec_v")
        assert gss.names == ("ssm_state",)


def test_saved_names_round_trip():
    model = model_with_every_layer_type("mf")
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        cache = model(ids[:, :9], use_cache=True).past_key_values
        tensors = {k: t.clone() for k, t in cache_to_tensors(cache).items()}  # as written to disk
        names = {key.split(".", 2)[2] for key in tensors if key.startswith("layers.")}
        assert names == {"k", "v", "kpos", "ssm_state", "ctx_k", "ctx_v", "mf_last", "rec_state", "rec_k", "rec_v"}
        want = model(ids[:, 9:], past_key_values=cache).logits
        loaded = cache_from_tensors(model.config, tensors)
        assert loaded.get_seq_length() == 9 and loaded.layers[0].ssm_state.shape[-1] == 2  # (B, Ds, N2, 2)
        got = model(ids[:, 9:], past_key_values=loaded).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_snapshot_with_a_complex_s4d_state_loads_as_pairs():
    """Snapshots written before the S4D state became real pairs hold it complex `(B, Ds, N2)`: loaded as pairs."""
    model = model_with_every_layer_type("sh")
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        tensors = cache_to_tensors(model(ids[:, :7], use_cache=True).past_key_values)
        want = model(ids[:, 7:], past_key_values=cache_from_tensors(model.config, tensors)).logits
        old = {
            k: torch.view_as_complex(t) if k.endswith("ssm_state") and t.dim() == 4 else t for k, t in tensors.items()
        }
        assert sum(t.is_complex() for t in old.values()) == 2  # the BST and GSS layers' S4D states
        got = model(ids[:, 7:], past_key_values=cache_from_tensors(model.config, old)).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)
