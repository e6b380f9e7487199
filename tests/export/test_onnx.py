"""ONNX export (issue #36): the SSM kernels' real-arithmetic form equals the complex / FFT form (float64, to 1e-10),
and ``training.onnx_export.export_onnx`` writes a forward, a prefill and a decode step that ONNX Runtime runs with
PyTorch's logits (within 1e-4 in float32) and greedy tokens."""

import json

import pytest
import torch
from conftest import make_model, tiny_config
from reference import complex_block_end_outputs

from modeling_bst.ssm_bst import S4DKernel, UnstructFilter, real_arithmetic, use_real_arithmetic
from training.cache_snapshot import cache_to_tensors


TOL = dict(atol=1e-10, rtol=1e-10)


def s4d(bidirectional=False, seed=0):
    """A float64 S4D kernel (3 channels, 2 read-outs, 4 complex modes) with randomised parameters."""
    torch.manual_seed(seed)
    config = tiny_config(bidirectional=bidirectional)
    with torch.device("cpu"):
        kernel = S4DKernel(3, 2, 8, config).double()
    kernel.reset_parameters()
    with torch.no_grad():
        for p in kernel.parameters():
            p.add_(0.1 * torch.randn_like(p))
        kernel.log_dt.copy_(torch.tensor([-1.0, -3.0, -6.0]))  # large and small steps (expm1 near zero)
    return kernel


