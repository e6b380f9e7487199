"""S4D's chunked training path in real arithmetic (``s4d_chunked_forward``, ``chunk_start_states``,
``channel_major_chunks``, ``block_end_outputs``): equal to the complex forms and to the recurrence in float64 (outputs
and every gradient), no complex tensor in its forward or backward, few backend ops, one graph under torch.compile."""

import pytest
import torch
from conftest import tiny_config
from reference import (
    complex_block_end_outputs,
    complex_chunk_start_states,
    complex_chunked_forward,
    s4d_recurrence,
    stacked_states,
)

from benchmarks.ssm_ops import OpCounter, count, make_kernel
from modeling_bst.ssm_bst import ChunkTables, PerFilterS4D, S4DKernel, chunk_groups, grouped_chunk_tables


F64 = dict(atol=1e-12, rtol=1e-10)


def make_s4d(channels=5, out_channels=3, state_size=8, dtype=torch.float64):
    """An initialised S4D kernel moved off its structured init (B = 1, shared A, ...), as in test_ssm.py."""
    kernel = S4DKernel(channels, out_channels, state_size, tiny_config()).to(dtype)
    kernel.reset_parameters()
    with torch.no_grad():
        kernel.A_log_real.add_(0.3 * torch.randn_like(kernel.A_log_real))
        kernel.A_imag.add_(0.5 * torch.randn_like(kernel.A_imag))
        kernel.B.add_(0.3 * torch.randn_like(kernel.B))
        kernel.log_dt.add_(0.5 * torch.randn_like(kernel.log_dt))
    return kernel.train()


def random_state(kernel, bsz=2):
    return s4d_recurrence(kernel, torch.randn(bsz, 6, kernel.channels, dtype=torch.float64))[1]


def outputs_and_grads(kernel, z, state, run):
    """``run(kernel, z, state)`` and the gradients of a random projection of it to ``z``, ``state`` and every
    parameter."""
    kernel.zero_grad()
    z = z.detach().clone().requires_grad_(True)
    state = None if state is None else state.detach().clone().requires_grad_(True)
    y = run(kernel, z, state)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)  # any strides of y
    (y * weights).sum().backward()
    grads = [z.grad] + ([state.grad] if state is not None else []) + [p.grad.clone() for p in kernel.parameters()]
    return y.detach(), grads


def assert_same(a, b):
    (ya, ga), (yb, gb) = a, b
    torch.testing.assert_close(ya, yb, **F64)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, **F64)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "with-state"])
@pytest.mark.parametrize("out_channels", [1, 3], ids=["C1", "C3"])
@pytest.mark.parametrize("length,chunk", [(3, 4), (4, 4), (7, 4), (29, 4), (64, 4), (81, 4), (131, 8)])
def test_real_chunked_forward_equals_complex_form_and_recurrence(length, chunk, out_channels, with_state):
    """Outputs and gradients (input, carried state, every parameter) of the real chunked form are those of the
    complex chunked form (FFT within chunks, complex scan) and of the per-token recurrence, for lengths that are not
    multiples of the chunk, one chunk, a perfect square of chunks (64 / 4 = 16) and not (81 / 4 -> 21)."""
    kernel = make_s4d(out_channels=out_channels).train()
    kernel.chunk_len = chunk
    assert kernel.use_chunks(length, 8)
    z = torch.randn(2, length, 5, dtype=torch.float64)
    state = random_state(kernel) if with_state else None
    real = outputs_and_grads(kernel, z, state, lambda k, x, s: k(x, s))
    chunk_used = min(chunk, length)
    reference = outputs_and_grads(kernel, z, state, lambda k, x, s: complex_chunked_forward(k, x, chunk_used, s))
    assert real[0].shape == (2, length, out_channels, 5)
    assert_same(real, reference)
    torch.testing.assert_close(real[0], s4d_recurrence(kernel, z, state)[0], **F64)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "with-state"])
@pytest.mark.parametrize("block_len,num_blocks", [(1, 5), (3, 1), (4, 7), (5, 4), (4, 16), (2, 30)])
def test_real_block_end_outputs_equal_complex_form(block_len, num_blocks, with_state):
    """MF's block-end outputs (local block states, two-level scan, read-out): outputs and gradients as the complex
    form's (log-depth complex scan), outputs as the recurrence's."""
    kernel = make_s4d(out_channels=4)
    z = torch.randn(2, block_len * num_blocks, 5, dtype=torch.float64)
    state = random_state(kernel) if with_state else None
    real = outputs_and_grads(kernel, z, state, lambda k, x, s: k.block_end_outputs(x, block_len, s))
    reference = outputs_and_grads(kernel, z, state, lambda k, x, s: complex_block_end_outputs(k, x, block_len, s))
    assert real[0].shape == (2, num_blocks, 4, 5)
    assert_same(real, reference)
    torch.testing.assert_close(real[0], s4d_recurrence(kernel, z, state)[0][:, block_len - 1 :: block_len], **F64)


