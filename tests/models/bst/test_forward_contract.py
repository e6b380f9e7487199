"""One forward contract across the full-sequence, chunk and recurrent forms (issue #12 bugs 1-5): cache length,
padding anywhere, hidden states the graph reads, attention weights, and no host syncs in decoding."""

import pytest
import torch
import transformers
from conftest import tiny_config
from torch.overrides import TorchFunctionMode

import modeling_bst  # noqa: F401
from modeling_bst import BSTForCausalLM, BSTModel, attention_bst, cache_bst, context_bst, ssm_bst, utils_bst
from modeling_bst import modeling_bst as mb


VARIANTS = {
    "sh-s4": dict(context_mode="sh"),
    "mh-s4": dict(context_mode="mh"),
    "mf-s4": dict(context_mode="mf"),
    "sh-unstruct": dict(context_mode="sh", ssm_kind="unstruct"),
    "brect": dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
    "gss": dict(bst_layer_indices=[], gss_layer_indices=[0, 2]),
}


def make_model(variant="sh-s4", dtype=torch.float32, **overrides):
    fields = dict(vocab_size=61, max_position_embeddings=96, pad_token_id=0, eos_token_id=None)
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    torch.manual_seed(0)
    return BSTForCausalLM(tiny_config(**fields)).to(dtype).eval()


def ids_and_mask(lengths, total, side="left", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(total - n, total) if side == "left" else slice(0, n)
        ids[row, cols] = torch.randint(1, 61, (n,), generator=g)
        mask[row, cols] = 1
    return ids, mask


# -- bug 1: get_seq_length counts processed positions; a padded batch continues exactly ---------------------------


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect"])
def test_left_padded_continuation_from_the_cache_equals_one_generate(variant):
    model = make_model(variant)
    # Every row is padded: the longest row's real-token count (7) is less than the processed positions (9).
    ids, mask = ids_and_mask([7, 4], 9)
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, **kwargs)
    cache = first.past_key_values
    assert cache.get_seq_length() == first.sequences.shape[1] - 1 == 13
    mask2 = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1)
    more = model.generate(first.sequences, attention_mask=mask2, past_key_values=cache, max_new_tokens=5, **kwargs)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)
    assert torch.equal(more.sequences, once.sequences)
    torch.testing.assert_close(torch.stack(more.logits, 1), torch.stack(once.logits, 1)[:, 5:], atol=1e-5, rtol=0)


# -- bug 2: padding anywhere, generate without a cache ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect"])
def test_generate_without_cache_on_right_padded_prompt_equals_the_cached_result(variant):
    model = make_model(variant)
    ids, mask = ids_and_mask([9, 5], 9, side="right")
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    recomputed = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    # (The first new token of a right-padded row is predicted at a padding column, as transformers warns.)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mask_with_holes_equals_the_rows_real_tokens_alone(variant):
    model = make_model(variant, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 61, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, [0, 4, 5, 11]] = 0
    mask[1, [7]] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        for row in range(2):
            real = mask[row].bool()
            alone = model(ids[row, real][None]).logits[0]
            torch.testing.assert_close(out[row, real], alone, atol=1e-10, rtol=0)


