"""Capturable decode steps (issue #12 "BSTCache pytree", issue #15 "Decode"): ``BSTCache`` is a pytree node whose
context holds no position, so one ``torch.export`` program and one ``torch.compile`` graph serve every decode step,
equal to eager exactly (the step branches on no position in Python: block boundaries are tensor ops)."""

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import DecodeStep, make_model

from modeling_bst import BSTCache
from training.cache_snapshot import cache_to_tensors


# The S4 families of the paper's Table 1 plus a BRecT layer next to MF, and the GSS-Hybrid baseline's SSM layer.
VARIANTS = {
    "sh-s4": {},
    "mh-s4": {},
    "mf-s4": {},
    "slide": {},
    "brect": {},
    "bst-brect": {},
    "gss": dict(bst_layer_indices=[], gss_layer_indices=[0, 2]),
}
PROMPT = 7  # off the block grid (W = 4)
# Tracing a step costs seconds of CPU per variant. The default run traces the variants whose layers and cache parts
# together are every kind there is (block attention, SH, MH, MF with a BRecT layer, GSS, unstruct); those whose layers
# another variant already has (name -> that variant) are traced in the slow run.
TRACED_IN_ANOTHER = {"mf-s4": "bst-brect", "brect": "bst-brect", "slide": "sh-s4", "sh-unstruct": "mf-unstruct"}


def traced_variants(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in TRACED_IN_ANOTHER else n for n in names]


def model_for(variant):
    base = None if variant == "gss" else variant
    return make_model(base, vocab_size=61, **VARIANTS[variant])


def leaves(cache):
    return pytree.tree_flatten(cache)[0]


