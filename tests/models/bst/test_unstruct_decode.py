"""Chunked unstruct decoding (issue #15, "unstruct cliff"): an SH/MH unstruct step adds the chunk's pending outputs
(one FFT convolution per M steps) to a dot product over at most M recent inputs, so its cost does not grow with the
position. It must equal the parallel forward (float64, 1e-10) across chunk and block boundaries, for padded rows of
different lengths, document resets, beam reordering, crop, continuation, a saved cache and traced steps."""

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import DecodeStep, make_model

from modeling_bst.cache_bst import BSTContextLayerCache
from modeling_bst.context_bst import BSTContextStates
from modeling_bst.ssm_bst import UnstructFilter
from training.cache_snapshot import cache_from_tensors, cache_to_tensors


CHUNK = 5  # M: small, so that a few dozen steps cross several chunk (and W = 4 block) boundaries
VOCAB = 61
TOL = dict(atol=1e-10, rtol=1e-10)


def unstruct_model(mode="sh", chunk=CHUNK, **overrides):
    model = make_model(f"{mode}-unstruct", dtype=torch.float64, vocab_size=VOCAB, **overrides)
    set_chunk(model, chunk)
    return model


def set_chunk(model, chunk):
    for module in model.modules():
        if isinstance(module, UnstructFilter):
            module.decode_chunk = min(chunk, module.max_len)


def ssm_parts(cache):
    return [layer for layer in cache.layers if getattr(layer, "ssm_state", None) is not None]


def tokens(rows, length, seed):
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def padded_prompt(lengths, seed=0):
    """Left-padded prompt: rows of ``lengths`` real tokens."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    real = tokens(len(lengths), width, seed)
    for r, n in enumerate(lengths):
        ids[r, width - n :], mask[r, width - n :] = real[r, :n], 1
    return ids, mask


@torch.no_grad()
def step_logits(model, cache, new):
    """Decode ``new`` `(B, T)` one token at a time: logits `(B, T, V)` and the cache."""
    out = []
    for t in range(new.shape[1]):
        res = model(new[:, t : t + 1], past_key_values=cache, use_cache=True)
        out.append(res.logits[:, -1])
        cache = res.past_key_values
    return torch.stack(out, 1), cache


@torch.no_grad()
def parallel_logits(model, row_tokens):
    """The parallel forward (no cache) over one row's real tokens `(T,)`: logits `(T, V)`."""
    return model(row_tokens[None], use_cache=False).logits[0]


def check_rows(model, logits, histories):
    """``logits[r]`` are the logits of the last ``logits.shape[1]`` tokens of ``histories[r]``."""
    steps = logits.shape[1]
    for r, hist in enumerate(histories):
        torch.testing.assert_close(logits[r], parallel_logits(model, hist)[-steps:], **TOL)


def padded_decode_case(model, lengths=(23, 9), steps=3 * CHUNK + 4):
    """Prefill a left-padded batch, decode ``steps`` tokens, compare each row with its parallel forward."""
    ids, mask = padded_prompt(lengths)
    new = tokens(len(lengths), steps, seed=1)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    logits, cache = step_logits(model, cache, new)
    rows = [torch.cat([ids[r, mask[r].bool()], new[r]]) for r in range(len(lengths))]
    check_rows(model, logits, rows)
    return cache


