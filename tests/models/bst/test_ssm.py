"""SSM kernels against slow references: S4D kernel, FFT convolutions, recurrence, states, unstruct filters."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config
from reference import (
    complex_discretize,
    complex_final_state,
    complex_forward,
    complex_kernel,
    complex_step,
    direct_causal_conv,
    s4d_kernel_bruteforce,
    s4d_recurrence,
    two_sided_conv,
)

from modeling_bst import ssm_bst
from modeling_bst.functional_bst import causal_spectrum
from modeling_bst.ssm_bst import LongConv, S4DKernel, UnstructFilter, append_history, fft_conv


F64 = dict(atol=1e-12, rtol=1e-10)


def make_s4d(channels=5, out_channels=3, state_size=8, dtype=torch.float64, perturb=True, **config_overrides):
    """An initialised S4D kernel; ``perturb`` moves every parameter off its structured init (B = 1, shared A...)."""
    kernel = S4DKernel(channels, out_channels, state_size, tiny_config(**config_overrides)).to(dtype)
    kernel.reset_parameters()
    if perturb:
        with torch.no_grad():
            kernel.A_log_real.add_(0.3 * torch.randn_like(kernel.A_log_real))
            kernel.A_imag.add_(0.5 * torch.randn_like(kernel.A_imag))
            kernel.B.add_(0.3 * torch.randn_like(kernel.B))
            kernel.log_dt.add_(0.5 * torch.randn_like(kernel.log_dt))
    return kernel


def make_unstruct(channels=3, out_channels=2, dtype=torch.float64, **config_overrides):
    config = tiny_config(max_position_embeddings=40, unstruct_order=16, unstruct_emb_dim=5, **config_overrides)
    filt = UnstructFilter(channels, out_channels, config).to(dtype)
    filt.reset_positional_features()
    with torch.no_grad():
        torch.nn.init.constant_(filt.sin.freq, 1.0)
        torch.nn.init.normal_(filt.bias)
        for layer in filt.mlp:
            layer.reset_parameters()
        filt.out.reset_parameters()
    return filt


# -- S4D kernel ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 7, 64, 131], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("init", ["lin", "inv"])
def test_s4d_kernel_matches_bruteforce_powers(init, length):
    kernel = make_s4d(ssm_init=init)
    ref = s4d_kernel_bruteforce(kernel, length)
    out = kernel.kernel(length)
    assert out.shape == (3, 5, length) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, **F64)


@pytest.mark.parametrize("init", ["lin", "inv"])
def test_s4d_kernel_float32_close_to_float64_bruteforce(init):
    kernel = make_s4d(ssm_init=init, dtype=torch.float32)
    ref = s4d_kernel_bruteforce(kernel, 300)
    torch.testing.assert_close(kernel.kernel(300).double(), ref, atol=2e-5, rtol=1e-4)


def test_s4d_kernel_beyond_max_position_embeddings():
    """S4 kernels exist for any length: the kernel is computed for exactly L lags, L >> max_position_embeddings."""
    kernel = make_s4d(max_position_embeddings=16)
    length = 300
    torch.testing.assert_close(kernel.kernel(length), s4d_kernel_bruteforce(kernel, length), **F64)
    z = torch.randn(2, length, 5, dtype=torch.float64)
    y_ref, _ = s4d_recurrence(kernel, z)
    torch.testing.assert_close(kernel(z), y_ref, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("trial", range(3))
def test_s4d_state_matrix_stays_stable_after_random_perturbation(trial):
    """Re(Lambda) < 0 (|Abar| < 1) for any parameter values: the parameterisation cannot go unstable."""
    torch.manual_seed(trial)
    kernel = make_s4d()
    with torch.no_grad():
        for p in kernel.parameters():
            p.add_(2.0 * torch.randn_like(p))
    dt_a, _ = complex_discretize(kernel)
    assert torch.isfinite(dt_a).all()
    assert (dt_a.real < 0).all()
    assert (torch.exp(dt_a).abs() < 1).all()
    # Gradient ascent on the kernel energy pushes the modes towards instability; they must stay strictly stable.
    for _ in range(20):
        kernel.zero_grad()
        kernel.kernel(64).pow(2).sum().backward()
        with torch.no_grad():
            for p in (kernel.A_log_real, kernel.A_imag, kernel.log_dt, kernel.B, kernel.C):
                p.add_(0.5 * p.grad.sign())
    dt_a, _ = complex_discretize(kernel)
    assert torch.isfinite(dt_a).all()
    assert (dt_a.real < 0).all()
    assert (torch.exp(dt_a).abs() < 1).all()


@pytest.mark.parametrize("length", [1, 7, 64, 131], ids=lambda n: f"L{n}")
def test_s4d_real_arithmetic_equals_complex_reference(length):
    """The model's S4D maths (real arithmetic, ``functional_bst``) against the complex forms in float64: the kernel
    (both directions), the outputs continuing a state, the state after a sequence, and the recurrent step."""
    kernel = make_s4d(bidirectional=True)
    for backward in (False, True):
        torch.testing.assert_close(kernel.kernel(length, backward=backward), complex_kernel(kernel, length, backward))
    causal = make_s4d()
    z = torch.randn(2, length, 5, dtype=torch.float64)
    state = torch.randn(2, 5, causal.n_modes, dtype=torch.complex128)
    pairs = torch.view_as_real(state)  # the model's state layout (B, Ds, N2, 2)
    with torch.no_grad():
        torch.testing.assert_close(causal(z, pairs), complex_forward(causal, z, state), **F64)
        ref = torch.view_as_real(complex_final_state(causal, z))
        torch.testing.assert_close(causal.final_state(z), ref, **F64)
        ref = torch.view_as_real(complex_final_state(causal, z, state))
        torch.testing.assert_close(causal.final_state(z, pairs), ref, **F64)
        y, new = causal.step(z[:, 0], pairs)
        y_ref, new_ref = complex_step(causal, z[:, 0], state)
        assert new.dtype == torch.float64
        torch.testing.assert_close((y, new), (y_ref, torch.view_as_real(new_ref)), **F64)


# -- convolutions ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 5, 17, 33], ids=lambda n: f"L{n}")
@pytest.mark.parametrize(
    "dtype,tol",
    [(torch.float64, dict(atol=1e-12, rtol=1e-10)), (torch.float32, dict(atol=2e-5, rtol=1e-5))],
    ids=["f64", "f32"],
)
def test_fft_causal_conv_matches_direct(dtype, tol, length):
    """The FFT convolution with a causal spectrum (size 2L) is the direct causal sum."""
    u, k = torch.randn(2, 3, length, dtype=dtype), torch.randn(4, 3, length, dtype=dtype)
    out = fft_conv(u, causal_spectrum(k))
    assert out.shape == (2, 4, 3, length) and out.dtype == dtype
    torch.testing.assert_close(out.double(), direct_causal_conv(u, k), **tol)


@pytest.mark.parametrize("length", [1, 2, 9, 16], ids=lambda n: f"L{n}")
@pytest.mark.parametrize(
    "dtype,tol",
    [(torch.float64, dict(atol=1e-12, rtol=1e-10)), (torch.float32, dict(atol=2e-5, rtol=1e-5))],
    ids=["f64", "f32"],
)
def test_fft_bidirectional_conv_matches_two_sided_sum(dtype, tol, length):
    u = torch.randn(2, 3, length, dtype=dtype)
    kf, kb = torch.randn(2, 3, length, dtype=dtype), torch.randn(2, 3, length, dtype=dtype)
    out = fft_conv(u, LongConv.spectrum(SimpleNamespace(taps=lambda n: (kf, kb)), length))  # two-sided taps
    assert out.shape == (2, 2, 3, length)
    torch.testing.assert_close(out.double(), two_sided_conv(u, kf, kb), **tol)


def test_bidirectional_s4d_forward_matches_two_sided_sum():
    kernel = make_s4d(bidirectional=True)
    z = torch.randn(2, 11, 5, dtype=torch.float64)
    kf, kb = s4d_kernel_bruteforce(kernel, 11), None
    with torch.no_grad():
        # The backward kernel uses C_backward: swap it in for the brute force.
        c = kernel.C.clone()
        kernel.C.copy_(kernel.C_backward)
        kb = s4d_kernel_bruteforce(kernel, 11)
        kernel.C.copy_(c)
    u = z.transpose(1, 2)
    ref = two_sided_conv(u, kf, kb) + kernel.D.detach()[None, :, :, None] * u[:, None]
    torch.testing.assert_close(kernel(z), ref.permute(0, 3, 1, 2), **F64)


# -- S4D recurrence and states ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 6, 23], ids=lambda n: f"L{n}")
def test_s4d_forward_equals_recurrence(length):
    kernel = make_s4d()
    z = torch.randn(2, length, 5, dtype=torch.float64)
    y_ref, state_ref = s4d_recurrence(kernel, z)
    torch.testing.assert_close(kernel(z), y_ref, **F64)
    # The module's own step agrees with the reference loop too.
    state = kernel.empty_state(2, z.device)
    for t in range(length):
        y_t, state = kernel.step(z[:, t], state)
        torch.testing.assert_close(y_t, y_ref[:, t], **F64)
    torch.testing.assert_close(state, state_ref, **F64)


def test_s4d_forward_from_a_state_continues_the_recurrence():
    kernel = make_s4d()
    z1, z2 = torch.randn(2, 9, 5, dtype=torch.float64), torch.randn(2, 13, 5, dtype=torch.float64)
    _, state = s4d_recurrence(kernel, z1)
    y_ref, final_ref = s4d_recurrence(kernel, z2, state)
    torch.testing.assert_close(kernel(z2, state), y_ref, **F64)
    # and equals the tail of one forward over the concatenation
    torch.testing.assert_close(kernel(z2, state), kernel(torch.cat([z1, z2], 1))[:, 9:], **F64)
    torch.testing.assert_close(kernel.final_state(z2, state), final_ref, **F64)


@pytest.mark.parametrize("length", [1, 7, 64, 150], ids=lambda n: f"L{n}")
def test_s4d_final_state_equals_stepped_state(length):
    kernel = make_s4d()
    z = torch.randn(3, length, 5, dtype=torch.float64)
    _, state_ref = s4d_recurrence(kernel, z)
    torch.testing.assert_close(kernel.final_state(z), state_ref, **F64)


def test_s4d_final_state_with_left_zero_padding_is_unchanged():
    kernel = make_s4d()
    z = torch.randn(2, 7, 5, dtype=torch.float64)
    padded = torch.cat([torch.zeros(2, 5, 5, dtype=torch.float64), z], 1)
    torch.testing.assert_close(kernel.final_state(padded), kernel.final_state(z), **F64)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "with-state"])
@pytest.mark.parametrize("block_len,num_blocks", [(1, 5), (3, 1), (4, 7), (5, 4)], ids=lambda x: str(x))
def test_s4d_block_end_outputs_match_fft_path(block_len, num_blocks, with_state):
    """MF fast path (per-block states + scan) == full FFT forward sampled at every block's last token."""
    kernel = make_s4d(out_channels=4)
    z = torch.randn(2, block_len * num_blocks, 5, dtype=torch.float64)
    state = None
    if with_state:
        _, state = s4d_recurrence(kernel, torch.randn(2, 6, 5, dtype=torch.float64))
    out = kernel.block_end_outputs(z, block_len, state)
    assert out.shape == (2, num_blocks, 4, 5)
    torch.testing.assert_close(out, kernel(z, state)[:, block_len - 1 :: block_len], **F64)
    y_ref, _ = s4d_recurrence(kernel, z, state)
    torch.testing.assert_close(out, y_ref[:, block_len - 1 :: block_len], **F64)