def prompt(seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 61, (rows, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the rows sit at different positions
    return ids, mask


def assert_caches_equal(got: BSTCache, want: BSTCache):
    got_tree, want_tree = pytree.tree_flatten_with_path(got), pytree.tree_flatten_with_path(want)
    assert got_tree[1] == want_tree[1]
    for (path, a), (_, b) in zip(got_tree[0], want_tree[0]):
        if a is None:
            assert b is None, path
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), pytree.keystr(path)


def test_pytree_leaves_context_and_round_trip():
    model = model_for("bst-brect")
    ids, mask = prompt()
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        flat, spec = pytree.tree_flatten_with_path(cache)
        names = [pytree.keystr(path) for path, _ in flat]
        assert names[:3] == ["['positions']", "['doc_start']", "['seen_tokens']"]
        # Every tensor of the cache is a leaf, named as in to_tensors().
        assert {n[2:-2] for n in names} == set(cache_to_tensors(cache))
        rebuilt = pytree.tree_unflatten([t for _, t in flat], spec)
        assert isinstance(rebuilt, BSTCache)
        assert_caches_equal(rebuilt, cache)
        # Host mirrors are derived from the tensors after an unflatten.
        assert rebuilt.get_seq_length() == cache.get_seq_length() == PROMPT
        assert (
            rebuilt.layers[0].common_position is None and cache.layers[0].common_position is None
        )  # rows differ (padding)
        assert rebuilt.layers[0].docs_on_grid is True
        # A decode step changes leaves only: the structure (the exported program's input spec) stays.
        token = torch.randint(1, 61, (2, 1))
        model(token, past_key_values=cache)
        assert pytree.tree_structure(cache) == spec
        assert int(cache.layers[0].seen) == cache.get_seq_length() == PROMPT + 1
        # The context serialises (torch.export.save) and reads back equal.
        dumped = pytree.treespec_dumps(spec)
        assert pytree.treespec_loads(dumped) == spec


def test_host_mirrors_after_unflatten_match_a_plain_cache():
    model = model_for("sh-s4")
    ids = torch.randint(1, 61, (2, 8))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        flat, spec = pytree.tree_flatten(cache)
        # Copies of the leaves: a step updates a cache's tensors in place, and the two caches step independently.
        rebuilt = pytree.tree_unflatten([t.clone() for t in flat], spec)
        assert (rebuilt.layers[0].seen_tokens, rebuilt.layers[0].common_position, rebuilt.layers[0].docs_on_grid) == (
            8,
            8,
            True,
        )
        # A block-aligned chunk continues on the fast path from both, with equal logits.
        chunk = torch.randint(1, 61, (2, 4))
        want = model(chunk, past_key_values=cache).logits
        got = model(chunk, past_key_values=rebuilt).logits
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("variant", traced_variants(VARIANTS))
def test_one_exported_step_runs_every_position(variant):
    """One ``torch.export`` program of a decode step, run for 2W + 3 consecutive steps (across two block boundaries,
    rows at different positions), equals eager: logits and every cache tensor, exactly."""
    model = model_for(variant)
    w = model.config.block_len
    ids, mask = prompt()
    tokens = torch.randint(1, 61, (2, 2 * w + 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, use_cache=True).past_key_values
        exported = copy.deepcopy(eager)
        program = torch.export.export(DecodeStep(model), (tokens[:, :1], copy.deepcopy(eager)), strict=False)
        step = program.module()
        for t in range(tokens.shape[1]):
            want, eager = DecodeStep(model)(tokens[:, t : t + 1], eager)
            got, exported = step(tokens[:, t : t + 1], exported)
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert_caches_equal(exported, eager)
        assert exported.get_seq_length() == eager.get_seq_length() == PROMPT + tokens.shape[1]


def compiled_decode(model, backend_kwargs, steps):
    """Greedy decode ``steps`` tokens with ``torch.compile(model, **backend_kwargs)`` next to eager; returns the
    largest logit difference and dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, **backend_kwargs)
    ids, mask = prompt()
    worst = 0.0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, use_cache=True).past_key_values
        other = copy.deepcopy(eager)
        token = torch.randint(1, 61, (2, 1), generator=torch.Generator().manual_seed(2))
        for _ in range(steps):
            want = model(token, past_key_values=eager).logits
            got = compiled(token, past_key_values=other).logits
            worst = max(worst, (got - want).abs().max().item())
            token = want[:, -1:].argmax(-1)
        assert other.get_seq_length() == eager.get_seq_length() == PROMPT + steps
    stats = dict(counters["stats"])
    torch._dynamo.reset()
    return worst, stats


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4"])
def test_reduce_overhead_compiled_decode_compiles_once_and_matches_eager(variant):
    """``torch.compile(mode="reduce-overhead")`` (inductor; CUDA graphs where there is a GPU) of the decode step:
    one graph for 2W + 3 steps, logits equal to eager within float32 rounding."""
    model = model_for(variant)
    with torch.compiler.config.patch(force_disable_caches=True):
        worst, stats = compiled_decode(model, dict(mode="reduce-overhead"), 2 * model.config.block_len + 3)
    assert stats["unique_graphs"] == 1, stats
    assert worst < 1e-5


@pytest.mark.parametrize("variant", traced_variants([*VARIANTS, "sh-unstruct", "mf-unstruct"]))
def test_compiled_decode_is_one_graph_equal_to_eager_and_writes_states_in_place(variant):
    """A compiled decode step (``fullgraph``, static shapes, ``aot_eager``: functionalised, the mutations written back
    to the inputs, as inductor does; inductor itself in the slow test above) for 2W + 3 steps across two block
    boundaries: dynamo traces it once (no guard on a position, a block boundary or a state's memory layout), its
    logits and every cache tensor equal eager's exactly, and without gradients every cached state is written in place
    (``cache_bst.assign``): every leaf keeps its memory from the prefill on, eagerly and compiled. CUDA graphs need
    exactly this: a graph may write its inputs in place only at fixed addresses, and its outputs cannot be the next
    replay's inputs (tests/models/bst/test_gpu.py checks the graphs on CUDA). Eager unstruct steps keep their history
    as a moving view into a slack buffer (O(1) a step, not O(history)), so there only the compiled cache keeps its
    addresses."""
    from torch._dynamo.utils import counters

    unstruct = variant.endswith("unstruct")
    model = make_model(variant, vocab_size=61) if unstruct else model_for(variant)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    ids, mask = prompt()
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        twin = copy.deepcopy(cache)
        addresses = [t.data_ptr() for t in leaves(cache)]
        twin_addresses = [t.data_ptr() for t in leaves(twin)]
        before = [t.clone() for t in leaves(cache)]
        token = torch.randint(1, 61, (2, 1), generator=torch.Generator().manual_seed(3))
        for _ in range(2 * model.config.block_len + 3):
            want = model(token, past_key_values=cache).logits
            got = compiled(token, past_key_values=twin).logits
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            token = want[:, -1:].argmax(-1)
        assert unstruct or [t.data_ptr() for t in leaves(cache)] == addresses
        assert [t.data_ptr() for t in leaves(twin)] == twin_addresses
        assert_caches_equal(twin, cache)
        assert twin.get_seq_length() == cache.get_seq_length() == PROMPT + 2 * model.config.block_len + 3
    stats = dict(counters["stats"])
    torch._dynamo.reset()
    assert stats["unique_graphs"] == 1, stats
    changed = [not torch.equal(a, b) for a, b in zip(before, leaves(cache))]
    assert sum(changed) >= len(changed) // 2, "the steps left most states unchanged: nothing was tested"


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect", "gss"])
def test_a_cache_made_under_inference_mode_decodes_outside_it(variant):
    """A prefill under ``torch.inference_mode`` and steps under ``torch.no_grad`` (torch refuses in-place writes to
    inference tensors outside inference mode): the first write of each state goes out of place, later ones in place,
    and the logits equal those of a cache made under ``no_grad``."""
    model = model_for(variant)
    ids, mask = prompt()
    with torch.inference_mode():
        frozen = model(ids, attention_mask=mask, use_cache=True).past_key_values
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, use_cache=True).past_key_values
        token = torch.randint(1, 61, (2, 1), generator=torch.Generator().manual_seed(4))
        for _ in range(2 * model.config.block_len + 1):
            want = model(token, past_key_values=plain).logits
            got = model(token, past_key_values=frozen).logits
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            token = want[:, -1:].argmax(-1)
