"""The BST cache is a transformers ``Cache``: per-layer classes registered under BST's layer types, built by
transformers' own ``DynamicCache(config=...)`` (what ``generate`` prepares by default), with exact rollback."""

import pytest
import torch
import transformers
from conftest import VARIANTS, make_model, tiny_config
from transformers import CompileConfig, DynamicCache, StaticCache

from modeling_bst import BSTCache, BSTForCausalLM
from modeling_bst.cache_bst import LAYER_CACHE_TYPES, BSTLayerCache
from training.cache_snapshot import cache_to_tensors


GSS = {"gss-hybrid": dict(bst_layer_indices=[], gss_layer_indices=[0, 2])}


def variants():
    return {**VARIANTS, **GSS}


def model_of(variant):
    if variant in GSS:
        return make_model(None, **GSS[variant])
    return make_model(variant)


@pytest.mark.parametrize("variant", list(variants()))
def test_dynamic_cache_of_the_config_is_made_of_bst_layers(variant):
    model = model_of(variant)
    cache = DynamicCache(config=model.config)
    assert [type(layer) for layer in cache.layers] == [LAYER_CACHE_TYPES[t] for t in model.config.layer_types]
    ids = torch.randint(1, 97, (2, 18))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :9], past_key_values=cache, use_cache=True)
        returned = out.past_key_values
        assert returned is cache  # the cache passed in, updated in place
        assert cache.get_seq_length() == 9
        steps = [out.logits]
        for t in range(9, 18):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_a_forward_returns_a_transformers_cache():
    model = make_model("sh-s4")
    out = model(torch.randint(1, 97, (1, 7)), use_cache=True)
    assert isinstance(out.past_key_values, transformers.Cache)


def test_an_empty_dynamic_cache_takes_the_models_layers():
    model = make_model("mf-s4")
    cache = DynamicCache()
    ids = torch.randint(1, 97, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], past_key_values=cache, use_cache=True).logits
        rest = model(ids[:, 6:], past_key_values=cache).logits
    assert all(isinstance(layer, BSTLayerCache) for layer in cache.layers)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "sh-unstruct", "brect", "gss-hybrid"])
def test_generate_builds_the_default_cache_and_equals_no_cache(variant):
    model = model_of(variant)
    assert model._supports_default_dynamic_cache()
    assert "_prepare_cache_for_generation" not in vars(BSTForCausalLM)
    ids = torch.randint(1, 97, (2, 7))
    out = model.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert all(isinstance(layer, BSTLayerCache) for layer in cache.layers)
    assert cache.get_seq_length() == 7 + 9 - 1
    plain = model.generate(ids, max_new_tokens=9, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, plain)


def test_rollback_through_transformers_crop_is_exact():
    model = make_model("sh-s4")
    cache = DynamicCache(config=model.config)
    ids = torch.randint(1, 97, (1, 12))
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        before = cache_to_tensors(cache)
        cache.activate_past_recording()
        model(ids[:, 6:10], past_key_values=cache)
        cache.crop(-4)  # transformers' Cache.crop, layer by layer
        after = cache_to_tensors(cache)
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=0, rtol=0, msg=name)
    assert cache.get_seq_length() == 6


def test_a_cache_of_another_model_is_refused_with_the_reason():
    model = make_model("sh-s4")
    ids = torch.randint(1, 97, (1, 5))
    other = DynamicCache(config=tiny_config(num_hidden_layers=2, bst_layer_indices=[1]))
    with pytest.raises(TypeError, match="one BST cache layer per model layer"):
        model(ids, past_key_values=other)
    wider = BSTCache(tiny_config(hidden_size=64, head_dim=16))
    with pytest.raises(ValueError, match="different model configuration"):
        model(ids, past_key_values=wider)
    attention_only = DynamicCache(config=transformers.LlamaConfig(num_hidden_layers=3))
    with pytest.raises(TypeError, match="DynamicCache with layers"):
        model(ids, past_key_values=attention_only)


def _compile_on_cpu(backend: str):
    config = CompileConfig(fullgraph=False, mode="default", backend=backend)
    config._compile_all_devices = True  # generate compiles only on accelerators unless asked to (transformers' flag)
    return config


@pytest.mark.parametrize(
    "variant, backend",
    [
        ("sh-s4", "aot_eager"),
        pytest.param("sh-s4", "inductor", marks=pytest.mark.slow),
        pytest.param("mf-s4", "inductor", marks=pytest.mark.slow),
        pytest.param("brect", "inductor", marks=pytest.mark.slow),
    ],
)
def test_static_cache_compiles_the_decode_step_in_generate_and_equals_eager(variant, backend):
    """``cache_implementation="static"``: transformers' StaticCache of BST's static twins, compileable, so generate
    compiles its decode step itself (no torch.compile call by the user); greedy output equals eager decoding. The
    default run compiles with ``aot_eager`` (dynamo's graph, functionalised as inductor gets it: seconds); inductor
    itself, whose C++ build of the step takes ~40 s of CPU here, in the slow runs."""
    model = make_model(variant)
    cache = StaticCache(config=model.config, max_cache_len=32)
    assert cache.is_compileable and all(isinstance(layer, BSTLayerCache) for layer in cache.layers)
    ids = torch.randint(1, 97, (2, 7))
    eager = model.generate(ids, max_new_tokens=10, do_sample=False)
    with torch.compiler.config.patch(force_disable_caches=True):
        out = model.generate(
            ids,
            max_new_tokens=10,
            do_sample=False,
            cache_implementation="static",
            compile_config=_compile_on_cpu(backend),
            return_dict_in_generate=True,
        )
    assert hasattr(model, "_compiled_call")  # generate's own compiled forward ran the decode steps
    assert out.past_key_values.is_compileable  # StaticCache: BST's layers, built static
    assert torch.equal(out.sequences, eager)


def test_decode_steps_of_generate_get_no_mask():
    model = make_model("sh-s4")
    mask = torch.ones(1, 5, dtype=torch.long)
    assert model.create_masks_for_generate(attention_mask=mask, is_first_iteration=True) is mask
    assert model.create_masks_for_generate(attention_mask=mask, is_first_iteration=False) is None