def test_s4d_block_end_outputs_refuses_bidirectional_kernels():
    """The MF fast path is causal-only; a bidirectional kernel must not silently drop its backward part."""
    kernel = make_s4d(out_channels=4, bidirectional=True)
    with pytest.raises(ValueError, match="bidirectional"):
        kernel.block_end_outputs(torch.randn(2, 16, 5, dtype=torch.float64), 4)


MISALIGNED_SCRIPT = """
import torch
from modeling_bst import BSTConfig
from modeling_bst.ssm_bst import S4DKernel
torch.manual_seed(0)
config = BSTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                   intermediate_size=48, block_len=4, bst_layer_indices=[0], ssm_state_size=8)
kernel = S4DKernel(5, 3, 8, config).double()
kernel.reset_parameters()
z = torch.randn(2, 16, 5, dtype=torch.float64)
ref = [kernel(z), kernel.block_end_outputs(z, 4), kernel.final_state(z), kernel.step(z[:, 0], kernel.final_state(z))[0]]
with torch.no_grad():
    for p in kernel.parameters():
        # What from_pretrained does with safetensors: a storage of its own, 8-byte (not 16-byte) aligned.
        buf = bytearray(8 + p.numel() * 8)
        moved = torch.frombuffer(buf, dtype=torch.float64, offset=8, count=p.numel()).view(p.shape)
        moved.copy_(p)
        assert moved.data_ptr() % 16 == 8
        p.data = moved
out = [kernel(z), kernel.block_end_outputs(z, 4), kernel.final_state(z), kernel.step(z[:, 0], kernel.final_state(z))[0]]
for a, b in zip(out, ref):
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
print("OK")
"""