@pytest.mark.parametrize("mode", ["sh", "mh"])
def test_chunked_steps_equal_parallel_forward_for_padded_rows(mode):
    """Rows of 23 and 9 prompt tokens (left padding), 19 steps: 4 chunks of M = 5, several W = 4 blocks."""
    model = unstruct_model(mode)
    cache = padded_decode_case(model)
    parts = ssm_parts(cache)
    # The steps ran chunked: every BST layer keeps a (B, C, Ds, M) chunk, the history stays (B, Ds, Lmax).
    cfg = model.config
    assert all(p.pending is not None for p in parts)
    assert all(p.pending.shape == (2, cfg.ssm_output_channels, cfg.ssm_channels, CHUNK) for p in parts)
    assert all(p.ssm_state.shape == (2, cfg.ssm_channels, cfg.max_position_embeddings) for p in parts)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_kernel_chunked_steps_equal_the_direct_dot_product(chunk):
    """``UnstructFilter.step`` with a chunk (FFT sizes of every form, odd ones included: 3, 5, ...) equals the direct
    dot product, from 1 to 40 inputs of a 24-tap filter (inputs leave the history)."""
    config = make_model("sh-unstruct", dtype=torch.float64, max_position_embeddings=24).config
    torch.manual_seed(1)
    ssm = UnstructFilter(3, 2, config).double()
    ssm.reset_positional_features()
    for param in ssm.parameters():
        if param is not ssm.pos_emb:
            torch.nn.init.normal_(param, std=0.5)
    ssm.decode_chunk = chunk
    constants = ssm.step_constants()
    state = ssm.empty_state(2, "cpu")
    direct_state, pending, offset = state.clone(), None, chunk
    for t, z_t in enumerate(torch.randn(40, 2, 3, dtype=torch.float64)):
        if offset == chunk and t > 0:
            n = min(t, ssm.max_len)
            pending, offset = ssm.pending_outputs(state, n, constants), 0
        y, state = ssm.step(z_t, state, constants, pending=None if pending is None else (pending, offset))
        want, direct_state = ssm.step(z_t, direct_state, constants, seen=t + 1)
        torch.testing.assert_close(y, want, **TOL)
        offset += 1


def test_chunked_steps_equal_direct_steps_beyond_the_filter_length():
    """Finite filter (Lmax = 32) and 60 positions: inputs leave the history window inside a chunk; equal to the
    direct dot product (a chunk as long as the filter is never used below Lmax inputs) and to the forward."""
    chunked = unstruct_model("sh", max_position_embeddings=32)
    direct = copy.deepcopy(chunked)
    set_chunk(direct, 10**6)  # M = Lmax: no chunk starts while seen <= Lmax; beyond it one chunk per Lmax steps
    ids = tokens(2, 27, seed=2)
    new = tokens(2, 33, seed=3)
    with torch.no_grad():
        a, _ = step_logits(chunked, chunked(ids, use_cache=True).past_key_values, new)
        b, _ = step_logits(direct, direct(ids, use_cache=True).past_key_values, new)
    torch.testing.assert_close(a, b, **TOL)
    check_rows(chunked, a, [torch.cat([ids[r], new[r]]) for r in range(2)])


def test_mf_keeps_block_end_dot_products():
    """MF needs outputs only at block ends: it never starts a chunk (an FFT per M steps would cost more than one
    dot product per W steps) and stays equal to the forward."""
    model = unstruct_model("mf")
    cache = padded_decode_case(model)
    assert all(p.pending is None for p in ssm_parts(cache))


def test_document_reset_inside_a_chunk():
    """``reset_rows`` mid-chunk: the reset row continues as a fresh document, the other row is unchanged."""
    model = unstruct_model("sh")
    ids = tokens(2, 17, seed=4)
    first, second = tokens(2, 7, seed=5), tokens(2, 13, seed=6)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        _, cache = step_logits(model, cache, first)
        assert all(p.pending_offset not in (0, CHUNK) for p in ssm_parts(cache))  # mid-chunk
        cache.reset_rows(torch.tensor([True, False]))
        logits, cache = step_logits(model, cache, second)
    torch.testing.assert_close(logits[0], parallel_logits(model, second[0]), **TOL)
    torch.testing.assert_close(
        logits[1], parallel_logits(model, torch.cat([ids[1], first[1], second[1]]))[-13:], **TOL
    )


def test_reorder_cache_selects_chunk_rows():
    """Beam search reorders rows mid-chunk: the chunk's rows move with the history."""
    model = unstruct_model("sh")
    ids = tokens(3, 12, seed=7)
    first, second = tokens(3, 8, seed=8), tokens(3, 9, seed=9)
    beam_idx = torch.tensor([2, 2, 0])
    with torch.no_grad():
        _, cache = step_logits(model, model(ids, use_cache=True).past_key_values, first)
        cache.reorder_cache(beam_idx)
        logits, _ = step_logits(model, cache, second)
    hist = torch.cat([ids, first], 1)[beam_idx]
    check_rows(model, logits, [torch.cat([hist[r], second[r]]) for r in range(3)])