def test_real_chunked_forward_chunk_start_states():
    """The chunk-start states from a carried state `(B, Ds, N2, 2)` equal the complex reference's; the first is the
    given state, stacked (re, im)."""
    kernel = make_s4d(out_channels=2)
    z = torch.randn(2, 24, 5, dtype=torch.float64)
    state = random_state(kernel)
    a = kernel.chunk_start_states(z, 4, state, kernel.chunk_tables(4, 6))
    want = stacked_states(complex_chunk_start_states(kernel, z, 4, state))  # (Ds, B * nc, 2 N2)
    torch.testing.assert_close(a.reshape(want.shape), want, **F64)
    torch.testing.assert_close(a[:, :, 0], torch.cat([state[..., 0], state[..., 1]], -1).transpose(0, 1), **F64)


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 5, 16, 17, 63, 64, 65, 256])
def test_chunk_groups_cover_the_chunks(num_chunks):
    groups, num_groups = chunk_groups(num_chunks)
    if num_chunks == 1:
        assert (groups, num_groups) == (0, 0)
    else:
        assert groups * num_groups >= num_chunks and num_groups <= groups and groups * groups < 2 * num_chunks + 2


def no_complex_step(run):
    """Forward and backward of ``run()`` (a tensor) inside a dispatch mode that fails on any complex output."""
    with OpCounter(forbid_complex=True) as counter:
        y = run()
        (y * torch.randn(y.shape, dtype=y.dtype)).sum().backward()
    return counter


@pytest.mark.parametrize("kind", ["sh", "mh", "mf", "mf-per-filter", "short"])
def test_training_path_creates_no_complex_tensor(kind):
    """SH (C = 1), MH (C = H) and MF (block-end outputs; shared state or one SSM per filter) in training, float32,
    under bf16 autocast as in training: no op returns a complex tensor, forward or backward."""
    kernel = make_s4d(dtype=torch.float32, out_channels=1 if kind in ("sh", "short") else 4)
    if kind == "mf-per-filter":
        kernel = PerFilterS4D(5, 4, 8, tiny_config()).train()
        kernel.kernel.reset_parameters()
    length = 20 if kind == "short" else 300
    z = torch.randn(2, length, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kind.startswith("mf"):
            no_complex_step(lambda: kernel.block_end_outputs(z.bfloat16(), 4))
        else:
            no_complex_step(lambda: kernel(z.bfloat16()))
    assert z.grad is not None and torch.isfinite(z.grad).all()


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-s4"])
def test_model_training_step_creates_no_complex_tensor(variant):
    """A whole model's training forward and backward (the SSM inside BST layers: SH, MH's segmented path, MF)."""
    from conftest import SEQ_LEN, make_model

    model = make_model(variant).train()
    for m in model.modules():
        if isinstance(m, S4DKernel):
            m.chunk_len = 4  # several chunks at the test length
    ids = torch.randint(0, 97, (2, 4 * SEQ_LEN))
    counter = no_complex_step(lambda: model(ids).logits)
    assert counter.total > 0


# Measured at L = 4096, Ds = 128, N = 64 (SH: C = 1), float32: 44 forward and 171 backward ops (the complex chunked
# path it replaced: 106 and 286). The bounds leave room for small changes but fail on a return to the complex path.
FORWARD_OPS_BOUND = 66
BACKWARD_OPS_BOUND = 256


@pytest.mark.parametrize("out_channels", [1, 8], ids=["SH", "MH"])
def test_op_count_regression_bound(out_channels):
    """Backend ops of one SSM's forward and backward at L = 4096 (a narrow kernel: the op sequence does not depend
    on the width). The forward is ~2.4x fewer ops than the complex path's; see docs/performance.md."""
    kernel = make_kernel(channels=4, out_channels=out_channels, state_size=64)
    z = torch.randn(1, 4096, 4)
    kernel(z).sum().backward()  # the exponent table's first build is not part of a step
    fwd, bwd = count(kernel, z)
    assert fwd.total <= FORWARD_OPS_BOUND, dict(fwd.counts)
    assert bwd.total <= BACKWARD_OPS_BOUND, dict(bwd.counts)
    for name in ("_fft_r2c", "_fft_c2r", "complex", "polar", "view_as_complex"):
        assert name not in fwd.counts and name not in bwd.counts


def test_exponent_table_built_in_inference_mode_serves_training():
    """The exponent tables are kept between calls: one first built under inference_mode must not be an inference
    tensor (a training step saves it for its backward)."""
    kernel = make_s4d(dtype=torch.float32, out_channels=2).train()
    kernel.chunk_len = 5  # a chunk length no other test uses: a fresh table
    z = torch.randn(2, 33, 5)
    with torch.inference_mode():
        ref = kernel(z)
    z.requires_grad_(True)
    y = kernel(z)
    y.sum().backward()
    torch.testing.assert_close(y.detach(), ref)


def test_compiled_fullgraph_forward_backward_matches_eager():
    """torch.compile(fullgraph=True) of the SSM's forward and backward (aot_eager: AOTAutograd's graphs, eager
    kernels): one graph, the eager numbers."""
    torch._dynamo.reset()
    kernel = make_s4d(dtype=torch.float32, out_channels=1).train()
    kernel.chunk_len = 8
    z = torch.randn(2, 70, 5, requires_grad=True)

    def step(x):
        y = kernel(x)
        return (y * y).sum()

    eager = step(z)
    (grad_eager,) = torch.autograd.grad(eager, z)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(z)
    (grad,) = torch.autograd.grad(loss, z)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, grad_eager, rtol=1e-5, atol=1e-5)