def test_s4d_parameters_at_8_byte_aligned_addresses():
    """float64 S4D weights at 8-byte-aligned addresses (zero-copy safetensors loading) must work (subprocess: the
    failure mode was a segfault, .bugs/segfault-misaligned-complex128-mf-s4-float64-checkpoint.md)."""
    proc = subprocess.run([sys.executable, "-c", MISALIGNED_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, f"exit code {proc.returncode}\n{proc.stderr[-2000:]}"


def test_s4d_stays_float32_under_bf16_autocast():
    kernel = make_s4d(dtype=torch.float32)
    z = torch.randn(2, 21, 5)
    ref = kernel(z)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = kernel(z.bfloat16())
        y_end = kernel.block_end_outputs(z[:, :20].bfloat16(), 4)
        state = kernel.final_state(z.bfloat16())
        y_t, _ = kernel.step(z[:, 0].bfloat16(), torch.zeros_like(state))
    assert y.dtype == torch.float32 and y_end.dtype == torch.float32 and y_t.dtype == torch.float32
    assert state.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(y_end).all()
    # Only the bf16 rounding of the input differs from the float32 result.
    torch.testing.assert_close(y, kernel(z.bfloat16().float()), atol=1e-5, rtol=1e-5)
    assert (y - ref).abs().max() < 0.1


# -- chunked S4D evaluation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "with-state"])
@pytest.mark.parametrize("out_channels", [1, 4])
@pytest.mark.parametrize("length", [17, 24, 61], ids=lambda n: f"L{n}")
def test_s4d_chunked_forward_equals_recurrence_and_whole_length(length, out_channels, with_state, train):
    """Chunk-by-chunk evaluation (intra-chunk FFT + free response of the chunk-start states) is the same map."""
    kernel = make_s4d(out_channels=out_channels).train(train)
    z = torch.randn(2, length, 5, dtype=torch.float64)
    state = s4d_recurrence(kernel, torch.randn(2, 6, 5, dtype=torch.float64))[1] if with_state else None
    kernel.chunk_len = 0
    whole = kernel(z, state)
    kernel.chunk_len = 4
    assert kernel.use_chunks(length, z.element_size())  # 4 < 2 * 4 < length: the chunked path runs
    chunked = kernel(z, state)
    torch.testing.assert_close(chunked, whole, **F64)
    torch.testing.assert_close(chunked, s4d_recurrence(kernel, z, state)[0], **F64)


def test_s4d_chunked_forward_gradients_equal_whole_length():
    kernel = make_s4d(out_channels=3)
    z = torch.randn(2, 29, 5, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 29, 3, 5, dtype=torch.float64)
    grads = []
    for chunk in (0, 4):
        kernel.chunk_len = chunk
        kernel.zero_grad()
        z.grad = None
        (kernel(z) * weights).sum().backward()
        grads.append([z.grad.clone()] + [p.grad.clone() for p in kernel.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **F64)


def test_s4d_chunk_policy(monkeypatch):
    """Training and long evaluation run chunked; evaluation reuses a whole-length spectrum while it fits the memo."""
    kernel = make_s4d(out_channels=4)
    kernel.chunk_len = 4
    assert kernel.train().use_chunks(8, 8)  # training: the real chunked form at any length
    assert kernel.train().use_chunks(40, 8)  # training: nothing memoised
    kernel.eval()
    with torch.no_grad():
        assert not kernel.use_chunks(8, 8)  # at most two chunks: one memoised FFT
        assert not kernel.use_chunks(40, 8)  # the memoised spectrum (4 * 5 * 41 complex) fits
        monkeypatch.setattr(ssm_bst, "SPECTRUM_MEMO_BYTES", 1000)
        assert kernel.use_chunks(40, 8)  # it no longer fits: linear cost instead
    kernel.chunk_len = 0
    assert not kernel.train().use_chunks(1000, 8)
    bidirectional = make_s4d(bidirectional=True).train()
    bidirectional.chunk_len = 4
    assert not bidirectional.use_chunks(40, 8)  # two-sided kernels have no causal state to carry


def test_spectrum_memo_only_on_the_cpu():
    """The memo's parameter check reads values back: on an accelerator (here: the meta device) it is skipped."""
    kernel = make_s4d().eval()
    with torch.no_grad():
        assert ssm_bst.spectrum_memo_usable(kernel)
        assert not ssm_bst.spectrum_memo_usable(kernel.to("meta"))


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "gss"])
def test_models_with_chunked_ssm_equal_whole_length(variant):
    """Whole models (float64, training mode and evaluation) give the same logits with the chunked SSM path."""
    from conftest import SEQ_LEN, make_model

    if variant == "gss":
        model = make_model(dtype=torch.float64, bst_layer_indices=[0], gss_layer_indices=[1])
    else:
        model = make_model(variant, dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 4 * SEQ_LEN))
    kernels = [m for m in model.modules() if isinstance(m, S4DKernel)]
    assert kernels
    for train in (True, False):
        model.train(train)
        out = {}
        for chunk in (0, 4):
            for k in kernels:
                k.chunk_len = chunk
            out[chunk] = model(ids).logits
        torch.testing.assert_close(out[4], out[0], **F64)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "with-state"])