# -- bug 3: hidden states are the graph's own, and complete in decode steps ---------------------------------------


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect", "gss"])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_hidden_states_receive_gradients(variant, padded):
    model = make_model(variant)
    ids, mask = ids_and_mask([10, 7], 10)
    out = model(ids, attention_mask=mask if padded else None, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for h in out.hidden_states:
        assert h.shape == (2, 10, model.config.hidden_size)
        h.retain_grad()
    out.logits[:, -1].sum().backward()
    for i, h in enumerate(out.hidden_states):
        assert h.grad is not None and h.grad.abs().sum() > 0, i


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect", "gss"])
def test_decode_step_returns_every_hidden_state_equal_to_the_parallel_forward(variant):
    model = make_model(variant, dtype=torch.float64)
    ids = torch.randint(1, 61, (2, 11))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True, use_cache=False).hidden_states
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        step = model(ids[:, -1:], past_key_values=cache, output_hidden_states=True).hidden_states
        # A multi-token chunk off the block grid is stepped: all its positions are reported too.
        cache = model(ids[:, :5], use_cache=True).past_key_values
        chunk = model(ids[:, 5:], past_key_values=cache, output_hidden_states=True).hidden_states
    assert len(step) == len(chunk) == len(full) == model.config.num_hidden_layers + 1
    for f, s, c in zip(full, step, chunk):
        torch.testing.assert_close(s, f[:, -1:], atol=1e-10, rtol=0)
        torch.testing.assert_close(c, f[:, 5:], atol=1e-10, rtol=0)


# -- bug 4: attention weights with the eager attention ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sh-s4", "mf-s4", "brect"])
def test_output_attentions_returns_the_weights_the_output_uses(variant):
    model = make_model(variant, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    cfg = model.config
    ids = torch.randint(1, 61, (2, 10))
    with torch.no_grad():
        plain = model(ids, use_cache=False)
    out = model(ids, use_cache=False, output_attentions=True)
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-10, rtol=0)
    assert len(out.attentions) == cfg.num_hidden_layers
    q = torch.arange(10)
    rel = q[None] - q[:, None]
    window = (rel < 0) & (rel >= -cfg.block_len)
    for layer_idx, weights in enumerate(out.attentions):
        assert weights.shape == (2, cfg.num_attention_heads, 10, 10)
        assert (weights[..., ~window] == 0).all()  # only the W previous tokens
        torch.testing.assert_close(
            weights[:, :, 1:].sum(-1), torch.ones(2, cfg.num_attention_heads, 9, dtype=weights.dtype)
        )
        assert (weights[:, :, 0] == 0).all()  # the first token has no previous token
        kind = cfg.layer_kind(layer_idx)
        cross = out.cross_attentions[layer_idx]
        if kind == "block":
            assert cross is None
        else:
            s_c = {"sh": cfg.block_len, "mf": cfg.num_context_states}[cfg.context_mode] if kind == "bst" else None
            s_c = cfg.num_recurrent_states if kind == "recurrent" else s_c
            assert cross.shape == (2, cfg.num_attention_heads, 10, s_c)
            torch.testing.assert_close(cross.sum(-1), torch.ones_like(cross.sum(-1)))
    # The returned weights are the graph's own: a gradient reaches them.
    out.attentions[0].retain_grad()
    out.logits[:, -1].sum().backward()
    assert out.attentions[0].grad is not None


def test_decode_step_attentions_equal_the_last_row_of_the_parallel_weights():
    model = make_model("sh-s4", dtype=torch.float64)
    model.config._attn_implementation = "eager"
    ids = torch.randint(1, 61, (2, 11))
    with torch.no_grad():
        full = model(ids, use_cache=False, output_attentions=True)
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        step = model(ids[:, -1:], past_key_values=cache, output_attentions=True)
    for f, s in zip(full.attentions, step.attentions):
        assert s.shape == (2, model.config.num_attention_heads, 1, 11)
        torch.testing.assert_close(s, f[:, :, -1:], atol=1e-12, rtol=0)
    for f, s in zip(full.cross_attentions, step.cross_attentions):
        if f is not None:
            torch.testing.assert_close(s, f[:, :, -1:], atol=1e-12, rtol=0)


def test_output_attentions_under_sdpa_warns_once_and_returns_none(caplog):
    model = make_model("sh-s4")
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(1, 61, (1, 6))
    transformers.utils.logging.warning_once.cache_clear()  # an earlier test may have warned already
    with caplog.at_level("WARNING"):
        out = model(ids, output_attentions=True)
        model(ids, output_attentions=True)
    assert out.attentions is None
    assert sum("output_attentions" in r.getMessage() for r in caplog.records) == 1


