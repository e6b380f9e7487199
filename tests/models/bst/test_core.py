"""Core exactness of the BST model: SSM kernels against slow references, causality, step == parallel, round trips."""

import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

import modeling_bst  # noqa: F401
from modeling_bst import BSTConfig, BSTForCausalLM, BSTForSequenceClassification
from modeling_bst.ssm_bst import S4DKernel, fft_bidirectional_conv, fft_causal_conv


os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "sh-s4": dict(context_mode="sh"),
    "mh-s4": dict(context_mode="mh"),
    "mf-s4": dict(context_mode="mf"),
    "sh-unstruct": dict(context_mode="sh", ssm_kind="unstruct"),
    "mh-unstruct": dict(context_mode="mh", ssm_kind="unstruct"),
    "mf-unstruct": dict(context_mode="mf", ssm_kind="unstruct"),
    "slide": dict(bst_layer_indices=[]),
    "brect": dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
    "trsf-xl": dict(bst_layer_indices=[], block_len=32),
    "gss-hybrid": dict(bst_layer_indices=[], gss_layer_indices=[0, 2]),
    "bst+brect": dict(bst_layer_indices=[0], recurrent_layer_indices=[2], context_mode="mf"),
    "attend-self": dict(attend_self=True),
    "strict-cross": dict(cross_mask="strict", context_mode="mh"),
}


def tiny(**overrides) -> BSTConfig:
    return tiny_config(**{"vocab_size": 61, **overrides})


def model_for(variant, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    return BSTForCausalLM(tiny(**VARIANTS[variant], **overrides)).to(dtype).eval()


# -- slow references ---------------------------------------------------------------------------------------------


def s4d_kernel_bruteforce(kernel: S4DKernel, length: int) -> torch.Tensor:
    """``K[c, h, l] = 2 Re(C Abar^l Bbar)`` by repeated multiplication, float64."""
    lam = torch.complex(-torch.exp(kernel.A_log_real.double()), -kernel.A_imag.double())
    dt = torch.exp(kernel.log_dt.double())[:, None]
    a_bar = torch.exp(lam * dt)
    b_bar = (a_bar - 1) / lam * torch.view_as_complex(kernel.B.double().contiguous())
    c = torch.view_as_complex(kernel.C.double().contiguous())
    power = torch.ones_like(a_bar)
    out = []
    for _ in range(length):
        out.append(2 * (c * power * b_bar).sum(-1).real)
        power = power * a_bar
    return torch.stack(out, -1)


def direct_causal_conv(u, k):
    """O(L^2) ``y[b, c, h, t] = sum_{j<=t} k[c, h, j] u[b, h, t-j]``."""
    length = u.shape[-1]
    y = torch.zeros(u.shape[0], k.shape[0], u.shape[1], length, dtype=u.dtype)
    for t in range(length):
        for j in range(t + 1):
            y[..., t] += k[None, :, :, j] * u[:, None, :, t - j]
    return y


# -- SSM kernels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", ["lin", "inv"])
@pytest.mark.parametrize("length", [1, 7, 64, 130])
def test_s4d_kernel_matches_bruteforce(init, length):
    torch.manual_seed(0)
    kernel = S4DKernel(6, 3, 16, tiny(ssm_init=init)).double()
    kernel.reset_parameters()
    with torch.no_grad():
        kernel.C.add_(0.3 * torch.randn_like(kernel.C))
    torch.testing.assert_close(kernel.kernel(length), s4d_kernel_bruteforce(kernel, length), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("length", [1, 5, 33])
def test_fft_conv_matches_direct_conv(dtype, atol, length):
    torch.manual_seed(0)
    u, k = torch.randn(2, 3, length, dtype=dtype), torch.randn(4, 3, length, dtype=dtype)
    torch.testing.assert_close(fft_causal_conv(u, k), direct_causal_conv(u, k), atol=atol, rtol=1e-5)


def test_bidirectional_conv_matches_two_sided_sum():
    torch.manual_seed(0)
    length = 9
    u, kf, kb = (
        torch.randn(2, 3, length).double(),
        torch.randn(1, 3, length).double(),
        torch.randn(1, 3, length).double(),
    )
    ref = torch.zeros(2, 1, 3, length, dtype=torch.float64)
    for t in range(length):
        for j in range(t + 1):
            ref[..., t] += kf[None, :, :, j] * u[:, None, :, t - j]
        for j in range(1, length - t):
            ref[..., t] += kb[None, :, :, j - 1] * u[:, None, :, t + j]
    torch.testing.assert_close(fft_bidirectional_conv(u, kf, kb), ref, atol=1e-12, rtol=0)


def test_s4d_step_state_and_block_ends_match_convolution():
    torch.manual_seed(0)
    kernel = S4DKernel(5, 3, 8, tiny()).double()
    kernel.reset_parameters()
    z = torch.randn(2, 24, 5, dtype=torch.float64)
    y = kernel(z)  # (B, L, C, Ds)
    state = torch.zeros(2, 5, 4, dtype=torch.complex128)
    for t in range(24):
        y_t, state = kernel.step(z[:, t], state)
        torch.testing.assert_close(y_t, y[:, t], atol=1e-12, rtol=0)
    torch.testing.assert_close(kernel.final_state(z), state, atol=1e-12, rtol=0)
    torch.testing.assert_close(kernel.block_end_outputs(z, 4), y[:, 3::4], atol=1e-12, rtol=0)
    # Continuing from a state == the tail of one long convolution.
    z2 = torch.randn(2, 8, 5, dtype=torch.float64)
    full = kernel(torch.cat([z, z2], 1))[:, 24:]
    torch.testing.assert_close(kernel(z2, state), full, atol=1e-12, rtol=0)
    torch.testing.assert_close(kernel.block_end_outputs(z2, 4, state), full[:, 3::4], atol=1e-12, rtol=0)


def test_s4_state_matrix_stays_stable_under_any_parameters():
    kernel = S4DKernel(4, 1, 8, tiny())
    with torch.no_grad():
        for p in kernel.parameters():
            p.normal_(0, 5)
    dt_a, _ = kernel.discretize()
    assert (dt_a.real < 0).all()


# -- model -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_causality(variant):
    model = model_for(variant)
    x = torch.randint(0, 61, (2, 21))
    for t in (0, 5, 13, 20):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 7) % 61
        with torch.no_grad():
            a, b = model(x).logits, model(x2).logits
        torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-12, rtol=0)
        assert (a[:, t:] - b[:, t:]).abs().max() > 1e-6


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_token_by_token_decoding_equals_parallel_forward(variant):
    model = model_for(variant)
    x = torch.randint(0, 61, (2, 19))
    with torch.no_grad():
        ref = model(x).logits
        for prefix in (1, 4, 7):
            out = model(x[:, :prefix], use_cache=True)
            cache, logits = out.past_key_values, [out.logits]
            for t in range(prefix, 19):
                out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
                logits.append(out.logits)
            torch.testing.assert_close(torch.cat(logits, 1), ref, atol=1e-10, rtol=0)