@pytest.mark.parametrize("per", [1, 3], ids=["1-chunk-segments", "3-chunk-segments"])
def test_s4d_channel_major_chunks_equal_chunked_forward(per, with_state):
    """Segments of whole chunks from the chunk-start states give the chunked outputs, channel-major, and the same
    gradients (to the input, the carried state and every parameter)."""
    kernel = make_s4d(out_channels=3).train()
    chunk, bsz, length, ds = 4, 2, 28, 5
    z = torch.randn(bsz, length, ds, dtype=torch.float64, requires_grad=True)
    state = s4d_recurrence(kernel, torch.randn(bsz, 6, ds, dtype=torch.float64))[1] if with_state else None
    if state is not None:
        state = state.clone().requires_grad_(True)
    weights = torch.randn(bsz, length, 3, ds, dtype=torch.float64)
    results = []
    for segmented in (False, True):
        kernel.zero_grad()
        z.grad = None
        if state is not None:
            state.grad = None
        kernel.chunk_len = chunk
        if segmented:
            constants = kernel.chunk_tables(chunk, length // chunk)
            x0 = kernel.chunk_start_states(z, chunk, state, constants)
            assert x0.shape == (ds, bsz, length // chunk, 8)  # stacked (re, im) of the 4 modes
            parts = [
                kernel.channel_major_chunks(
                    z[:, c0 * chunk : (c0 + per) * chunk], x0[:, :, c0 : c0 + per], chunk, constants
                )
                .unflatten(-1, (bsz, -1))  # (C, Ds, B, n)
                .permute(2, 3, 0, 1)
                for c0 in range(0, length // chunk, per)
            ]
            y = torch.cat(parts, 1)
        else:
            y = kernel(z, state)
        (y * weights).sum().backward()
        grads = [z.grad] + ([state.grad] if state is not None else []) + [p.grad for p in kernel.parameters()]
        results.append((y.detach(), [g.clone() for g in grads]))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, **F64)
    torch.testing.assert_close(
        y1, s4d_recurrence(kernel, z.detach(), None if state is None else state.detach())[0], **F64
    )
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, **F64)


def segmented_models(variant, chunk=4):
    """Two copies of one float64 model with ``chunk``-token S4D chunks: the segmented context path (segments of 12
    tokens) and the whole-sequence path (``segment_len = 0``)."""
    from conftest import make_model

    from modeling_bst.context_bst import TokenContextStates

    models = []
    for seg in (12, 0):
        model = make_model(variant, dtype=torch.float64)
        for m in model.modules():
            if isinstance(m, S4DKernel):
                m.chunk_len = chunk
        for layer in model.model.layers:
            if isinstance(getattr(layer, "context", None), TokenContextStates):
                layer.context.segment_len = seg
                assert layer.context.use_segments(layer.ssm) == bool(seg)
        models.append(model)
    return models


@pytest.mark.parametrize("chunk", [4, 3], ids=["chunk4", "chunk3"])
@pytest.mark.parametrize("variant", ["mh-s4"])
def test_segmented_context_equals_whole_sequence(variant, chunk, monkeypatch):
    """Logits and every gradient, training (with padding) and evaluation, are those of the whole-sequence path."""
    seg, whole = segmented_models(variant, chunk)
    calls = []
    original = S4DKernel.channel_major_chunks
    monkeypatch.setattr(
        S4DKernel, "channel_major_chunks", lambda self, *a: calls.append(a[0].shape[1]) or original(self, *a)
    )
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (2, 61))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: row 1 has 54 tokens
    for train in (True, False):
        out = []
        for model in (seg, whole):
            model.train(train).zero_grad()
            logits = model(ids, attention_mask=mask).logits
            (logits.pow(2) * mask[..., None]).sum().backward()
            out.append(
                (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            )
        torch.testing.assert_close(out[0][0], out[1][0], **F64)
        assert out[0][1].keys() == out[1][1].keys() and len(out[0][1]) > 10
        for name in out[0][1]:
            torch.testing.assert_close(out[0][1][name], out[1][1][name], **F64, msg=name)
    # 64 tokens (61 + block padding) in segments of 12 tokens: 5 of 12 and one of 4 (chunk 4), or one of 6 (chunk 3:
    # 64 tokens padded to 22 chunks; the 2 padding tokens are dropped after the lift)
    assert calls and set(calls) == {12, 64 - 60 if chunk == 4 else 66 - 60}


@pytest.mark.parametrize("variant", ["mh-s4"])
def test_segmented_context_continues_a_cache_exactly(variant):
    """A prefill (fill_cache), a continued sequence from that cache (carried SSM state) and token steps after it
    give the same logits on both paths."""
    seg, whole = segmented_models(variant)
    torch.manual_seed(4)
    ids = torch.randint(0, 97, (2, 50))
    out = []
    for model in (seg, whole):
        with torch.no_grad():
            first = model(ids[:, :24], use_cache=True)
            second = model(ids[:, 24:44], past_key_values=first.past_key_values, use_cache=True)
            cache, steps = second.past_key_values, []
            for t in range(44, 50):
                step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                steps.append(step.logits)
        out.append(torch.cat([first.logits, second.logits] + steps, 1))
    torch.testing.assert_close(out[0], out[1], **F64)
    # and both equal the whole sequence at once
    with torch.no_grad():
        torch.testing.assert_close(out[0], whole(ids).logits, atol=1e-9, rtol=0)


def test_append_history_is_a_shift_and_keeps_earlier_histories():
    history = torch.randn(2, 3, 10, dtype=torch.float64)
    ref, kept = history.clone(), []
    for _ in range(60):  # several refills of the slack
        z = torch.randn(2, 3, dtype=torch.float64)
        history, ref = append_history(history, z), torch.cat([ref[..., 1:], z[..., None]], -1)
        assert torch.equal(history, ref)
        kept.append((history, ref.clone()))
    assert all(torch.equal(h, r) for h, r in kept[-10:])  # a step writes only beyond every earlier view
    # Where gradients flow it is an ordinary out-of-place shift.
    z = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = append_history(history, z)
    out.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones_like(z))