def test_beam_search_generate_with_cache_equals_without():
    model = unstruct_model("sh")
    ids = tokens(2, 11, seed=10)
    a = model.generate(ids, max_new_tokens=14, num_beams=3, do_sample=False, pad_token_id=0)
    b = model.generate(ids, max_new_tokens=14, num_beams=3, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("back", [2, 9])
def test_crop_within_and_across_chunks(back):
    """Assisted decoding takes back drafted positions: within the current chunk (2 of its 3 steps) and across two
    chunk starts (9, M = 5); the steps after the crop equal the forward over the kept tokens plus the new ones."""
    model = unstruct_model("sh")
    ids = tokens(2, 14, seed=11)
    drafted, redo = tokens(2, 13, seed=12), tokens(2, 9, seed=13)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache.activate_past_recording()
        _, cache = step_logits(model, cache, drafted)
        assert all(p.pending_offset == 3 for p in ssm_parts(cache))  # chunks start at steps 0, 5 and 10
        cache.crop(-back)
        assert all(p.pending_offset == (1 if back == 2 else 4) for p in ssm_parts(cache))
        logits, _ = step_logits(model, cache, redo)
    kept = drafted[:, : drafted.shape[1] - back]
    check_rows(model, logits, [torch.cat([ids[r], kept[r], redo[r]]) for r in range(2)])


def test_continuation_with_a_chunk_and_from_a_returned_cache():
    """A multi-token chunk after chunked steps (the state is rebuilt: the decoding chunk is dropped), then steps;
    and ``generate`` continued from its returned cache equals one ``generate``."""
    model = unstruct_model("sh")
    ids = tokens(2, 10, seed=14)
    first, block, after = tokens(2, 7, seed=15), tokens(2, 5, seed=16), tokens(2, 8, seed=17)
    with torch.no_grad():
        _, cache = step_logits(model, model(ids, use_cache=True).past_key_values, first)
        cache = model(block, past_key_values=cache, use_cache=True).past_key_values
        logits, _ = step_logits(model, cache, after)
    check_rows(model, logits, [torch.cat([ids[r], first[r], block[r], after[r]]) for r in range(2)])
    once = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    half = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    more = model.generate(
        half.sequences, past_key_values=half.past_key_values, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert torch.equal(more, once)


def test_saved_cache_round_trip_mid_chunk():
    """``to_tensors`` / ``from_tensors`` mid-chunk: the chunk is not saved (derived); the loaded cache starts a new one
    and continues equal to the original cache."""
    model = unstruct_model("sh")
    ids = tokens(2, 13, seed=18)
    first, after = tokens(2, 8, seed=19), tokens(2, 9, seed=20)
    with torch.no_grad():
        _, cache = step_logits(model, model(ids, use_cache=True).past_key_values, first)
        saved = {k: t.clone() for k, t in cache_to_tensors(cache).items()}
        assert not any("pending" in k for k in saved)
        loaded = cache_from_tensors(model.config, saved)
        assert all(p.pending is None for p in ssm_parts(loaded))
        want, _ = step_logits(model, cache, after)
        got, _ = step_logits(model, loaded, after)
    torch.testing.assert_close(got, want, **TOL)
    check_rows(model, got, [torch.cat([ids[r], first[r], after[r]]) for r in range(2)])


def test_traced_steps_take_the_direct_form_and_drop_the_chunk():
    """Eager chunked steps, then ``torch.compile`` (dynamo, eager backend) steps on the same cache object and
    ``torch.export`` steps on the returned caches, then eager steps again: all equal to the forward. A traced step
    does not advance the chunk, so it drops it: the eager steps after it start a new chunk."""
    model = unstruct_model("sh")
    ids = tokens(2, 12, seed=21)
    new = tokens(2, 24, seed=22)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    logits = []
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        eager_part, cache = step_logits(model, cache, new[:, :7])  # mid-chunk
        logits.append(eager_part)
        for t in range(7, 10):
            out = compiled(new[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1:])
            assert all(p.pending is None for p in ssm_parts(cache))
        program = torch.export.export(DecodeStep(model), (new[:, 10:11], copy.deepcopy(cache)), strict=False)
        step = program.module()
        for t in range(10, 13):
            out, cache = step(new[:, t : t + 1], cache)
            logits.append(out[:, -1:])
        assert all(p.pending is None for p in ssm_parts(cache))
        eager_part, cache = step_logits(model, cache, new[:, 13:])
        logits.append(eager_part)
        assert all(p.pending is not None for p in ssm_parts(cache))
    torch._dynamo.reset()
    check_rows(model, torch.cat(logits, 1), [torch.cat([ids[r], new[r]]) for r in range(2)])


def test_pending_is_not_a_pytree_leaf():
    model = unstruct_model("sh")
    with torch.no_grad():
        _, cache = step_logits(model, model(tokens(2, 12, seed=23), use_cache=True).past_key_values, tokens(2, 3, 24))
    names = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(cache)[0]]
    assert {n[2:-2] for n in names} == set(cache_to_tensors(cache))
    rebuilt = pytree.tree_unflatten(*pytree.tree_flatten(cache))
    assert all(p.pending is None for p in ssm_parts(rebuilt))


def test_history_is_not_copied_per_step():
    """The eager history stays a view into its slack buffer (``append_history``): a step writes one column."""
    model = unstruct_model("sh")
    with torch.no_grad():
        _, cache = step_logits(model, model(tokens(1, 12, seed=25), use_cache=True).past_key_values, tokens(1, 2, 26))
        before = [p.ssm_state.untyped_storage().data_ptr() for p in ssm_parts(cache)]
        _, cache = step_logits(model, cache, tokens(1, 3, seed=27))
        after = [p.ssm_state.untyped_storage().data_ptr() for p in ssm_parts(cache)]
    assert before == after


# -- mutations: the checks above catch a chunk that is not refreshed, reset or reordered --------------------------
def stale_chunk(self, size):
    """A broken ``BSTLayerCache.chunk``: an exhausted chunk is reused from its start instead of recomputed."""
    if self.pending is None:
        return None
    return self.pending, self.pending_offset % size


def test_mutation_skipping_the_chunk_refresh_fails(monkeypatch):
    monkeypatch.setattr(BSTContextLayerCache, "chunk", stale_chunk)
    with pytest.raises(AssertionError):
        padded_decode_case(unstruct_model("sh"))


def test_mutation_reset_keeping_the_chunk_fails(monkeypatch):
    original = BSTContextLayerCache.reset_rows

    def reset_history_only(self, rows):
        pending = self.pending
        original(self, rows)
        self.pending = pending

    monkeypatch.setattr(BSTContextLayerCache, "reset_rows", reset_history_only)
    with pytest.raises(AssertionError):
        test_document_reset_inside_a_chunk()


def test_mutation_reorder_without_the_chunk_fails(monkeypatch):
    original = BSTContextLayerCache._apply

    def apply_without_chunk(self, fn):
        pending, self.pending = self.pending, None
        original(self, fn)
        self.pending = pending

    monkeypatch.setattr(BSTContextLayerCache, "_apply", apply_without_chunk)
    with pytest.raises((AssertionError, RuntimeError)):
        test_reorder_cache_selects_chunk_rows()


def test_mutation_traced_step_keeping_the_chunk_fails(monkeypatch):
    original = BSTContextStates._step_ssm

    def keep_chunk(self, ssm, xn, layer_cache, p, output=True, chunked=False):
        part = layer_cache
        kept = (part.pending, part.pending_offset)
        y = original(self, ssm, xn, layer_cache, p, output, chunked)
        if torch.compiler.is_compiling():
            part.pending, part.pending_offset = kept
        return y

    monkeypatch.setattr(BSTContextStates, "_step_ssm", keep_chunk)
    with pytest.raises(AssertionError):
        test_traced_steps_take_the_direct_form_and_drop_the_chunk()


# -- long positions ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_thousands_of_positions_at_the_default_chunk():
    """The default M over 3000+ positions (chunks of 2.5k to 3.5k inputs, FFT sizes 3072 to 5120): the chunked steps equal the
    forward (float64) after three chunk refreshes."""
    model = make_model("sh-unstruct", dtype=torch.float64, vocab_size=VOCAB, max_position_embeddings=4096)
    ids = tokens(2, 2500, seed=28)
    new = tokens(2, 3 * model.model.layers[0].ssm.decode_chunk + 7, seed=29)
    with torch.no_grad():
        logits, _ = step_logits(model, model(ids, use_cache=True).past_key_values, new)
    check_rows(model, logits[:, -40:], [torch.cat([ids[r], new[r]]) for r in range(2)])
