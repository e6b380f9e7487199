"""Forward speed of ONE layer vs sequence length: the CPU counterpart of the paper's Fig. 3 (left).

Setup (paper Sec. 4.3 / Fig. 3): one layer, forward only (eval, ``torch.no_grad``), D = 512, W = 128, SSM state
size N = 16, 16 heads of 32, MLP 2048, batch 1, L = 1k ... 16k (``--long``: up to 64k). The SSM input is D = 512
as in the paper's speed setup (no down-projection: ``ssm_hidden_size=512``). Contenders:

* ``Slide``            a plain Block-Transformer layer (``config.layer_kind == "block"``);
* ``BST:SH:S4``        BST layer, single-head context states, S4D kernel;
* ``BST:MH:S4``        multi-head context states (16 SSM read-outs);
* ``BST:MF:S4``        multi-filter context states (S = 32 filters, states at block ends);
* ``BST:SH:unstruct``  Hyena-style filter (``max_position_embeddings = L``);
* ``BRecT``            BRecT:fixed:skip recurrent layer (``num_recurrent_states``, default 512 as in meliad's
                       ``bias_skip.gin``): the only contender that loops over blocks;
* ``lucidrains``       external peer: ``block-recurrent-transformer-pytorch`` (one recurrent layer, dim 512, 16 heads
                       of 32, block 128, same number of state vectors, GEGLU FFN mult 4 ~ the same FLOPs as our MLP).
                       It is a whole model of depth 1; its vocabulary is 16 tokens so embedding and logits are
                       negligible. Install it without letting pip touch torch::

                           pip install --no-deps block-recurrent-transformer-pytorch einops beartype

                       (its ``memorizing-transformers-pytorch`` requirement is never imported). If it is missing the
                       contender is skipped.

Timing method (docs/shared notes on these noisy 2-core VMs): ``torch.set_num_threads(1)`` by default, a few seconds
of matmul warm-up, an fp32 1024^3 matmul "canary" before and after, contenders alternated round by round (A B C ...
A B C ...) and each contender's minimum kept (the median is stored too). The script calls glibc ``mallopt`` itself
(= ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000``) to avoid page faults on large temporaries, which
otherwise make BST:MH 2-3x slower.

    python -m benchmarks.layer_speed [--quick] [--long] [--dtype fp32|bf16|both] [--threads 1] [--rounds 5]
                                     [--device cpu|cuda]

``--device cuda`` runs the same contenders on the GPU (timed with ``torch.cuda.synchronize`` around each forward;
the FFT-buffer memory check uses the device's free memory); ``benchmarks/gpu_suite.py`` calls ``time_length`` so.

Prints a table and writes docs/benchmarks/layer_speed.json, docs/benchmarks/layer_speed.png and the
``layer_speed`` section of docs/benchmarks.md.
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from benchmarks.bench_common import (
    DTYPE_ALIASES,
    RowLog,
    alias_choice,
    device_arg,
    existing_file,
    positive_float,
    positive_int,
)
from benchmarks.docs_section import clock, tune_malloc
from modeling_bst import BSTConfig, BSTModel
from reporting import device_name


ROOT = Path(__file__).resolve().parents[1]
MARK_START, MARK_END = "<!-- layer_speed:start -->", "<!-- layer_speed:end -->"
D, W, N, HEADS, HEAD_DIM, MLP = 512, 128, 16, 16, 32, 2048
CONTENDERS = ["Slide", "BST:SH:S4", "BST:MH:S4", "BST:MF:S4", "BST:SH:unstruct", "BRecT", "lucidrains"]


# -- machine ---------------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def model_code_version() -> str:
    """Short commit of the checkout, with ``+dirty`` when modeling_bst/ has uncommitted edits."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "modeling_bst"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def canary_gflops(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 square-matmul GFLOP/s: tells whether the VM was in its normal state."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def warm_up(seconds: float):
    end = time.perf_counter() + seconds
    a = torch.randn(512, 512)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


# -- contenders ------------------------------------------------------------------------------------------------------