# -- unstruct filters -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 8, 17], ids=lambda n: f"L{n}")
def test_unstruct_forward_equals_direct_convolution(length):
    filt = make_unstruct()
    z = torch.randn(2, length, 3, dtype=torch.float64)
    taps = filt.filters(length)
    assert taps.shape == (2, 3, length)
    u = z.transpose(1, 2)
    ref = direct_causal_conv(u, taps.detach()) + filt.bias.detach()[None, :, :, None] * u[:, None]
    torch.testing.assert_close(filt(z), ref.permute(0, 3, 1, 2), **F64)


def test_unstruct_filters_are_prefixes():
    """Taps for a shorter length are the prefix of longer ones (the filter does not depend on the sequence length)."""
    filt = make_unstruct()
    torch.testing.assert_close(filt.filters(9), filt.filters(40)[..., :9], **F64)


@pytest.mark.parametrize("hist_len,length", [(1, 5), (7, 1), (12, 9)], ids=lambda x: str(x))
def test_unstruct_forward_with_history_equals_forward_on_concatenation(hist_len, length):
    filt = make_unstruct()
    hist, z = torch.randn(2, hist_len, 3, dtype=torch.float64), torch.randn(2, length, 3, dtype=torch.float64)
    full = filt(torch.cat([hist, z], 1))[:, hist_len:]
    torch.testing.assert_close(filt(z, hist.transpose(1, 2)), full, **F64)


