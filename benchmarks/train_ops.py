"""Ops per training step and per decode step: BST:SH:S4, Slide and HF Llama counted in one process (issue #44).

On a GPU a small eager model is launch-bound: each op costs ~20 us of host time (Python, dispatcher, autograd,
launch) whatever its size, so the step time ranks the op counts, not the architectures (the launch-bound study
of 2026-11-27: ~20 us per eager op predicted the H200's eager step times of all three within 5%). This benchmark counts those ops on the CPU, exactly:

1. **eager training step**: every aten op the dispatcher runs in the forward and in the backward (a
   ``TorchDispatchMode``; views and ``_unsafe_view`` left out: an op is a view when one of its schema's returns
   aliases an input without writing it), bf16 autocast, batch 1, L = 4096; ``_to_copy`` (casts),
   ``_local_scalar_dense`` (host reads: device syncs on a GPU) and ``equal`` (host comparisons) also on their own.
   On two code paths: the CPU path as it is, and the accelerator path (``modeling_bst.utils_bst.accelerator_code_path``:
   CPU tensors take the code a GPU takes);
2. **one decode step** after a 1k-token prefill (eager, fp32, batch 1): BST and Slide with their own cache against
   HF Llama with a ``StaticCache``;
3. **the inductor-compiled training step** (``--inductor``; minutes: one cold compile per model) of tiny 2-layer models
   (BST: one SH:S4 layer and one block layer): the kernel calls the compiled forward and backward launch, the eager
   fallbacks among them, complex-dtype nodes in the graphs inductor receives, and dynamo's graph breaks; on both
   code paths too (``--paths``; Llama, which has one, is compiled once).

The models are ``benchmarks/train_throughput.build``'s 60m layer structure (8 layers, BST layers {0, 5, 6},
W = 512) at a narrow width (hidden 64, 8 heads of 8, MLP 128, vocabulary 512: the ``60m-narrow`` preset): the width
changes no op of the sequence, only the sizes, so the counts are the 60m model's.

    python -m benchmarks.train_ops [--quick] [--seq-len 4096] [--inductor] [--no-decode]

Prints the tables; writes docs/benchmarks/train_ops.{json,png} and the ``train_ops`` section of docs/benchmarks.md
(``--quick``: L = 1024, W = 128, no inductor part, ``train_ops_quick.json`` and no docs).
"""

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import modeling_bst  # noqa: F401
from benchmarks import train_throughput as tt
from benchmarks.bench_common import RowLog, positive_int
from benchmarks.docs_section import write_section
from modeling_bst.utils_bst import accelerator_code_path
from reporting import cpu_name


ROOT = Path(__file__).resolve().parents[1]
KINDS = ["bst", "slide", "llama"]
NAMES = {"bst": "BST:SH:S4", "slide": "Slide", "llama": "HF Llama (sdpa)"}
DECODE_NAMES = {"bst": "BST:SH:S4 (BSTCache)", "slide": "Slide (BSTCache)", "llama": "HF Llama (StaticCache)"}
NARROW = "60m-narrow"
# Reported on their own besides the totals (they are counted in them).
SPECIAL = ("_to_copy", "_local_scalar_dense", "equal")
TOP = 12