def bst_layer(
    name: str, seq_len: int, recurrent_states: int, device: str = "cpu", ssm_hidden: int | None = None, hidden: int = D
):
    """One layer of contender ``name`` at width ``hidden`` (heads of HEAD_DIM, MLP 4x; the paper's setup at D) and
    SSM input ``ssm_hidden`` (default ``hidden``); returns ``(layer, forward)``."""
    common = dict(
        vocab_size=16,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=hidden // HEAD_DIM,
        head_dim=HEAD_DIM,
        intermediate_size=MLP * hidden // D,
        block_len=W,
        ssm_state_size=N,
        max_position_embeddings=seq_len,
        dropout=0.0,
        attention_dropout=0.0,
        bst_layer_indices=[],
    )
    if name == "BRecT":
        common.update(recurrent_layer_indices=[0], num_recurrent_states=recurrent_states)
    elif name.startswith("BST:"):
        _, mode, kind = name.split(":")
        common.update(
            bst_layer_indices=[0],
            context_mode=mode.lower(),
            ssm_kind=kind.lower(),
            # The paper's speed setup: SSM input D = 512, no down-projection.
            ssm_hidden_size=hidden if ssm_hidden is None else ssm_hidden,
            num_context_states=32,
        )
    config = BSTConfig(**common)
    model = BSTModel(config).eval().to(device)
    layer = model.layers[0]
    expected = {"Slide": "block", "BRecT": "recurrent"}.get(name, "bst")
    assert layer.layer_type == expected, (name, layer.layer_type)
    return layer, lambda x: layer(x)


def lucidrains_layer(seq_len: int, recurrent_states: int, device: str = "cpu", hidden: int = D):
    from block_recurrent_transformer_pytorch import BlockRecurrentTransformer

    model = BlockRecurrentTransformer(
        num_tokens=16,
        dim=hidden,
        depth=1,
        dim_head=HEAD_DIM,
        heads=hidden // HEAD_DIM,
        ff_mult=4,
        max_seq_len=seq_len,
        block_width=W,
        recurrent_layers=(1,),
        num_state_vectors=recurrent_states,
        use_flash_attn=True,  # SDPA on CPU (its einsum path measured slower)
    ).eval()
    model.to(device)
    tokens = torch.randint(0, 16, (1, seq_len), device=device)
    return model, lambda x: model(tokens)


def build(name: str, seq_len: int, recurrent_states: int, device: str = "cpu", hidden: int = D):
    if name == "lucidrains":
        return lucidrains_layer(seq_len, recurrent_states, device, hidden)
    return bst_layer(name, seq_len, recurrent_states, device, hidden=hidden)


def has_lucidrains() -> bool:
    try:
        import block_recurrent_transformer_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


# -- timing ----------------------------------------------------------------------------------------------------------
def available_memory(device: str = "cpu") -> float:
    if torch.device(device).type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024 * float(line.split()[1])
    except OSError:
        pass
    return float("inf")


def autocast_ctx(dtype: str, device: str = "cpu"):
    if dtype == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


_SDPA_FORMULA_REGISTERED = False


def executed_gflop(fn, x) -> float:
    """Matmul + attention GFLOP one forward executes (``torch.utils.flop_counter``; masked attention work a kernel
    still computes is included, FFTs and elementwise ops are not). Counted with autograd on, as FlopCounterMode
    requires; the CPU fused attention op gets the standard 4 * B * H * Lq * Lk * d formula."""
    global _SDPA_FORMULA_REGISTERED
    from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

    if not _SDPA_FORMULA_REGISTERED:

        @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
        def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
            b, h, lq, d = query_shape
            return 2 * b * h * lq * key_shape[-2] * (d + value_shape[-1])

        _SDPA_FORMULA_REGISTERED = True
    with FlopCounterMode(display=False) as counter:
        fn(x)
    return counter.get_total_flops() / 1e9