@pytest.mark.parametrize("length", [1, 4, 13, 40], ids=lambda n: f"L{n}")
def test_unstruct_step_equals_forward_at_last_position(length):
    filt = make_unstruct()
    z = torch.randn(2, length, 3, dtype=torch.float64)
    torch.testing.assert_close(filt.output_at_newest(z.transpose(1, 2)), filt(z)[:, -1], **F64)
    # With precomputed taps (what the decoding cache does).
    y_t = filt.output_at_newest(z.transpose(1, 2), constants=filt.step_constants())
    torch.testing.assert_close(y_t, filt(z)[:, -1], **F64)


def test_unstruct_rejects_lengths_beyond_its_filter():
    filt = make_unstruct()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        filt.filters(41)


def test_bidirectional_unstruct_matches_two_sided_sum():
    filt = make_unstruct(bidirectional=True)
    z = torch.randn(2, 10, 3, dtype=torch.float64)
    taps = filt.filters(10).detach()
    assert taps.shape == (2, 2, 3, 10)
    u = z.transpose(1, 2)
    ref = two_sided_conv(u, taps[0], taps[1]) + filt.bias.detach()[None, :, :, None] * u[:, None]
    torch.testing.assert_close(filt(z), ref.permute(0, 3, 1, 2), **F64)