# -- the counter --------------------------------------------------------------------------------------------------------
def is_view(func) -> bool:
    """An op that returns an alias of an input without writing it (``view``, ``transpose``, ``expand``, ...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def op_name(func) -> str:
    """``aten.mm.default`` -> ``mm``; other namespaces keep theirs (``bst::fft_conv``)."""
    packet = func.overloadpacket
    namespace = func.namespace
    return packet.__name__ if namespace == "aten" else f"{namespace}::{packet.__name__}"


def _complex(out) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_complex() for t in torch.utils._pytree.tree_leaves(out))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher's Python key while active: ``counts`` the compute ops by name
    (views and ``_unsafe_view`` left out), ``views`` those left out, ``complex_outputs`` the compute ops with a
    complex result. Autocast's casts come before this key, so they are counted (as ``_to_copy``)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.views = collections.Counter()
        self.complex_outputs = 0

    paused = 0  # > 0 inside an emulated fused kernel ([`FusedAttention`]): its pieces are not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = op_name(func)
        if name == "_unsafe_view" or is_view(func):
            self.views[name] += 1
        else:
            self.counts[name] += 1
            self.complex_outputs += _complex(out)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        return dict(
            ops=self.total,
            views=sum(self.views.values()),
            unsafe_view=self.views["_unsafe_view"],
            complex_outputs=self.complex_outputs,
            **{name: self.counts[name] for name in SPECIAL},
            by_op=dict(self.counts.most_common()),
        )


# -- the accelerator's fused attention, on the CPU --------------------------------------------------------------------
# SDPA with an additive mask that needs a gradient (BST's learned T5 bias in training) is one kernel on CUDA, forward
# (`_scaled_dot_product_efficient_attention`) and backward (`_efficient_attention_backward`): the memory-efficient
# kernel returns the mask's gradient. On the CPU, SDPA decomposes it into its math form (~15 ops forward, more
# backward). Counting the accelerator path on the CPU, [`fused_attention_as_on_cuda`] counts such a call as the one
# kernel of each direction that CUDA runs (its math still runs, uncounted, for the numbers).
_SDPA = torch.nn.functional.scaled_dot_product_attention


def _counter():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, OpCounter) else None


class FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, kwargs):
        counter = _counter()
        if counter is not None:
            counter.paused += 1
        try:
            out = _SDPA(q, k, v, attn_mask=mask, **kwargs)
        finally:
            if counter is not None:
                counter.paused -= 1
                counter.counts["_scaled_dot_product_efficient_attention"] += 1
        ctx.save_for_backward(q, k, v, mask)
        ctx.kwargs = kwargs
        return out

    @staticmethod
    def backward(ctx, grad):
        counter = _counter()
        if counter is not None:
            counter.paused += 1
        try:
            inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            with torch.enable_grad():
                out = _SDPA(*inputs[:3], attn_mask=inputs[3], **ctx.kwargs)
            grads = torch.autograd.grad(out, inputs, grad)
        finally:
            if counter is not None:
                counter.paused -= 1
                counter.counts["_efficient_attention_backward"] += 1
        return (*grads, None)


def _sdpa_as_on_cuda(query, key, value, attn_mask=None, **kwargs):
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        return FusedAttention.apply(query, key, value, attn_mask, kwargs)
    return _SDPA(query, key, value, attn_mask=attn_mask, **kwargs)


class fused_attention_as_on_cuda:
    """Context manager: ``F.scaled_dot_product_attention`` with a mask that needs a gradient counts as CUDA's one
    fused kernel per direction (see above); every other call is unchanged."""

    def __enter__(self):
        torch.nn.functional.scaled_dot_product_attention = _sdpa_as_on_cuda
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = _SDPA


# -- eager training step ----------------------------------------------------------------------------------------------
def count_training(kind: str, seq_len: int, accelerator: bool, size: str = NARROW, batch: int = 1, **shape) -> dict:
    """Ops of one training step (forward with the LM loss, then backward) of ``kind``, bf16 autocast, on the CPU code
    path or (``accelerator``) the GPU one. One uncounted step first (lazy buffers, caches of the first call)."""
    torch.manual_seed(0)
    model = tt.build(kind, seq_len, size, **shape).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    result = {}
    with accelerator_code_path(accelerator), fused_attention_as_on_cuda() if accelerator else _nothing():
        for counted in (False, True):
            fwd, bwd = OpCounter(), OpCounter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with fwd if counted else _nothing():
                    loss = model(input_ids=ids, labels=ids).loss
            with bwd if counted else _nothing():
                loss.backward()
            model.zero_grad(set_to_none=True)
            if counted:
                result = dict(forward=fwd.summary(), backward=bwd.summary())
    f, b = result["forward"], result["backward"]
    top = collections.Counter(f["by_op"]) + collections.Counter(b["by_op"])
    return dict(
        part="train",
        kind=kind,
        model=NAMES[kind],
        path="accelerator" if accelerator else "cpu",
        seq_len=seq_len,
        batch=batch,
        forward=f["ops"],
        backward=b["ops"],
        total=f["ops"] + b["ops"],
        views=f["views"] + b["views"],
        unsafe_view_forward=f["unsafe_view"],
        unsafe_view_backward=b["unsafe_view"],
        complex_outputs=f["complex_outputs"] + b["complex_outputs"],
        **{f"{name}_forward": f[name] for name in SPECIAL},
        **{f"{name}_backward": b[name] for name in SPECIAL},
        top=top.most_common(TOP),
        forward_by_op=f["by_op"],
        backward_by_op=b["by_op"],
    )


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- one decode step ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def count_decode(kind: str, context: int, accelerator: bool, size: str = NARROW, warmup: int = 2, **shape) -> dict:
    """Ops of one decode step (one token, batch 1, fp32, eager) after a prefill of ``context`` tokens and ``warmup``
    uncounted steps: BST/Slide with their own cache (as ``generate`` runs them), Llama with a ``StaticCache``."""
    torch.manual_seed(0)
    model = tt.build(kind, context + warmup + 8, size, **shape).eval()
    vocab = model.config.vocab_size
    ids, token = torch.randint(0, vocab, (1, context)), torch.randint(0, vocab, (1, 1))
    cache = None
    if kind == "llama":
        cache = transformers.StaticCache(config=model.config, max_cache_len=context + warmup + 8)
    counter = OpCounter()
    with accelerator_code_path(accelerator):
        out = model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
        cache = out.past_key_values
        for i in range(warmup + 1):
            extra = {"position_ids": torch.tensor([[context + i]])} if kind == "llama" else {}
            with counter if i == warmup else _nothing():
                out = model(token, use_cache=True, **extra, past_key_values=cache)
            cache = out.past_key_values
    s = counter.summary()
    return dict(
        part="decode",
        kind=kind,
        model=DECODE_NAMES[kind],
        path="accelerator" if accelerator else "cpu",
        context=context,
        ops=s["ops"],
        views=s["views"],
        complex_outputs=s["complex_outputs"],
        **{name: s[name] for name in SPECIAL},
        top=collections.Counter(s["by_op"]).most_common(TOP),
        by_op=s["by_op"],
    )


# -- the inductor-compiled training step ------------------------------------------------------------------------------
# Library calls inductor makes for matmuls and attention ("extern kernels"): chosen lowerings, not fallbacks.
LIBRARY = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "_addmm_activation",
    "convolution",
    "_scaled_dot_product",
    "_flash_attention",
)
GRAPH_EVENT = "## Call CompiledFxGraph"


def classify_compiled_call(name: str) -> str:
    """A direct child of a compiled graph's profiler event: ``kernel`` (inductor-generated: ``cpp_fused_*`` /
    ``triton_*``), ``library`` (matmul / attention extern kernels), ``view``, ``fallback`` (any other aten op: run
    eagerly, no lowering), ``custom`` (an op of another namespace, run as an opaque call)."""
    if "::" not in name:
        return "kernel"
    namespace, _, op = name.partition("::")
    if namespace != "aten":
        return "custom"
    if op.startswith(LIBRARY):
        return "library"
    packet = getattr(torch.ops.aten, op, None)
    if op == "_unsafe_view" or (packet is not None and any(is_view(getattr(packet, o)) for o in packet.overloads())):
        return "view"
    return "fallback"


def graph_calls(prof) -> dict:
    """What the compiled graphs of a profiled step called: the direct children of every ``## Call CompiledFxGraph``
    event (inductor's Python wrapper calls each kernel, extern kernel and fallback op once per launch; with
    ``cpp.enable_kernel_profile`` every generated C++ kernel records an event of its own name)."""
    calls = {k: collections.Counter() for k in ("kernel", "library", "fallback", "custom", "view")}
    graphs = 0
    for e in prof.events():
        if e.name.startswith(GRAPH_EVENT):
            graphs += 1
        parent = e.cpu_parent
        if parent is not None and parent.name.startswith(GRAPH_EVENT):
            calls[classify_compiled_call(e.name)][e.name] += 1
    return dict(graphs_called=graphs, **{k: dict(v.most_common()) for k, v in calls.items()})


def graph_dtypes(gm) -> dict:
    """Nodes of an FX graph (after AOTAutograd: what inductor receives) and those with a complex-dtype value."""
    nodes = complex_nodes = 0
    ops = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        nodes += 1
        val = node.meta.get("val")
        if _complex(val):
            complex_nodes += 1
            ops[str(node.target)] += 1
    return dict(nodes=nodes, complex_nodes=complex_nodes, complex_ops=dict(ops.most_common(TOP)))


def count_inductor(kind: str, seq_len: int = 128, accelerator: bool = False, size: str = "tiny") -> dict:
    """Cold inductor compile (CPU) of ``torch.compile(model)`` for a training step (bf16 autocast, batch 1), then one
    profiled step: kernel calls by class (``graph_calls``), the AOT graphs' complex-dtype nodes, dynamo's graph breaks
    (``torch._dynamo.explain`` of the forward). ``accelerator``: the graph a GPU compiles (the accelerator code path:
    one attention call per layer, the learned-bias attention through SDPA), still lowered by the CPU's inductor."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tt.build(kind, seq_len, size).train()
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    graphs = []

    def inner(gm, example_inputs, **kwargs):  # each AOT graph (forward, then backward) on its way to inductor
        graphs.append(graph_dtypes(gm))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    compiled = torch.compile(model, backend=backend)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    with (
        accelerator_code_path(accelerator),
        inductor_config.patch({"cpp.enable_kernel_profile": True, "force_disable_caches": True}),
    ):
        start = time.perf_counter()
        step()  # the compile
        compile_s = time.perf_counter() - start
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    calls = graph_calls(prof)
    torch._dynamo.reset()
    with accelerator_code_path(accelerator), torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    counts = {k: sum(calls[k].values()) for k in ("kernel", "library", "fallback", "custom", "view")}
    return dict(
        part="inductor",
        kind=kind,
        model=NAMES[kind],
        path="accelerator" if accelerator else "cpu",
        size=size,
        seq_len=seq_len,
        layers=model.config.num_hidden_layers,
        compile_s=compile_s,
        launches=counts["kernel"] + counts["library"] + counts["fallback"] + counts["custom"],
        **{f"{k}_calls": v for k, v in counts.items()},
        graphs_called=calls["graphs_called"],
        fallback_ops=calls["fallback"],
        custom_ops=calls["custom"],
        aot_graphs=graphs,
        complex_nodes=sum(g["complex_nodes"] for g in graphs),
        graph_count=explained.graph_count,
        graph_breaks=explained.graph_break_count,
        break_reasons=[str(r.reason)[:200] for r in explained.break_reasons],
    )