def time_length(
    names, seq_len, dtype, rounds, budget_s, recurrent_states, count_flops=False, device="cpu", hidden: int = D
):
    """Min / median ms per forward for each contender at one length, contenders alternated round by round (layers of
    width ``hidden``: the paper's D unless a dry run asks for less)."""
    x = torch.randn(1, seq_len, hidden, device=device)
    fns, times, errors, flops, flop_errors = {}, {n: [] for n in names}, {}, {}, {}
    for name in names:
        # ~6 live (heads, hidden, 2L) fp32 buffers: (16, 512, 2L) at the paper's D
        need = 6 * (hidden // HEAD_DIM) * hidden * 2 * seq_len * 4 if name == "BST:MH:S4" else 0
        if need > 0.8 * available_memory(device):
            errors[name] = f"skipped: needs ~{need / 2**30:.0f} GiB of FFT buffers"
            continue
        try:
            _, fn = build(name, seq_len, recurrent_states, device, hidden)
            with torch.no_grad(), autocast_ctx(dtype, device):
                fn(x)  # warm-up (allocations, kernel selection)
            fns[name] = fn
        except (RuntimeError, MemoryError, ValueError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            fns.pop(name, None)
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            continue
        if count_flops:
            # A contender whose ops the counter cannot trace keeps its timing, without a FLOP count: on an H200 with
            # torch 2.11, eager flex_attention's higher-order op raised a TypeError under FlopCounterMode (2026-11-26).
            try:
                flops[name] = executed_gflop(fn, x)
            except (RuntimeError, TypeError) as exc:
                flop_errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    start = time.perf_counter()
    for r in range(rounds):
        for name, fn in fns.items():
            with torch.no_grad(), autocast_ctx(dtype, device):
                t0 = clock(device)
                fn(x)
                times[name].append(clock(device) - t0)
        if r >= 1 and time.perf_counter() - start > budget_s:
            break
    del fns
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    out = {}
    for name in names:
        if times[name]:
            ts = sorted(times[name])
            out[name] = {"min_ms": 1e3 * ts[0], "median_ms": 1e3 * ts[len(ts) // 2], "runs": len(ts)}
            if name in flops:
                out[name]["gflop"] = flops[name]
            elif name in flop_errors:
                out[name]["gflop_error"] = flop_errors[name]
        else:
            out[name] = {"error": errors.get(name, "not run")}
    return out


# -- reporting -------------------------------------------------------------------------------------------------------
def ms(entry):
    return entry.get("min_ms") if entry else None


def ratio(a, b):
    return a / b if a is not None and b is not None else None


def fmt(v, spec="{:.1f}"):
    return spec.format(v) if v is not None else "n/a"


def table_rows(results, names):
    """Markdown rows: per dtype and length, ms per contender then the ratios."""
    header = (
        "| dtype | L | "
        + " | ".join(names)
        + " | SH/Slide | MF/Slide | BRecT/Slide | BRecT/SH | lucidrains/SH | lucidrains/Slide |"
    )
    sep = "|" + "---|" * (2 + len(names) + 6)
    rows = [header, sep]
    for dtype, per_len in results.items():
        for seq_len, entries in per_len.items():
            t = {n: ms(entries.get(n)) for n in names}
            sh, slide = t.get("BST:SH:S4"), t.get("Slide")
            cells = [fmt(t[n]) for n in names]
            ratios = [
                ratio(sh, slide),
                ratio(t.get("BST:MF:S4"), slide),
                ratio(t.get("BRecT"), slide),
                ratio(t.get("BRecT"), sh),
                ratio(t.get("lucidrains"), sh),
                ratio(t.get("lucidrains"), slide),
            ]
            rows.append(
                f"| {dtype} | {seq_len} | "
                + " | ".join(cells)
                + " | "
                + " | ".join(fmt(r, "{:.2f}x") for r in ratios)
                + " |"
            )
    return rows


def flop_rows(results, names):
    """Executed GFLOP per forward (same for every dtype) and the ratios that bound the time ratios."""
    per_len = next((r for r in results.values() if any("gflop" in e for e in next(iter(r.values())).values())), None)
    if per_len is None:
        return []
    rows = [
        "| L | " + " | ".join(names) + " | SH/Slide | MF/Slide | BRecT/SH | lucidrains/SH |",
        "|" + "---|" * (1 + len(names) + 4),
    ]
    for seq_len, entries in per_len.items():
        g = {n: entries.get(n, {}).get("gflop") for n in names}
        cells = [fmt(g[n]) for n in names]
        ratios = [
            ratio(g.get("BST:SH:S4"), g.get("Slide")),
            ratio(g.get("BST:MF:S4"), g.get("Slide")),
            ratio(g.get("BRecT"), g.get("BST:SH:S4")),
            ratio(g.get("lucidrains"), g.get("BST:SH:S4")),
        ]
        rows.append(
            f"| {seq_len} | " + " | ".join(cells) + " | " + " | ".join(fmt(r, "{:.2f}x") for r in ratios) + " |"
        )
    return rows


def plot(results, names, path: Path, title: str = "CPU 1 thread"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(results)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        per_len = results[dtype]
        for name in names:
            pts = [(int(seq_len), ms(e.get(name))) for seq_len, e in per_len.items() if ms(e.get(name)) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L (tokens)")
        ax.set_ylabel("ms per forward (one layer, batch 1)")
        ax.set_title(f"One-layer forward, {title}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(results):
    lines = []
    for dtype, per_len in results.items():
        e = per_len.get("4096")
        if not e:
            continue
        sh, slide, brect, luc = (ms(e.get(n)) for n in ("BST:SH:S4", "Slide", "BRecT", "lucidrains"))
        r1, r2 = ratio(sh, slide), ratio(luc, sh)
        ok1 = "met" if r1 is not None and r1 <= 1.3 else "NOT met"
        ok2 = "met" if r2 is not None and r2 >= 3.0 else "NOT met"
        flops = {}
        for per in results.values():
            for n, entry in per.get("4096", {}).items():
                if "gflop" in entry:
                    flops[n] = entry["gflop"]
        f1, f2 = (
            ratio(flops.get("BST:SH:S4"), flops.get("Slide")),
            ratio(flops.get("lucidrains"), flops.get("BST:SH:S4")),
        )
        lines.append(
            f"- {dtype}, L = 4096: BST:SH = {fmt(r1, '{:.2f}x')} Slide (target <= 1.3x: {ok1}; executed-FLOP ratio "
            f"{fmt(f1, '{:.2f}x')}); lucidrains = {fmt(r2, '{:.2f}x')} BST:SH (target >= 3x: {ok2}; FLOP ratio "
            f"{fmt(f2, '{:.2f}x')}); BRecT = {fmt(ratio(brect, sh), '{:.2f}x')} BST:SH and "
            f"{fmt(ratio(brect, slide), '{:.2f}x')} Slide."
        )
    return lines


def load_text(meta) -> str:
    if "merged_runs" in meta:
        loads = [f"{r['loadavg_before']:.1f}" for r in meta["merged_runs"] if r.get("loadavg_before") is not None]
        return (
            f"per-cell minimum over {len(meta['merged_runs'])} full runs (other jobs shared the {meta['cores']} cores "
            f"during them: 1-min load averages {', '.join(loads) or 'n/a'} where recorded; contention only adds "
            "time, so minima are the best estimate, but absolute times are still inflated and the ratios are the "
            "meaningful output)."
        )
    if "loadavg_before" not in meta:
        return "load average not recorded (other jobs may have shared the cores)."
    return (
        f"1-min load average before/after {meta['loadavg_before']:.1f} / {meta['loadavg_after']:.1f} (values above "
        f"{meta['threads']} mean other jobs shared the {meta['cores']} cores: absolute times are then inflated and only "
        "same-run ratios of alternated minima are meaningful)."
    )


def write_markdown(meta, results, names, path: Path):
    section = [
        MARK_START,
        "## One-layer forward speed vs sequence length (paper Fig. 3 left, issue #6)",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores, {meta['threads']} thread(s) used; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; model code {meta.get('model_code', 'n/a')}. fp32 matmul canary before/after: {meta['canary_before']:.0f} / "
        f"{meta['canary_after']:.0f} GFLOP/s; {load_text(meta)}",
        "",
        f"Setup: one layer, forward only (eval, no_grad), D = {D}, W = {W}, N = {N}, {HEADS} heads of {HEAD_DIM}, "
        f"MLP {MLP}, batch 1. SSM input D_s = D = 512 (``ssm_hidden_size=512``: the down-projection keeps the width, "
        f"as in the paper's speed setup); MF with S = 32 filters; unstruct with max_position_embeddings = L; BRecT with "
        f"{meta['recurrent_states']} recurrent states; lucidrains = `block-recurrent-transformer-pytorch` "
        f"{meta.get('lucidrains_version', 'n/a')}, depth 1 with its one recurrent layer, same dims and state count, "
        "SDPA attention. Milliseconds per forward, minimum over rounds in which the contenders alternate "
        f"(rounds per run: {meta['rounds']}). Command: `{meta['command']}`"
        + (" (several runs merged with `--render a.json b.json ...`)." if "merged_runs" in meta else "."),
        "",
        *table_rows(results, names),
        "",
        "Paper (GPU, same layer setup): BST:SH < 2x Slide at 4k; BRecT 6-11x slower than BST:SH "
        "(BST:MH 3-4x faster than BRecT); BRecT ~15x Slide at 4k.",
        "",
        "This machine:",
        *verdict(results),
        "",
        "Executed matmul + attention GFLOP per forward (counted with `torch.utils.flop_counter`; FFTs and elementwise "
        "ops excluded). On one CPU thread every contender runs its matmuls near the machine's peak, so these ratios "
        "are the floor of the time ratios:",
        "",
        *flop_rows(results, names),
        "",
        "Reading: BST:SH at D_s = D = 512 adds q2, a second o-projection half, the SSM down/up projections, context "
        "k/v and the triangular cross-attention to a Slide layer: 1.5x its FLOPs before any SSM cost, so SH <= 1.3x "
        "Slide cannot be met at this setup on a machine that runs both at its matmul peak (MF, whose context k/v run "
        "on S states per block only, is at ~1.3x). lucidrains executes ~2.4x the FLOPs of BST:SH, which bounds the "
        "speed-up over it similarly. On one CPU thread nothing runs in parallel anyway, so BRecT pays only for its "
        "FLOPs (state-side projections of S states per block), not for its sequential loop: its ratios are far below "
        "the paper's GPU ratios, where the loop also starves the device.",
        "",
        "![one-layer forward time vs L](benchmarks/layer_speed.png)",
        MARK_END,
    ]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = "\n".join(section)
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        _, tail = rest.split(MARK_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="L up to 4k, 3 rounds")
    parser.add_argument("--long", action="store_true", help="also L = 32k and 64k")
    parser.add_argument(
        "--dtype",
        type=alias_choice(DTYPE_ALIASES),
        choices=["fp32", "bf16", "both"],
        default="both",
        help="fp32 (alias float32), bf16 autocast (alias bfloat16) or both",
    )
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument(
        "--rounds", type=positive_int, default=None, help="alternating rounds per length (default 7, quick 3)"
    )
    parser.add_argument(
        "--budget", type=positive_float, default=90.0, help="seconds per (length, dtype) after 2 rounds"
    )
    parser.add_argument("--recurrent-states", type=positive_int, default=512, help="BRecT / lucidrains state vectors")
    parser.add_argument("--lengths", type=positive_int, nargs="*", default=None)
    parser.add_argument("--contenders", nargs="*", default=None, choices=CONTENDERS)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--device", type=device_arg, default="cpu", help="cpu or cuda (a GPU: synchronised timing, its free memory)"
    )
    parser.add_argument(
        "--render",
        type=existing_file,
        nargs="+",
        default=None,
        help="re-render table/plot/markdown from saved JSON(s); several runs are merged by per-cell minimum",
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before a layer is built."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.contenders and set(args.contenders) == {"lucidrains"} and not has_lucidrains():
        parser.error("--contenders lucidrains: block-recurrent-transformer-pytorch is not installed (see --help)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        meta, results = merge_runs([json.loads(Path(p).read_text()) for p in args.render])
        render(meta, results, list(next(iter(next(iter(results.values())).values()))))
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mallopt = tune_malloc()
    lengths = args.lengths or ([1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
    if args.long and not args.lengths:
        lengths += [32768, 65536]
    rounds = args.rounds or (3 if args.quick else 7)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    names = list(args.contenders or CONTENDERS)
    if "lucidrains" in names and not has_lucidrains():
        print("block-recurrent-transformer-pytorch not installed: skipping the lucidrains contender")
        names.remove("lucidrains")

    warm_up(3.0)
    meta = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model_code": model_code_version(),
        "malloc_env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")},
        "mallopt_no_mmap_no_trim": mallopt,
        "recurrent_states": args.recurrent_states,
        "rounds": rounds,
        "device": device_name(args.device),
        "command": "python -m benchmarks.layer_speed " + " ".join(a for a in sys.argv[1:]),
        "setup": dict(
            hidden=D,
            block_len=W,
            ssm_state_size=N,
            heads=HEADS,
            head_dim=HEAD_DIM,
            mlp=MLP,
            batch=1,
            ssm_hidden_size=D,
            num_context_states=32,
        ),
        "canary_before": canary_gflops(),
        "loadavg_before": os.getloadavg()[0],
    }
    if "lucidrains" in names:
        from importlib.metadata import version

        meta["lucidrains_version"] = version("block-recurrent-transformer-pytorch")
    print(f"{meta['cpu']}, {meta['threads']} thread(s); canary {meta['canary_before']:.0f} GFLOP/s")

    results = {}
    gpu = torch.device(args.device).type == "cuda"
    with RowLog(ROOT / "docs" / "benchmarks" / ("layer_speed_gpu.json" if gpu else "layer_speed.json"), meta) as log:
        for dtype in dtypes:
            results[dtype] = {}
            for seq_len in lengths:
                t0 = time.perf_counter()
                results[dtype][str(seq_len)] = time_length(
                    names,
                    seq_len,
                    dtype,
                    rounds,
                    args.budget,
                    args.recurrent_states,
                    count_flops=dtype == dtypes[0],
                    device=args.device,
                )
                row = results[dtype][str(seq_len)]
                log.add(dict(dtype=dtype, length=seq_len, entries=row))
                print(
                    f"{dtype} L={seq_len:6d} ({time.perf_counter() - t0:5.1f}s): "
                    + "  ".join(f"{n}={fmt(ms(row[n]))}" for n in names),
                    flush=True,
                )
                for n in names:
                    if "error" in row[n]:
                        print(f"  {n}: {row[n]['error']}")
        meta["canary_after"] = canary_gflops()
        meta["loadavg_after"] = os.getloadavg()[0]
        print(f"canary after {meta['canary_after']:.0f} GFLOP/s\n")
        if args.no_write:
            print("\n".join(table_rows(results, names)))
            print("\n" + "\n".join(verdict(results)))
        else:
            render(meta, results, names)
        log.done()


def merge_runs(runs):
    """Per (dtype, L, contender) minimum over several full runs.

    Contention from other jobs only ever adds time, so the minimum over runs (like the minimum over rounds) is the
    best estimate of the uncontended time; the canaries and load averages of every run are kept in the metadata.
    """
    if len(runs) == 1:
        return runs[0]["meta"], runs[0]["results"]
    meta = dict(runs[0]["meta"])
    keys = ("canary_before", "canary_after", "loadavg_before", "loadavg_after", "rounds", "model_code")
    meta["merged_runs"] = [{k: r["meta"].get(k) for k in keys} for r in runs]
    meta["model_code"] = "; ".join(dict.fromkeys(str(r["meta"].get("model_code", "n/a")) for r in runs))
    meta["canary_before"] = max(r["meta"]["canary_before"] for r in runs)
    meta["canary_after"] = max(r["meta"]["canary_after"] for r in runs)
    results = {}
    for run in runs:
        for dtype, per_len in run["results"].items():
            for seq_len, entries in per_len.items():
                cell = results.setdefault(dtype, {}).setdefault(seq_len, {})
                for name, entry in entries.items():
                    old = cell.get(name)
                    if old is None or ("min_ms" in entry and entry["min_ms"] < old.get("min_ms", float("inf"))):
                        merged = dict(entry)
                        if old is not None and "runs" in old and "runs" in entry:
                            merged["runs"] = old["runs"] + entry["runs"]
                        cell[name] = merged
                    elif "runs" in entry and "runs" in old:
                        old["runs"] += entry["runs"]
    return meta, results


def render(meta, results, names):
    """Print the table and write the JSON, the plot and the markdown section (CPU runs). A GPU run (meta["device"]
    is not the CPU) writes layer_speed_gpu.{json,png} and leaves the CPU section of docs/benchmarks.md alone: its
    summary is benchmarks/gpu_suite.py's."""
    print("\n".join(table_rows(results, names)))
    print("\n" + "\n".join(verdict(results)))
    out = ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    gpu = meta.get("device", meta["cpu"]) != meta["cpu"]
    stem = "layer_speed_gpu" if gpu else "layer_speed"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    plot(results, names, out / f"{stem}.png", title=meta["device"] if gpu else "CPU 1 thread")
    if not gpu:
        write_markdown(meta, results, names, ROOT / "docs" / "benchmarks.md")
    print(f"wrote {out / stem}.json, {out / stem}.png" + ("" if gpu else ", docs/benchmarks.md"))


if __name__ == "__main__":
    main()