def test_grouped_chunk_tables_equal_each_kernels_own():
    """One call for kernels of one shape (parameters concatenated along the channels) gives each kernel the tables
    it computes alone, conv and block-end (conv=False) forms, one chunk and scanned."""
    kernels = [make_s4d(channels=c, out_channels=3) for c in (5, 2, 7)]
    for chunk, num_chunks, conv in [(4, 1, True), (4, 10, True), (8, 5, False)]:
        grouped = grouped_chunk_tables(kernels, chunk, num_chunks, conv)
        for kernel, tables in zip(kernels, grouped):
            own = kernel.chunk_tables(chunk, num_chunks, conv)
            assert len(tables) == len(own)
            for a, b in zip(tables, own):
                torch.testing.assert_close(a, b, **F64)


def model_outputs_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    (
        logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=logits.dtype)
    ).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-s4"])
def test_model_shares_chunk_tables_with_per_layer_numbers(variant, monkeypatch):
    """A training forward computes the chunk tables of its BST layers' S4D kernels in one call; logits and every
    gradient (float64) are those of each layer computing its own (hooked kernels compute their own)."""
    from conftest import SEQ_LEN, make_model

    from modeling_bst import ssm_bst

    model = make_model(variant, dtype=torch.float64, bst_layer_indices=[0, 1, 2]).train()
    for m in model.modules():
        if isinstance(m, S4DKernel):
            m.chunk_len = 4
    ids = torch.randint(0, 97, (2, 4 * SEQ_LEN))
    calls = []
    grouped = ssm_bst.grouped_chunk_tables
    monkeypatch.setattr(ssm_bst, "grouped_chunk_tables", lambda ks, *a: calls.append(len(ks)) or grouped(ks, *a))
    shared = model_outputs_and_grads(model, ids)
    assert calls == [3]
    calls.clear()
    for layer in model.model.layers:
        layer.ssm.register_forward_hook(lambda *args: None)
    alone = model_outputs_and_grads(model, ids)
    assert calls == [1, 1, 1]
    assert_same(shared, alone)


def test_compiled_model_training_step_is_one_graph_without_complex_values():
    """torch.compile(fullgraph=True) of a training step of a model whose BST layers share their chunk tables: one
    graph, no complex value in AOTAutograd's forward and backward graphs, eager's loss and gradients."""
    from conftest import SEQ_LEN, make_model
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    model = make_model("sh-s4", bst_layer_indices=[0, 1, 2]).train()
    for m in model.modules():
        if isinstance(m, S4DKernel):
            m.chunk_len = 4
    ids = torch.randint(0, 97, (1, 4 * SEQ_LEN))
    graphs, aot = [], []

    def keep(gm, example_inputs):
        aot.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    def step():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = step()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    model.zero_grad()
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    torch._dynamo.reset()
    assert len(graphs) == 1 and len(aot) == 2
    values = [n.meta.get("val") for gm in aot for n in gm.graph.nodes]
    assert not any(isinstance(v, torch.Tensor) and v.is_complex() for v in values)
    torch.testing.assert_close(loss.detach(), eager[0], rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), eager[1]):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_chunk_tables_list_only_kernels_whose_parameters_are_plain_here():
    """Kernels with hooks (adapters, offloading) or parameters that are not plain tensors in this forward (meta:
    offloaded; FSDP's sharded DTensors likewise) compute their own tables."""
    plain = [make_s4d(), make_s4d()]
    hooked = make_s4d()
    hooked.register_forward_pre_hook(lambda *args: None)
    offloaded = make_s4d().to("meta")
    assert ChunkTables(plain + [hooked, offloaded]).kernels == plain