def test_unstruct_stays_float32_under_bf16_autocast():
    filt = make_unstruct(dtype=torch.float32)
    z = torch.randn(2, 15, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = filt(z.bfloat16())
        y_t = filt.output_at_newest(z.bfloat16().transpose(1, 2))
    assert y.dtype == torch.float32 and y_t.dtype == torch.float32
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, filt(z.bfloat16().float()), atol=1e-5, rtol=1e-5)


# -- the contract shared by both kernels (forward / final_state / step / block_end_outputs) -----------------------

KERNELS = {"s4d": lambda: make_s4d(channels=3, out_channels=2), "unstruct": make_unstruct}


@pytest.mark.parametrize("kind", list(KERNELS))
def test_kernels_share_one_recurrent_contract(kind):
    """Stepping from ``empty_state`` with ``step_constants`` equals ``forward``; the stepped state equals
    ``final_state``; a forward continued from a state equals the forward over the whole sequence; block ends agree."""
    kernel = KERNELS[kind]()
    z = torch.randn(2, 12, 3, dtype=torch.float64)
    full = kernel(z)  # (B, L, C, Ds)
    state = kernel.empty_state(2, z.device)
    constants = kernel.step_constants()
    for t in range(12):
        y_t, state = kernel.step(z[:, t], state, constants, seen=t + 1)
        torch.testing.assert_close(y_t, full[:, t], **F64)
    torch.testing.assert_close(state, kernel.final_state(z), **F64)
    prefix_state = kernel.final_state(z[:, :8])
    torch.testing.assert_close(kernel(z[:, 8:], prefix_state), full[:, 8:], **F64)
    torch.testing.assert_close(kernel.final_state(z[:, 8:], prefix_state), state, **F64)
    torch.testing.assert_close(kernel.block_end_outputs(z, 4), full[:, 3::4], **F64)