def test_sdpa_equals_eager_attention():
    for variant in ("sh-s4", "mf-unstruct", "brect"):
        model = model_for(variant, dtype=torch.float32)
        x = torch.randint(0, 61, (2, 17))
        with torch.no_grad():
            model.config._attn_implementation = "sdpa"
            a = model(x).logits
            model.config._attn_implementation = "eager"
            b = model(x).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_chunk", [None, 1, 2])
def test_block_attention_matches_per_token_window_reference(query_chunk):
    """A one-layer Slide model against attention written per query: exactly the W previous tokens, T5 bias."""
    config = tiny(num_hidden_layers=1, bst_layer_indices=[], attention_query_chunk=query_chunk)
    torch.manual_seed(0)
    model = BSTForCausalLM(config).double().eval()
    layer = model.model.layers[0]
    x = torch.randn(1, 13, 32, dtype=torch.float64)
    with torch.no_grad():
        out = layer(torch.nn.functional.pad(x, (0, 0, 0, 3)))[:, :13]
        xn = layer.input_norm(x)
        heads, hd, w = 2, 8, config.block_len
        q = layer.self_attn.q_proj(xn).view(13, heads, hd)
        k = layer.self_attn.k_proj(xn).view(13, heads, hd)
        v = layer.self_attn.v_proj(xn).view(13, heads, hd)
        # meliad's key/query normalisation: x / sqrt(sum x^2 + 1e-6)
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        attn = torch.zeros(13, heads, hd, dtype=torch.float64)
        for t in range(13):
            keys = list(range(max(0, t - w), t))
            if not keys:
                continue
            for h in range(heads):
                logits = []
                for j in keys:
                    n = t - j
                    bucket = n if n < 16 else min(31, 16 + int(math.log(n / 16) / math.log(128 / 16) * 16))
                    bias = layer.self_attn.relative_bias.weight[bucket, h]
                    logits.append((q[t, h] @ k[j, h] + bias) * layer.self_attn.scale[h])
                p = torch.softmax(torch.stack(logits), 0)
                attn[t, h] = (p[:, None] * v[keys, h]).sum(0)
        h = x + layer.o_proj(attn.reshape(1, 13, heads * hd))
        ref = h + layer.mlp.down_proj(torch.relu(layer.mlp.up_proj(layer.post_attention_norm(h))))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_bidirectional_classifier_sees_the_future():
    torch.manual_seed(0)
    config = tiny(bidirectional=True, num_labels=3, num_s4_head_layers=1)
    model = BSTForSequenceClassification(config).double().eval()
    x = torch.randint(0, 61, (1, 16))
    x2 = x.clone()
    x2[0, 15] = (x2[0, 15] + 1) % 61
    with torch.no_grad():
        h1 = model.model(x).last_hidden_state
        h2 = model.model(x2).last_hidden_state
    assert (h1[0, 0] - h2[0, 0]).abs().max() > 1e-8


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_every_parameter_gets_a_gradient_and_bf16_is_finite(variant):
    model = model_for(variant, dtype=torch.float32).train()
    x = torch.randint(0, 61, (2, 23))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_labels_give_the_shifted_cross_entropy():
    model = model_for("sh-s4")
    x = torch.randint(0, 61, (2, 11))
    out = model(x, labels=x)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 61), x[:, 1:].reshape(-1))
    # transformers computes the loss in float32
    torch.testing.assert_close(out.loss, ref.float(), atol=1e-6, rtol=1e-6)