# -- output -------------------------------------------------------------------------------------------------------------
def ratios(rows: list, key: str, reference: str = "llama"):
    """``vs_llama`` on every row: its ``key`` over the Llama row's of the same part and path."""
    for r in rows:
        ref = next(
            (x for x in rows if x["kind"] == reference and x["part"] == r["part"] and x["path"] == r["path"]), None
        )
        r["vs_llama"] = r[key] / ref[key] if ref and ref[key] else None


def _x(ratio) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def train_table(rows) -> list[str]:
    lines = [
        "| model | code path | forward ops | backward ops | total | vs Llama | `_to_copy` fwd + bwd | "
        "`_local_scalar_dense` fwd + bwd | `equal` | `_unsafe_view` fwd + bwd (not counted) | other views (not "
        "counted) | complex outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        unsafe = r["unsafe_view_forward"] + r["unsafe_view_backward"]
        lines.append(
            f"| {r['model']} | {r['path']} | {r['forward']:,} | {r['backward']:,} | {r['total']:,} | "
            f"{_x(r['vs_llama'])} | {r['_to_copy_forward']} + {r['_to_copy_backward']} | "
            f"{r['_local_scalar_dense_forward']} + {r['_local_scalar_dense_backward']} | "
            f"{r['equal_forward'] + r['equal_backward']} | {r['unsafe_view_forward']} + {r['unsafe_view_backward']} | "
            f"{r['views'] - unsafe:,} | {r['complex_outputs']} |"
        )
    return lines


def decode_table(rows) -> list[str]:
    lines = [
        "| model | code path | ops per decode step | vs Llama (StaticCache) | `equal` | `_local_scalar_dense` | "
        "`_to_copy` | views (not counted) | complex outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['path']} | {r['ops']:,} | {_x(r['vs_llama'])} | {r['equal']} | "
            f"{r['_local_scalar_dense']} | {r['_to_copy']} | {r['views']:,} | {r['complex_outputs']} |"
        )
    return lines


def inductor_table(rows) -> list[str]:
    lines = [
        "| model | code path | launches per step | vs Llama | generated kernels | matmul/attention library calls | eager "
        "fallbacks | custom-op calls | views | complex nodes in the AOT graphs | graphs / breaks | cold compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['path']} | {r['launches']} | {_x(r['vs_llama'])} | {r['kernel_calls']} | {r['library_calls']} | "
            f"{r['fallback_calls']} | {r['custom_calls']} | {r['view_calls']} | {r['complex_nodes']} | "
            f"{r['graph_count']} / {r['graph_breaks']} | {r['compile_s']:.0f} |"
        )
    return lines


def top_table(rows) -> list[str]:
    lines = ["| model | code path | top ops (forward + backward) |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['path']} | " + ", ".join(f"`{n}` {c}" for n, c in r["top"]) + " |")
    return lines


def print_tables(result: dict):
    for title, key, table in (
        ("training step (eager, bf16 autocast)", "train", train_table),
        ("one decode step (eager, fp32)", "decode", decode_table),
        ("inductor-compiled training step", "inductor", inductor_table),
    ):
        if result.get(key):
            print(f"\n{title}:")
            print("\n".join(table(result[key])))
    if result.get("train"):
        print("\n" + "\n".join(top_table(result["train"])))


def plot(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("training step: forward + backward ops", result.get("train") or [], lambda r: r["total"]),
        ("one decode step: ops", result.get("decode") or [], lambda r: r["ops"]),
        ("compiled training step: launches", result.get("inductor") or [], lambda r: r["launches"]),
    ]  # fmt: skip
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (title, rows, value) in zip(axes[0], panels):
        paths = list(dict.fromkeys(r["path"] for r in rows))
        width = 0.8 / len(paths)
        for i, p in enumerate(paths):
            vals = [next((value(r) for r in rows if r["kind"] == k and r["path"] == p), 0) for k in KINDS]
            ax.bar([j + i * width for j in range(len(KINDS))], vals, width, label=f"{p} path")
        ax.set_xticks([j + width * (len(paths) - 1) / 2 for j in range(len(KINDS))], [NAMES[k][:9] for k in KINDS])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(result: dict):
    meta = result["meta"]
    lines = [
        "## Ops per training and decode step (issue #44)",
        "",
        f"Counted on {meta['cpu']}; torch {meta['torch']}, transformers {meta['transformers']}. Command: "
        f"`{meta['command']}`. Models: `train_throughput.build`'s 60m layer structure (8 layers; BST:SH:S4 layers "
        f"{{0, 5, 6}}, W = {meta['block_len']}) at a narrow width (hidden 64, 8 heads of 8, MLP 128, vocabulary 512): "
        "the width changes no op of the sequence. An op = one aten op through the dispatcher (a `TorchDispatchMode`), "
        "views and `_unsafe_view` not counted. On a GPU each eager op costs ~20 us of host time, so a small eager "
        "model's step time follows these counts (on the H200, ~20 us per op predicted all three step times within "
        "5%). Code path "
        "`accelerator`: CPU tensors take the code a GPU takes (`accelerator_code_path()`).",
        "",
    ]
    if result.get("train"):
        lines += [
            f"Training step (forward with the LM loss, backward; no optimiser), bf16 autocast, batch 1, L = "
            f"{meta['seq_len']}:",
            "",
            *train_table(result["train"]),
            "",
            *top_table(result["train"]),
            "",
        ]
    if result.get("decode"):
        lines += [
            f"One decode step after a prefill of {meta['context']} tokens, batch 1, fp32, eager (BST and Slide with "
            "their own cache, as `generate` runs them; Llama with a `StaticCache`); `equal` = host comparisons, "
            "`_local_scalar_dense` = host reads (device syncs on a GPU):",
            "",
            *decode_table(result["decode"]),
            "",
        ]
    if result.get("inductor"):
        r0 = result["inductor"][0]
        lines += [
            f"Inductor-compiled training step on the CPU (`torch.compile(model)`, forward + backward, bf16 autocast), "
            f"tiny {r0['layers']}-layer models (hidden 128, W = 64, L = {r0['seq_len']}; BST: one SH:S4 layer, one "
            "block layer). Launches = the calls inductor's wrapper makes per step (the direct children of the "
            "`## Call CompiledFxGraph` profiler events, with `cpp.enable_kernel_profile`): generated kernels, "
            "matmul/attention library calls, eager fallbacks (aten ops with no lowering) and custom ops; complex nodes "
            "= nodes with a complex-dtype value in the forward and backward graphs AOTAutograd hands inductor "
            "(inductor has no complex codegen: each becomes a fallback); graphs / breaks from `torch._dynamo.explain`. "
            "Two code paths: the CPU's (what a compiled CPU step runs: query chunks, the learned-bias attention written "
            "out) and the accelerator's (the graph a GPU compiles, lowered here by the CPU's inductor: its learned-bias "
            "SDPA becomes the math decomposition, where CUDA runs one fused kernel each way, so its count is an upper "
            "bound for a GPU).",
            "",
            *inductor_table(result["inductor"]),
            "",
        ]
        for r in result["inductor"]:
            if r["fallback_ops"] or r["custom_ops"]:
                ops = collections.Counter(r["fallback_ops"]) + collections.Counter(r["custom_ops"])
                lines.append(
                    f"- {r['model']} ({r['path']} path) fallbacks: "
                    + ", ".join(f"`{n}` {c}" for n, c in ops.most_common(TOP))
                )
        lines.append("")
    lines.append("![ops per step](benchmarks/train_ops.png)")
    write_section("train_ops", lines)


# -- command line -------------------------------------------------------------------------------------------------------
PARTS = ["train", "decode", "inductor"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seq-len", type=positive_int, default=4096, help="training sequence length")
    parser.add_argument("--block-len", type=positive_int, default=512, help="W of BST and Slide")
    parser.add_argument("--context", type=positive_int, default=1024, help="prefill before the counted decode step")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="contenders (llama included)")
    parser.add_argument("--paths", nargs="+", choices=["cpu", "accelerator"], default=["cpu", "accelerator"])
    parser.add_argument(
        "--inductor", action="store_true", help="also the inductor-compiled step (a cold compile per model)"
    )
    parser.add_argument("--inductor-seq-len", type=positive_int, default=256, help="L of the compiled tiny models")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode step")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--quick", action="store_true", help="L = 1024, W = 128, context 256; no docs")
    parser.add_argument("--output", type=Path, help="JSON path (default docs/benchmarks/train_ops[_quick].json)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "llama" not in args.kinds:
        parser.error("--kinds must include llama (the reference every ratio is taken against)")
    args.kinds = [k for k in KINDS if k in args.kinds]
    args.paths = list(dict.fromkeys(args.paths))
    return args


def run(args) -> dict:
    meta = dict(
        cpu=cpu_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        seq_len=args.seq_len,
        block_len=args.block_len,
        context=args.context,
        size=NARROW,
        command="python -m benchmarks.train_ops " + " ".join(sys.argv[1:]),
    )
    result = {"meta": meta, "train": [], "decode": [], "inductor": []}
    out = args.output or ROOT / "docs" / "benchmarks" / ("train_ops_quick.json" if args.quick else "train_ops.json")
    with RowLog(out, meta) as log:
        for path in args.paths:
            for kind in args.kinds:
                start = time.perf_counter()
                row = count_training(kind, args.seq_len, path == "accelerator", block_len=args.block_len)
                result["train"].append(log.add(row))
                print(f"train {kind} {path}: {row['forward']} + {row['backward']} ops "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
        if not args.no_decode:
            for path in args.paths:
                for kind in args.kinds:
                    row = count_decode(kind, args.context, path == "accelerator", block_len=args.block_len)
                    result["decode"].append(log.add(row))
                    print(f"decode {kind} {path}: {row['ops']} ops", flush=True)
        if args.inductor:
            for path in args.paths:
                for kind in args.kinds:
                    if kind == "llama" and path != args.paths[0]:  # Llama has one code path: compiled once
                        row = dict(next(r for r in result["inductor"] if r["kind"] == "llama"), path=path)
                    else:
                        row = count_inductor(kind, args.inductor_seq_len, path == "accelerator")
                    result["inductor"].append(log.add(row))
                    print(f"inductor {kind} {path}: {row['launches']} launches ({row['compile_s']:.0f} s compile)",
                          flush=True)  # fmt: skip
        ratios(result["train"], "total")
        ratios(result["decode"], "ops")
        ratios(result["inductor"], "launches")
        print_tables(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        if not args.quick:
            plot(result, out.with_suffix(".png"))
            write_docs(result)
        log.done()
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.seq_len, args.block_len, args.context = 1024, 128, 256
    torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