def test_attention_implementations_are_eager_and_sdpa_only():
    """Eager and SDPA are switchable; FlexAttention is refused (it measured slower than SDPA: docs/performance.md)."""
    model = make_model("sh-s4")
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="flex_attention"):
        BSTForCausalLM._from_config(tiny_config(), attn_implementation="flex_attention")


# -- bug 5: no host syncs in decode steps; torch.export ---------------------------------------------------------


class HostReads(TorchFunctionMode):
    """Records every tensor -> Python read (each one a device sync on an accelerator)."""

    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "equal"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-s4", "brect", "gss"])
def test_decode_step_reads_nothing_back_on_an_accelerator(variant, monkeypatch):
    """With tensor reads treated as syncs (as on an accelerator), a decode step reads no tensor value; its outputs
    equal the CPU path, which may skip work after a free read."""
    model = make_model(variant)
    ids = torch.randint(1, 61, (2, 12))
    with torch.no_grad():
        cache = model(ids[:, :-4], use_cache=True).past_key_values
        expected = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(8, 12)]
        for module in (mb, attention_bst, cache_bst, context_bst, ssm_bst, utils_bst):
            if hasattr(module, "host_can_branch"):
                monkeypatch.setattr(module, "host_can_branch", lambda t: False)
        monkeypatch.setattr(BSTModel, "_validate_ids", lambda self, input_ids, decode_step: not decode_step)
        cache = model(ids[:, :-4], use_cache=True).past_key_values
        for t in range(8, 12):
            with HostReads() as mode:
                logits = model(ids[:, t : t + 1], past_key_values=cache).logits
            assert mode.reads == [], (t, mode.reads)
            torch.testing.assert_close(logits, expected[t - 8], atol=1e-6, rtol=0)


def test_bad_token_id_in_a_decode_step_raises_on_cpu():
    model = make_model("sh-s4")
    with torch.no_grad():
        cache = model(torch.randint(1, 61, (1, 5)), use_cache=True).past_key_values
        with pytest.raises(ValueError, match="token id 61"):
            model(torch.tensor([[61]]), past_key_values=cache)


@pytest.mark.parametrize("cls", [BSTModel, BSTForCausalLM], ids=lambda c: c.__name__)
def test_torch_export(cls):
    torch.manual_seed(0)
    # MF + BRecT for the backbone; SH:unstruct (the kernel-spectrum memo's path) for the LM.
    variant = dict(context_mode="mf", recurrent_layer_indices=[1]) if cls is BSTModel else dict(ssm_kind="unstruct")
    config = tiny_config(vocab_size=61, **variant)
    model = cls(config).eval()
    ids = torch.randint(0, 61, (2, 9))
    kwargs = {"use_cache": False}
    exported = torch.export.export(model, (ids,), kwargs=kwargs)
    with torch.no_grad():
        want = model(ids, **kwargs)
        got = exported.module()(ids, **kwargs)
    key = "last_hidden_state" if cls is BSTModel else "logits"
    torch.testing.assert_close(got[key], want[key])


# -- faithfulness option: the unstruct filter beyond its length -------------------------------------------------------