def test_padding_left_and_right_matches_rows_alone():
    model = model_for("mf-s4")
    a, b = torch.randint(1, 61, (1, 9)), torch.randint(1, 61, (1, 14))
    with torch.no_grad():
        ref_a, ref_b = model(a).logits, model(b).logits
        for side in ("left", "right"):
            ids = torch.zeros(2, 14, dtype=torch.long)
            mask = torch.zeros(2, 14, dtype=torch.long)
            sl = slice(5, 14) if side == "left" else slice(0, 9)
            ids[0, sl], mask[0, sl] = a[0], 1
            ids[1], mask[1] = b[0], 1
            out = model(ids, attention_mask=mask).logits
            torch.testing.assert_close(out[0, sl], ref_a[0], atol=1e-10, rtol=0)
            torch.testing.assert_close(out[1], ref_b[0], atol=1e-10, rtol=0)


def test_save_load_and_fresh_process_remote_code(tmp_path):
    model = model_for("mf-unstruct", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    x = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        ref = model(x).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert torch.equal(reloaded(x).logits, ref)
    from safetensors.torch import load_file, save_file

    save_file({"x": x}, str(tmp_path / "inputs.safetensors"))
    script = (
        "import sys; sys.modules['modeling_bst'] = None\n"
        "import torch\n"
        "from safetensors.torch import load_file, save_file\n"
        "from transformers import AutoModelForCausalLM\n"
        f"d = {str(tmp_path)!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "assert 'transformers_modules' in type(m).__module__, type(m).__module__\n"
        "x = load_file(d + '/inputs.safetensors')['x']\n"
        "save_file({'y': m(x).logits.contiguous()}, d + '/outputs.safetensors')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=env, timeout=300)
    # Another process may schedule reductions differently: equal up to float32 rounding.
    torch.testing.assert_close(load_file(str(tmp_path / "outputs.safetensors"))["y"], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(context_mode="xx"), "context_mode"),
        (dict(ssm_kind="s5"), "ssm_kind"),
        (dict(bst_layer_indices=[0, 3]), "bst_layer_indices"),
        (dict(bst_layer_indices=[1, 1]), "bst_layer_indices"),
        (dict(recurrent_layer_indices=[0]), "recurrent_layer_indices"),
        (dict(block_len=0), "block_len"),
        (dict(hidden_size=-4), "hidden_size"),
        (dict(ssm_state_size=5), "ssm_state_size"),
        (dict(num_context_states=0), "num_context_states"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(attention_query_chunk=3), "attention_query_chunk"),
    ],
)
def test_invalid_config_names_the_field(overrides, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)
    # The same values in a config.json fail the same way on load.
    good = tiny()
    good.save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        BSTConfig.from_pretrained(tmp_path)


def test_bad_inputs_raise_clear_errors():
    model = model_for("sh-unstruct", unstruct_finite_filter=False)
    with pytest.raises(ValueError, match="61"):
        model(torch.tensor([[1, 61]]))
    with pytest.raises(ValueError, match="-1"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(TypeError, match="integer"):
        model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="[Ee]mpty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 65, dtype=torch.long))
    other = model_for("slide")
    cache = other(torch.ones(1, 3, dtype=torch.long), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="different model"):
        model(torch.ones(1, 1, dtype=torch.long), past_key_values=cache)
