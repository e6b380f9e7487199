"""benchmarks/train_ops.py (issue #44): the op counter itself (views and ``_unsafe_view`` not counted, compute ops and
in-place writes counted), the counts of a training step and a decode step at a tiny size on both code paths, the
classification of a compiled graph's calls; the full command line and inductor's compiled step in the slow run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks import train_ops


ROOT = Path(__file__).resolve().parents[2]
# The 60m layer structure (8 layers, BST layers {0, 5, 6}) at the narrow width, two blocks of W = 64.
SEQ_LEN, W = 128, 64


def test_views_are_not_counted_compute_ops_and_writes_are():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with train_ops.OpCounter() as counter:
        x.view(16), x.t(), x.transpose(0, 1).unsqueeze(0), x.expand(2, 4, 4), x[1:]  # views
        torch.ops.aten._unsafe_view(x.contiguous(), [16])  # contiguous of a contiguous tensor: no op
        x + y, x @ y  # compute
        x.add_(1)  # an in-place write returns an alias that writes: counted
        torch.view_as_complex(torch.randn(4, 2)).exp()  # a view, then a complex-valued op
    assert counter.counts == {"add": 1, "mm": 1, "add_": 1, "randn": 1, "exp": 1}, counter.counts
    assert counter.total == 5 and counter.complex_outputs == 1
    assert counter.views["_unsafe_view"] == 1 and sum(counter.views.values()) == 8
    summary = counter.summary()
    assert summary["ops"] == 5 and summary["unsafe_view"] == 1 and summary["_to_copy"] == 0


def test_casts_of_autocast_are_counted():
    x = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), train_ops.OpCounter() as counter:
        x @ x
    assert counter.counts["_to_copy"] >= 1 and counter.counts["mm"] == 1


@pytest.fixture(scope="module")
def train_rows():
    rows = [
        train_ops.count_training("bst", SEQ_LEN, False, block_len=W),
        train_ops.count_training("bst", SEQ_LEN, True, block_len=W),
        train_ops.count_training("llama", SEQ_LEN, False, block_len=W),
    ]
    train_ops.ratios(rows, "total")
    return rows


def test_training_step_counts_are_sane(train_rows):
    bst_cpu, bst_acc, llama = train_rows
    assert (bst_cpu["path"], bst_acc["path"]) == ("cpu", "accelerator")
    for r in train_rows:
        assert r["forward"] > 0 and r["backward"] > 0 and r["total"] == r["forward"] + r["backward"]
        assert r["total"] == sum(r["forward_by_op"].values()) + sum(r["backward_by_op"].values())
        assert r["_to_copy_forward"] > 0  # bf16 autocast's casts
        assert r["views"] > 0 and "view" not in r["forward_by_op"] and "_unsafe_view" not in r["forward_by_op"]
        assert len(r["top"]) == train_ops.TOP
    # a BST layer has more sublayers than a Llama layer (SSM, context, cross-attention), but since issue #44 less than
    # twice the ops per step on the accelerator path, no more there than on the CPU's, and no complex arithmetic
    assert llama["total"] < bst_acc["total"] <= bst_cpu["total"]
    assert bst_acc["total"] < 2 * llama["total"]
    assert bst_cpu["complex_outputs"] == bst_acc["complex_outputs"] == llama["complex_outputs"] == 0
    # Llama's known forward at any L (8 layers): 423 compute ops and 57 _unsafe_view with transformers 5.24 (the notes'
    # table); 5.23's Llama runs 16 more (two per layer), the oldest release that setup.cfg accepts
    expected = {(5, 23): 439, (5, 24): 423}[tuple(int(x) for x in transformers.__version__.split(".")[:2])]
    assert (llama["forward"], llama["unsafe_view_forward"]) == (expected, 57)


def test_decode_step_counts_are_sane():
    rows = [train_ops.count_decode(k, 2 * W, path, block_len=W) for k in ("bst", "llama") for path in (False, True)]
    train_ops.ratios(rows, "ops")
    bst_cpu, bst_acc, llama_cpu, llama_acc = rows
    assert all(r["ops"] > 0 for r in rows) and llama_cpu["ops"] == llama_acc["ops"]
    assert bst_cpu["ops"] > llama_cpu["ops"] and bst_cpu["vs_llama"] > 1 and llama_acc["vs_llama"] == 1
    assert llama_cpu["equal"] == llama_cpu["_local_scalar_dense"] == 0
    # host reads on the accelerator path: today only the token-id range check (int(ids.min()), int(ids.max()))
    assert bst_acc["_local_scalar_dense"] <= 2


def test_train_ops_tables_and_docs_render(train_rows, tmp_path, monkeypatch):
    decode = [train_ops.count_decode("llama", 2 * W, False, block_len=W)]
    train_ops.ratios(decode, "ops")
    inductor = [dict(kind="llama", model="HF Llama (sdpa)", path="cpu", launches=10, vs_llama=1.0,
        kernel_calls=6, library_calls=4, fallback_calls=0, custom_calls=0, view_calls=2, complex_nodes=0,
        graph_count=1, graph_breaks=0, compile_s=1.0, layers=2, seq_len=128, fallback_ops={}, custom_ops={})]  # fmt: skip
    meta = dict(cpu="cpu", torch="t", transformers="x", seq_len=SEQ_LEN, block_len=W, context=2 * W, command="c")
    result = dict(meta=meta, train=train_rows, decode=decode, inductor=inductor)
    written = {}
    monkeypatch.setattr(train_ops, "write_section", lambda name, lines: written.update({name: lines}))
    train_ops.write_docs(result)
    text = "\n".join(written["train_ops"])
    assert "| BST:SH:S4 | accelerator |" in text and "| HF Llama (StaticCache) | cpu |" in text
    assert "| HF Llama (sdpa) | cpu | 10 | 1.00x | 6 | 4 | 0 | 0 | 2 | 0 | 1 / 0 | 1 |" in text
    train_ops.plot(result, tmp_path / "ops.png")
    assert (tmp_path / "ops.png").stat().st_size > 0


@pytest.mark.parametrize(
    "name, kind",
    [
        ("graph_0_cpp_fused__to_copy_add_mean_0", "kernel"),
        ("triton_poi_fused_add_0", "kernel"),
        ("aten::mm", "library"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "library"),
        ("aten::view", "view"),
        ("aten::_unsafe_view", "view"),
        ("aten::mul", "fallback"),
        ("aten::_fft_c2c", "fallback"),
        ("bst::fft_conv", "custom"),
    ],
)
def test_compiled_graph_calls_are_classified(name, kind):
    assert train_ops.classify_compiled_call(name) == kind


def test_flags_are_checked_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        train_ops.parse_args(["--kinds", "bst", "slide"])
    assert "must include llama" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_ops.parse_args(["--seq-len", "0"])
    args = train_ops.parse_args(["--kinds", "llama", "bst", "--paths", "accelerator"])
    assert args.kinds == ["bst", "llama"] and args.paths == ["accelerator"] and not args.inductor


@pytest.mark.slow
def test_quick_command_line_writes_its_json(tmp_path):
    out = tmp_path / "ops.json"
    cmd = [sys.executable, "-m", "benchmarks.train_ops", "--quick", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["train"]) == len(result["decode"]) == 6 and result["inductor"] == []
    assert "forward ops" in proc.stdout and not out.with_suffix(".png").exists()


@pytest.mark.slow
def test_inductor_compiled_step_counts_llama():
    """A cold inductor compile of the tiny Llama's training step (~1 minute): every launch classified, no complex
    node, one graph and no break."""
    row = train_ops.count_inductor("llama", 64)
    assert row["kernel_calls"] > 0 and row["library_calls"] > 0 and row["graphs_called"] == 2
    assert row["launches"] == row["kernel_calls"] + row["library_calls"] + row["fallback_calls"] + row["custom_calls"]
    assert row["complex_nodes"] == 0 and len(row["aot_graphs"]) == 2
    assert (row["graph_count"], row["graph_breaks"]) == (1, 0)


@pytest.mark.slow
def test_inductor_compiled_step_counts_bst_on_the_accelerator_path():
    """The graph a GPU compiles (the accelerator code path, lowered by the CPU's inductor, ~3 minutes): one graph,
    no break, no complex node, no eager fallback, and the row says which path it counted."""
    row = train_ops.count_inductor("bst", 64, accelerator=True)
    assert row["path"] == "accelerator" and row["graphs_called"] == 2 and row["fallback_calls"] == 0
    assert row["complex_nodes"] == 0 and (row["graph_count"], row["graph_breaks"]) == (1, 0)


def test_learned_bias_attention_counts_as_cudas_fused_kernel():
    """On the accelerator path an SDPA call whose mask needs a gradient counts as CUDA's one kernel per direction;
    its numbers (output and every gradient) are SDPA's own."""
    import torch

    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, mask))
    counter = train_ops.OpCounter()
    with train_ops.fused_attention_as_on_cuda(), counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, mask))
    assert torch.nn.functional.scaled_dot_product_attention is train_ops._SDPA  # restored
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert counter.counts["_scaled_dot_product_efficient_attention"] == 1
    assert counter.counts["_efficient_attention_backward"] == 1
    assert not any(name in counter.counts for name in ("bmm", "_softmax", "_safe_softmax"))
