"""Training throughput (tokens/s) and model FLOP utilisation: BST vs HF Llama of the same size, same run.

Setup (issue #6): a ~60M-parameter model (hidden 512, 8 layers, 8 heads of 64, MLP 2048, 32k vocabulary) trained
on one sequence of L = 4096 tokens per step (forward + backward + AdamW step), fp32 and bf16 autocast. BST uses
W = 512 blocks with BST layers at {0, 5, 6} (SH, S4); Llama uses full causal attention through SDPA.

MFU = (useful model FLOPs per token x tokens/s) / (measured peak matmul FLOP/s of this machine), against the peak of
the run's dtype and against the bf16 peak (the issue's yardstick); see ``flops_per_token``. The FLOP ratio Llama/BST
is the speed-up BST would show if both models ran at the same FLOP rate.

    python -m benchmarks.train_throughput [--quick] [--threads 1] [--seq-len 4096] [--rounds 3] [--steps 2]
                                          [--size 60m|200m] [--device cpu|cuda] [--dtypes fp32 bf16]

Prints a table and writes docs/benchmarks/train_throughput.{json,png} and a section of docs/benchmarks.md. ``--size
200m`` is the ~200M preset (training/presets/bst-sh-s4.json's shape: hidden 1024, 12 layers, BST layers {0, 7, 9}) and
a Llama of the same hidden size, depth and MLP. ``--device cuda`` times on the GPU (synchronised; the peak is the
GPU's measured matmul rate), adds HF Llama with flash-attention-2 for bf16 where ``flash_attn`` is installed, and
writes train_throughput_gpu.{json,png} only (benchmarks/gpu_suite.py writes the GPU summary).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_bst  # noqa: F401
from benchmarks.bench_common import DTYPE_ALIASES, RowLog, alias_choice, device_arg, positive_int
from benchmarks.docs_section import clock, tune_malloc, write_section
from modeling_bst import BSTConfig, BSTForCausalLM
from reporting import cpu_name, device_name


ROOT = Path(__file__).resolve().parents[1]


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 8, device: str = "cpu") -> float:
    """Best observed FLOP/s of a square matmul (a canary for the machine's state, and the MFU denominator)."""
    if torch.device(device).type == "cuda":
        size, repeats = 8192, 20  # large enough to saturate the tensor cores
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = clock(device)
        a @ b
        best = min(best, clock(device) - start)
    return 2 * size**3 / best


# Model shapes (hidden, depth, MLP, heads x head_dim, BST layers, block length W); both contenders share the first four.
SIZES = {
    "60m": dict(hidden=512, layers=8, mlp=2048, heads=8, head_dim=64, bst_layers=[0, 5, 6], block_len=512),
    "200m": dict(hidden=1024, layers=12, mlp=4096, heads=8, head_dim=128, bst_layers=[0, 7, 9], block_len=512),
    "tiny": dict(hidden=128, layers=2, mlp=256, heads=2, head_dim=64, bst_layers=[0], block_len=64),  # dry runs
    # benchmarks/train_ops.py counts ops: the 60m layer structure (and W) at a narrow width and a small vocabulary,
    # which change no op of the sequence, only each op's size
    "60m-narrow": dict(
        hidden=64, layers=8, mlp=128, heads=8, head_dim=8, bst_layers=[0, 5, 6], block_len=512, vocab=512
    ),
}
ATTENTION = {"llama": "sdpa", "llama-flash": "flash_attention_2"}


def build(kind: str, seq_len: int, size: str = "60m", **overrides):
    """A contender of the preset ``size``; ``overrides`` replace entries of its shape (``block_len=64`` for example)."""
    shape = {**SIZES[size], **overrides}
    common = dict(
        vocab_size=shape.get("vocab", 32000),
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        intermediate_size=shape["mlp"],
        num_attention_heads=shape["heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=seq_len,
    )
    if kind in ATTENTION:
        config = LlamaConfig(
            **common, num_key_value_heads=shape["heads"], tie_word_embeddings=True, attn_implementation=ATTENTION[kind]
        )
        return LlamaForCausalLM(config)
    layers = {"bst": shape["bst_layers"], "slide": []}[kind]
    config = BSTConfig(
        **common,
        block_len=shape["block_len"],
        bst_layer_indices=layers,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return BSTForCausalLM(config)


def flops_per_token(model, kind: str, seq_len: int) -> float:
    """Useful training FLOPs per token (forward + backward = 3 x forward, 2 FLOPs per multiply-add).

    Dense: 6 x parameters (tied embeddings: the lookup is free, the lm head matmul costs vocab x hidden, so every
    parameter counts once). Attention: 12 x width x (keys each query attends to) per layer: Llama (L+1)/2 on average
    (causal); BST/Slide exactly W (the W previous tokens) in self-attention, plus (W+1)/2 in the triangular
    cross-attention of BST layers (SH). Masked work a kernel may still execute is not counted.
    """
    dense = sum(p.numel() for p in model.parameters())
    config = model.config
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    if kind in ATTENTION:
        keys = config.num_hidden_layers * (seq_len + 1) / 2
    else:
        w = config.block_len
        keys = config.num_hidden_layers * w + len(config.bst_layer_indices) * (w + 1) / 2
    return 6 * dense + 12 * width * keys


class Contender:
    """A model with its optimiser; ``step()`` times one training step (forward, backward, AdamW).

    ``batch`` sequences of ``seq_len`` tokens per step; ``compile``: None (eager), ``"default"`` (``torch.compile(model)``,
    inductor), another ``torch.compile`` mode, or ``"eager"`` (dynamo with the eager backend: the CPU dry runs);
    ``fused``: ``AdamW(fused=True)`` (default: on CUDA). The first step (the compile, for a compiled model) is not
    timed; its seconds are ``first_step_s``."""

    def __init__(
        self,
        kind: str,
        seq_len: int,
        dtype: torch.dtype,
        device: str = "cpu",
        size: str = "60m",
        checkpointing: bool = False,
        batch: int = 1,
        compile: str | None = None,
        fused: bool | None = None,
    ):
        torch.manual_seed(0)
        self.kind, self.dtype, self.device, self.batch, self.compile = kind, dtype, device, batch, compile
        self.model = build(kind, seq_len, size).to(device)
        if checkpointing:  # the same transformers call for every contender: each layer's activations recomputed
            # later transformers 5.x name it activation_checkpointing_enable (the old name warns); take what exists
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.step_model = self.model if compile is None else compiled(self.model, compile)
        fused = torch.device(device).type == "cuda" if fused is None else fused
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
        self.fused = fused
        self.ids = torch.randint(0, self.model.config.vocab_size, (batch, seq_len), device=device)
        self.times = []
        start = time.perf_counter()
        self.step(record=False)  # warm-up: optimiser state, allocator, kernel selection (and the compile)
        self.first_step_s = clock(device) - start

    def step(self, record: bool = True):
        start = clock(self.device)
        device_type = torch.device(self.device).type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            loss = self.step_model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if record:
            self.times.append(clock(self.device) - start)


def compiled(model, mode: str):
    """``torch.compile`` of ``model`` for training steps: ``"default"`` = ``torch.compile(model)``, ``"eager"`` = dynamo
    with the eager backend (no code generation), any other name a ``torch.compile`` mode."""
    if mode == "default":
        return torch.compile(model)
    if mode == "eager":
        return torch.compile(model, backend="eager")
    return torch.compile(model, mode=mode)


def device_busy(contender: Contender, steps: int = 2) -> dict:
    """Kernels per step and GPU busy fraction of ``contender`` from ``steps`` steps under torch.profiler: the device
    events (kernels, copies, memsets) per step, and the union of their intervals per step over the contender's best
    timed (unprofiled) step. On a CPU: ``{}`` (no device events)."""
    if torch.device(contender.device).type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            contender.step(record=False)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:  # union of the intervals: overlapping streams counted once
        if b > end:
            busy_us += b - max(a, end)
            end = b
    per_step_s = busy_us / 1e6 / steps
    best = min(contender.times) if contender.times else None
    return dict(
        kernels_per_step=len(spans) / steps,
        device_busy_ms_per_step=per_step_s * 1000,
        gpu_busy=per_step_s / best if best else None,
    )


NAMES = {
    "llama": "HF Llama (sdpa)",
    "llama-flash": "HF Llama (flash-attention-2)",
    "bst": "BST:SH:S4",
    "slide": "Slide",
}


def measure(
    kinds,
    seq_len: int,
    dtype_name: str,
    rounds: int,
    steps: int,
    peaks: dict,
    device="cpu",
    size="60m",
    checkpointing: bool = False,
    batch: int = 1,
    compile: str | None = None,
    fused: bool | None = None,
    busy_steps: int = 0,
    errors_as_rows: bool = False,
):
    """One row per contender (``kinds``, "llama" among them: the reference), contenders alternated round by round,
    tokens/s (``batch`` x ``seq_len`` per step) from each one's fastest step. ``peaks``: measured matmul FLOP/s, keys
    "fp32" and "bf16". ``checkpointing``: gradient checkpointing for every contender (the useful FLOPs do not count
    the recomputation). ``compile``, ``fused``: see [`Contender`]. ``busy_steps``: that many profiled steps per
    contender after the timing ([`device_busy`]: kernels per step, GPU busy fraction). ``errors_as_rows``: a
    contender that fails to build or to take its first step (a compile error, out of memory) becomes a row with an
    ``error`` and the others are measured; otherwise the exception propagates."""
    if dtype_name not in peaks or "llama" not in kinds:  # before any model is built, not after the timing
        raise ValueError(f"dtype {dtype_name!r} (valid: {', '.join(peaks)}) and kinds {kinds} (must include llama)")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    mode = "eager" if compile is None else f"compiled ({compile})"
    contenders, failed = [], {}
    for kind in kinds:
        try:
            contenders.append(
                Contender(kind, seq_len, dtype, device, size, checkpointing, batch=batch, compile=compile, fused=fused)
            )
        except Exception as exc:
            if not errors_as_rows:
                raise
            failed[kind] = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            )
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    # Alternate contenders and keep each one's best, so a machine-state flip hits all of them.
    for r in range(rounds):
        for c in contenders:
            for _ in range(steps):
                c.step()
        print(
            f"{dtype_name} {mode} batch {batch} round {r + 1}/{rounds}: "
            + "  ".join(f"{c.kind} {batch * seq_len / min(c.times):.0f} tok/s" for c in contenders),
            flush=True,
        )
    tps = {c.kind: batch * seq_len / min(c.times) for c in contenders}
    fpt = {c.kind: flops_per_token(c.model, c.kind, seq_len) for c in contenders}
    rows = []
    for c in contenders:
        busy = device_busy(c, busy_steps) if busy_steps else {}
        rows.append(
            dict(
                model=NAMES[c.kind],
                dtype=dtype_name,
                batch=batch,
                mode=mode,
                fused_adamw=c.fused,
                params=sum(p.numel() for p in c.model.parameters()),
                flops_per_token=fpt[c.kind],
                tokens_per_s=tps[c.kind],
                step_times_s=c.times,
                first_step_s=c.first_step_s,
                vs_llama=tps[c.kind] / tps["llama"] if "llama" in tps else None,
                flop_ratio=fpt["llama"] / fpt[c.kind] if "llama" in fpt else None,
                mfu=fpt[c.kind] * tps[c.kind] / peaks[dtype_name],
                mfu_bf16=fpt[c.kind] * tps[c.kind] / peaks["bf16"],
                gradient_checkpointing=checkpointing,
                **busy,
            )
        )
    rows += [dict(model=NAMES[k], dtype=dtype_name, batch=batch, mode=mode, error=e) for k, e in failed.items()]
    del contenders
    return rows


def has_flash() -> bool:
    """Whether flash-attention-2 can serve HF Llama here (the ``flash_attn`` package and a CUDA device)."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def stem_for(meta, gpu: bool = False) -> str:
    """File stem and docs section of a run: the L = 4096 run is ``train_throughput``, other lengths get ``_L<n>``."""
    stem = "train_throughput_gpu" if gpu else "train_throughput"
    return stem if meta["seq_len"] == 4096 else f"{stem}_L{meta['seq_len']}"


def write_docs(rows, meta):
    stem = stem_for(meta)
    at = "" if meta["seq_len"] == 4096 else f" at L = {meta['seq_len']}"
    lines = [
        f"## Training throughput{at} (issues #6, #15)",
        "",
        f"Machine: {meta['cpu']}, {meta['threads']} thread(s); torch {meta['torch']}, transformers "
        f"{meta['transformers']}; glibc malloc without mmap/trim for every contender ({meta['mallopt']}). One sequence "
        f"of L = {meta['seq_len']} tokens per step (forward, backward, AdamW); ~60M-parameter models (hidden 512, "
        "8 layers, 32k vocabulary; BST: W = 512, BST layers {0, 5, 6}, SH, S4, D_s = 128; Llama: 8 heads of 64, "
        "SwiGLU 2048, full causal SDPA). Contenders alternate round by round; tokens/s from each one's fastest of "
        f"{meta['rounds']} x {meta['steps']} timed steps"
        + (
            "; gradient checkpointing (every layer recomputed in backward) for every contender, the useful FLOPs "
            "below do not count the recomputation"
            if meta.get("gradient_checkpointing")
            else ""
        )
        + f". Command: `{meta['command']}`.",
        f"Measured matmul peak (2048^3, same process): fp32 {meta['peak_fp32'] / 1e9:.0f} GFLOP/s, bf16 "
        f"{meta['peak_bf16'] / 1e9:.0f} GFLOP/s (AVX512-BF16, no AMX on this CPU).",
        "",
        "| model | dtype | params | useful GFLOP/token | tokens/s | vs Llama | FLOP ratio Llama/model | MFU (own dtype "
        "peak) | MFU (bf16 peak) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['params'] / 1e6:.1f}M | {r['flops_per_token'] / 1e9:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['vs_llama']:.2f}x | {r['flop_ratio']:.2f}x | {100 * r['mfu']:.1f}% | "
            f"{100 * r['mfu_bf16']:.1f}% |"
        )
    long = meta["seq_len"] >= 16384
    lines += [
        "",
        "Targets (issue #15): BST tokens/s / Llama tokens/s >= 0.95 x the useful-FLOP ratio at L = 4096, and >= 3x "
        "Llama at L = 16384 (where full attention dominates Llama's cost); issue #6's MFU >= 35% of the bf16 peak.",
    ]
    for r in rows:
        if r["model"] == NAMES["bst"]:
            share = r["vs_llama"] / r["flop_ratio"]
            target = (
                f"{'met' if r['vs_llama'] >= 3 else 'NOT met'} against 3x; the FLOP bound is {r['flop_ratio']:.2f}x"
                if long
                else f"{share:.2f} of the bound ({'met' if share >= 0.95 else 'NOT met'} against 0.95)"
            )
            lines.append(
                f"- {r['dtype']}: BST = {r['vs_llama']:.2f}x Llama tokens/s, useful-FLOP ratio {r['flop_ratio']:.2f}x "
                f"(the speed-up if both ran at the same FLOP rate): {target}; MFU {100 * r['mfu_bf16']:.1f}% of the "
                "bf16 peak."
            )
    lines += ["", f"![training throughput](benchmarks/{stem}.png)"]
    write_section(stem, lines)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(models)
    for i, model in enumerate(models):
        vals = [next((r["tokens_per_s"] for r in rows if r["model"] == model and r["dtype"] == d), 0) for d in dtypes]
        ax.bar([j + i * width for j in range(len(dtypes))], vals, width, label=model)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(dtypes))], dtypes)
    ax.set_ylabel("training tokens/s (L = 4096, batch 1)")
    ax.set_title("Training throughput, CPU 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DTYPES = ["fp32", "bf16"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seq-len", type=positive_int, default=4096)
    parser.add_argument("--steps", type=positive_int, default=2, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds in which the contenders alternate")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--quick", action="store_true", help="L=1024, 1 round of 1 step")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        type=alias_choice(DTYPE_ALIASES),
        choices=DTYPES,
        default=list(DTYPES),
        help="fp32 (alias float32) and/or bf16 autocast (alias bfloat16)",
    )
    parser.add_argument("--size", choices=list(SIZES), default="60m")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward, for every contender (long L on a small-memory machine)",
    )
    parser.add_argument(
        "--kinds", nargs="+", default=["llama", "bst", "slide"], choices=["llama", "bst", "slide"], help="contenders"
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before anything is built or timed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if "llama" not in args.kinds:
        parser.error("--kinds must include llama (the reference every ratio is taken against)")
    args.dtypes = list(dict.fromkeys(args.dtypes))
    args.kinds = list(dict.fromkeys(args.kinds))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.seq_len, args.steps, args.rounds = 1024, 1, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mallopt = tune_malloc()
    matmul_peak(torch.float32, device=args.device)  # warm-up: the first seconds after start run slower
    gpu = torch.device(args.device).type == "cuda"
    meta = dict(
        cpu=cpu_name(),
        device=device_name(args.device),
        size=args.size,
        threads=args.threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        seq_len=args.seq_len,
        steps=args.steps,
        rounds=args.rounds,
        mallopt="applied" if mallopt else "not available",
        command="python -m benchmarks.train_throughput " + " ".join(sys.argv[1:]),
        gradient_checkpointing=args.gradient_checkpointing,
        peak_fp32=matmul_peak(torch.float32, device=args.device),
        peak_bf16=matmul_peak(torch.bfloat16, device=args.device),
    )
    peaks = {"fp32": meta["peak_fp32"], "bf16": meta["peak_bf16"]}
    out = ROOT / "docs" / "benchmarks"
    stem = stem_for(meta, gpu)
    with RowLog(out / f"{stem}.json", meta) as log:
        for dtype_name in args.dtypes:
            kinds = list(args.kinds) + (["llama-flash"] if gpu and dtype_name == "bf16" and has_flash() else [])
            for row in measure(
                kinds,
                args.seq_len,
                dtype_name,
                args.rounds,
                args.steps,
                peaks,
                args.device,
                args.size,
                args.gradient_checkpointing,
            ):
                log.add(row)
        rows = log.rows
        print(
            f"{'model':<18} {'dtype':<5} {'params':>8} {'tok/s':>8} {'vs Llama':>8} {'FLOP ratio':>10} {'MFU bf16':>8}"
        )
        for r in rows:
            print(
                f"{r['model']:<18} {r['dtype']:<5} {r['params'] / 1e6:>7.1f}M {r['tokens_per_s']:>8.0f} "
                f"{r['vs_llama']:>7.2f}x {r['flop_ratio']:>9.2f}x {100 * r['mfu_bf16']:>7.1f}%"
            )
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        plot(rows, out / f"{stem}.png")
        if not gpu:
            write_docs(rows, meta)
        log.done()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