@pytest.mark.parametrize("variant", ["sh-unstruct", "mf-unstruct"])
def test_unstruct_filter_beyond_its_length_is_finite_causal_and_steps_exactly(variant):
    """max_position_embeddings = 16 taps, sequences of 3x that: the forward is causal, decoding (history of the last
    16 inputs) equals the parallel forward, and a layer's SSM output equals a direct convolution with 16 taps."""
    overrides = dict(context_mode=variant.split("-")[0], ssm_kind="unstruct", max_position_embeddings=16)
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(vocab_size=61, **overrides)).double().eval()
    assert model.config.unstruct_finite_filter
    ids = torch.randint(1, 61, (2, 48))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        changed = ids.clone()
        changed[:, 30] = (changed[:, 30] + 1) % 61
        torch.testing.assert_close(model(changed, use_cache=False).logits[:, :30], full[:, :30], atol=1e-10, rtol=0)
        cache = model(ids[:, :5], use_cache=True).past_key_values
        stepped = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 48)]
        torch.testing.assert_close(torch.cat(stepped, 1), full[:, 5:], atol=1e-9, rtol=0)
        # A block-aligned chunk continuing a cache past the filter length (full-sequence form over the history).
        cache = model(ids[:, :20], use_cache=True).past_key_values
        torch.testing.assert_close(model(ids[:, 20:], past_key_values=cache).logits, full[:, 20:], atol=1e-9, rtol=0)
        ssm = model.model.layers[0].ssm
        z = torch.randn(2, 48, ssm.channels, dtype=torch.float64)
        taps = ssm.filters(16)  # (C, Ds, 16)
        direct = torch.zeros(2, 48, *taps.shape[:2], dtype=torch.float64)
        for t in range(48):
            for j in range(min(t + 1, 16)):
                direct[:, t] += taps[..., j] * z[:, t - j, None, :]
        direct += ssm.bias * z[:, :, None, :]
        torch.testing.assert_close(ssm(z), direct, atol=1e-10, rtol=0)


# -- the cache's name: `cache` from transformers 5.24 on, `past_key_values` before; both are accepted -------------


@pytest.mark.parametrize("head", ["model", "lm"])
def test_the_cache_goes_in_under_either_name_and_comes_out_under_the_installed_one(head):
    lm = make_model("sh-s4")
    model = lm if head == "lm" else lm.model
    ids = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    first = model(ids[:, :9], use_cache=True)
    installed = "cache" if "cache" in type(first).__dataclass_fields__ else "past_key_values"
    assert mb.CACHE_NAME == installed
    assert installed in first.keys() and isinstance(getattr(first, installed), mb.BSTCache)
    outs = []
    for name in ("cache", "past_key_values"):
        cache = model(ids[:, :9], use_cache=True)[installed]
        out = model(ids[:, 9:], use_cache=True, **{name: cache})
        assert getattr(out, installed) is cache and cache.get_seq_length() == 11
        outs.append(out[0])
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    full = model(ids)[0][:, 9:]
    torch.testing.assert_close(outs[0], full, atol=1e-5, rtol=0)
    # A cache under both names is refused (transformers' `deprecate_kwarg`), the same one too.
    for other in (first[installed], model(ids[:, :9], use_cache=True)[installed]):
        with pytest.raises(ValueError, match="Both `past_key_values` and `cache` are set"):
            model(ids[:, 9:], cache=first[installed], past_key_values=other)


def test_generate_takes_a_returned_cache_under_the_installed_name():
    """``generate`` continues a returned cache passed under the installed transformers' name (``cache`` from 5.24 on,
    which also takes ``past_key_values`` as a deprecated alias). Before 5.24, a ``cache=`` that generate does not
    know reaches the forward beside the cache generate made: refused with an error naming ``past_key_values``."""
    model = make_model("mf-s4")
    ids = torch.randint(1, 61, (1, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(do_sample=False, return_dict_in_generate=True)
    once = model.generate(ids, max_new_tokens=8, **kwargs).sequences
    for name in ("cache", "past_key_values"):
        first = model.generate(ids, max_new_tokens=4, **kwargs)
        cache = first[mb.CACHE_NAME]
        assert all(isinstance(layer, mb.BSTLayerCache) for layer in cache.layers)
        if name != mb.CACHE_NAME and mb.CACHE_NAME == "past_key_values":
            with pytest.raises(ValueError, match="past_key_values"):
                model.generate(first.sequences, max_new_tokens=4, **kwargs, **{name: cache})
            continue
        more = model.generate(first.sequences, max_new_tokens=4, **kwargs, **{name: cache}).sequences
        assert torch.equal(more, once)