def random_state(kernel, rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, kernel.channels, kernel.n_modes, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("length", [9, 200])  # 200: the eager form runs chunk by chunk (> 2 * chunk_len)
def test_s4d_real_arithmetic_equals_the_eager_form(length):
    """Direct convolutions (real arithmetic) against the eager forms, from a state `(B, Ds, N2, 2)`; the recurrent
    step continues the outputs and the state."""
    kernel = s4d()
    z = torch.randn(2, length, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    state = random_state(kernel, 2)
    with torch.no_grad():
        with real_arithmetic():  # the direct convolution
            assert use_real_arithmetic()
            direct, direct_state = kernel(z), kernel(z, state)
            final = kernel.final_state(z, state)
            ends = kernel.block_end_outputs(z[:, :8], 4, state)
        assert not use_real_arithmetic()
        torch.testing.assert_close(direct, kernel(z), **TOL)
        torch.testing.assert_close(direct_state, kernel(z, state), **TOL)
        assert final.dtype == torch.float64 and final.shape == state.shape
        torch.testing.assert_close(final, kernel.final_state(z, state), **TOL)
        torch.testing.assert_close(ends, kernel.block_end_outputs(z[:, :8], 4, state), **TOL)
        torch.testing.assert_close(
            kernel.block_end_outputs(z[:, :8], 4), complex_block_end_outputs(kernel, z[:, :8], 4), **TOL
        )
        x, constants = state, kernel.step_constants()
        for t in range(6):
            y, x = kernel.step(z[:, t], x, constants)
            torch.testing.assert_close(y, direct_state[:, t], **TOL)
        torch.testing.assert_close(x, kernel.final_state(z[:, :6], state), **TOL)


def test_s4d_bidirectional_real_arithmetic_equals_the_fft_form():
    kernel = s4d(bidirectional=True)
    z = torch.randn(2, 13, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with real_arithmetic():
            direct = kernel(z)
        torch.testing.assert_close(direct, kernel(z), **TOL)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_unstruct_direct_convolution_equals_the_fft(bidirectional):
    torch.manual_seed(0)
    config = tiny_config(bidirectional=bidirectional)
    filt = UnstructFilter(3, 2, config).double()
    filt.reset_positional_features()
    with torch.no_grad():
        for p in filt.parameters():
            if p is not filt.pos_emb:
                p.copy_(torch.randn_like(p))
    z = torch.randn(2, 20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    history = torch.randn(2, 3, 7, dtype=torch.float64)
    with torch.no_grad():
        want, want_continued = filt(z), filt(z, history)
        with real_arithmetic():
            torch.testing.assert_close(filt(z), want, **TOL)
            torch.testing.assert_close(filt(z, history), want_continued, **TOL)


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-s4", "sh-unstruct", "bst-brect", "gss"])
def test_model_in_real_arithmetic_equals_the_complex_model_in_float64(variant):
    """Forward, prefill, cached steps and a continued chunk of whole float64 models, in both forms."""
    extra = dict(bst_layer_indices=[], gss_layer_indices=[0, 2]) if variant == "gss" else {}
    model = make_model(None if variant == "gss" else variant, dtype=torch.float64, **extra)
    ids = torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
        prefill = model(ids[:, :9], use_cache=True)
        steps = [model(ids[:, t : t + 1], past_key_values=prefill.past_key_values).logits for t in range(9, 13)]
        chunk = model(ids[:, 13:18], past_key_values=prefill.past_key_values).logits  # continued from the state
        with real_arithmetic():
            torch.testing.assert_close(model(ids).logits, want, **TOL)
            real_prefill = model(ids[:, :9], use_cache=True)
            torch.testing.assert_close(real_prefill.logits, prefill.logits, **TOL)
            for t, step in zip(range(9, 13), steps):
                got = model(ids[:, t : t + 1], past_key_values=real_prefill.past_key_values).logits
                torch.testing.assert_close(got, step, **TOL)
            got = model(ids[:, 13:18], past_key_values=real_prefill.past_key_values).logits
            torch.testing.assert_close(got, chunk, **TOL)
    # The real form's cache holds no complex tensor.
    assert not any(t.is_complex() for t in cache_to_tensors(real_prefill.past_key_values).values())


# -- export -------------------------------------------------------------------------------------------------------------
ONNX_VARIANTS = [
    "sh-s4",
    pytest.param("mh-s4", marks=pytest.mark.slow),
    pytest.param("mf-s4", marks=pytest.mark.slow),
    pytest.param("sh-unstruct", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant", ONNX_VARIANTS)
def test_onnx_export_runs_in_onnxruntime_with_pytorchs_numbers(variant, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="ONNX export needs onnx + onnxscript (pip install -e .[onnx])")
    ort = pytest.importorskip("onnxruntime", reason="the check needs onnxruntime (pip install -e .[onnx])")
    from training.onnx_export import export_onnx

    # Two layers, a BST layer and a block attention layer: every kind of state the exported files carry (the export
    # of each of the three files is dynamo tracing, seconds per layer on one CPU core).
    model = make_model(variant, num_hidden_layers=2, bst_layer_indices=[0])
    batch, length, steps = 2, 12, 6
    # Unstruct: the float32 model itself is 1.5e-4 from its float64 copy (the filter's sine MLP, in PyTorch's FFT
    # form and in the direct form alike), so its two float32 runtimes agree to that order, not to 1e-4.
    tol = dict(atol=3e-4 if "unstruct" in variant else 1e-4, rtol=0)
    result = export_onnx(model, tmp_path, seq_len=length, batch_size=batch)
    assert "ONNX export" in capsys.readouterr().err  # a progress bar: each file takes seconds to minutes
    assert not use_real_arithmetic()  # the export left the model in its eager form
    names = json.loads((tmp_path / "onnx_state.json").read_text())["state"]
    ids = torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(7))  # not the traced input

    forward = ort.InferenceSession(str(tmp_path / "model.onnx"))
    prefill = ort.InferenceSession(str(tmp_path / "prefill.onnx"))
    step = ort.InferenceSession(str(tmp_path / "decode_step.onnx"))
    assert [i.name for i in step.get_inputs()] == ["input_ids", *[f"past.{n}" for n in names]]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    torch.testing.assert_close(torch.from_numpy(forward.run(None, {"input_ids": ids.numpy()})[0]), out.logits, **tol)
    onnx_logits, *state = prefill.run(None, {"input_ids": ids.numpy()})
    torch.testing.assert_close(torch.from_numpy(onnx_logits), out.logits, **tol)

    # Greedy decoding: ONNX Runtime from its prefill's state, PyTorch (the complex eager form) from its cache.
    cache, logits = out.past_key_values, out.logits[:, -1]
    onnx_tokens, torch_tokens, worst = [], [], 0.0
    onnx_next = torch_next = logits.argmax(-1, keepdim=True)
    for _ in range(steps):
        with torch.no_grad():
            out = model(torch_next, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        onnx_logits, *state = step.run(
            None, {"input_ids": onnx_next.numpy(), **{f"past.{n}": s for n, s in zip(names, state)}}
        )
        onnx_logits = torch.from_numpy(onnx_logits)
        worst = max(worst, (onnx_logits - out.logits).abs().max().item())
        torch.testing.assert_close(onnx_logits, out.logits, **tol)
        torch_next, onnx_next = out.logits[:, -1].argmax(-1, keepdim=True), onnx_logits[:, -1].argmax(-1, keepdim=True)
        torch_tokens.append(torch_next)
        onnx_tokens.append(onnx_next)
    assert torch.equal(torch.cat(onnx_tokens, 1), torch.cat(torch_tokens, 1))
    print(f"{variant}: export {result['seconds']}, decode max |ORT - PyTorch| {worst:.2e}")


def test_export_cli_onnx_flag_writes_the_onnx_folder(tmp_path, monkeypatch):
    """``python -m training.export ... --onnx`` exports the written Hub folder's model into OUT/onnx (the export
    itself is the test above; here it is recorded, not run)."""
    from test_export import trained_folder

    from training import export as export_mod

    calls = []

    def record(model, folder, seq_len, batch_size):
        calls.append((type(model).__name__, folder, seq_len, batch_size))
        return {"files": [str(folder / "model.onnx")], "seconds": {}}

    monkeypatch.setattr(export_mod, "export_onnx", record)
    folder = trained_folder(tmp_path)
    out = export_mod.main(["--model", str(folder), "--out", str(tmp_path / "hub"), "--onnx", "--onnx_seq_len", "16"])
    assert calls == [("BSTForCausalLM", out / "onnx", 16, 1)]
    export_mod.main(["--model", str(folder), "--out", str(tmp_path / "hub2")])
    assert len(calls) == 1  # without --onnx: no ONNX export
