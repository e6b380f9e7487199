"""Compiled decoding from ``generate`` itself: ms per decoded token, eager (the default cache) against
``cache_implementation="static"`` with a ``compile_config`` (transformers compiles the decode step; no
``torch.compile`` call by the user), batch 1 and 8, greedy outputs checked identical.

    python -m benchmarks.generate_compile [--quick] [--batches 1 8] [--context 1024] [--new-tokens 32]

A token's time is ``(t(M new tokens) - t(1 new token)) / (M - 1)`` of two ``generate`` calls on the same prompt, so the
prefill cancels out (best of ``--rounds``). Prints a table, writes docs/benchmarks/generate_compile.{json,png} and the
``generate_compile`` section of docs/benchmarks.md (``--no-write``: print only).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig

import modeling_bst  # noqa: F401
from benchmarks.bench_common import RowLog, device_arg, positive_int, write_json_atomic
from benchmarks.docs_section import clock, write_section
from modeling_bst import BSTConfig, BSTForCausalLM
from reporting import device_name


ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "generate_compile.json"
# name -> the BST fields that make the variant (on top of the size flags)
VARIANTS = {
    "bst-sh-s4": dict(context_mode="sh", ssm_kind="s4"),
    "bst-mf-s4": dict(context_mode="mf", ssm_kind="s4"),
    "slide": dict(bst_layer_indices=[]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["bst-sh-s4"])
    parser.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8])
    parser.add_argument("--context", type=positive_int, default=1024, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="decoded tokens per timed call (>= 2)")
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--block-len", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--device", type=device_arg, default="cpu")
    parser.add_argument("--quick", action="store_true", help="context 256, 8 new tokens, hidden 64, 2 layers")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.new_tokens, args.hidden, args.layers, args.block_len = 256, 8, 64, 2, 32
    if args.new_tokens < 2:
        parser.error(f"argument --new-tokens: needs at least 2 decoded tokens, got {args.new_tokens}")
    if args.hidden % 64:
        parser.error(f"argument --hidden: a multiple of 64 (heads of 64 dimensions), got {args.hidden}")
    return args


def make_model(variant: str, args) -> BSTForCausalLM:
    fields = dict(
        vocab_size=32000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        block_len=args.block_len,
        max_position_embeddings=args.context + args.new_tokens,
        dropout=0.0,
        bst_layer_indices=[args.layers // 2],  # one BST layer in the middle (the paper's 12-layer models: 2)
    )
    fields.update(VARIANTS[variant])
    torch.manual_seed(0)
    return BSTForCausalLM(BSTConfig(**fields)).eval().to(args.device)


def compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=False, mode="default")
    config._compile_all_devices = True  # transformers' flag: compile in generate on the CPU too
    return config


def per_token_ms(model, ids, new_tokens: int, rounds: int, device: str, **kwargs) -> tuple[float, torch.Tensor]:
    """Best-of-``rounds`` ms per decoded token, and the sequences of the last long call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = clock(device)
        model.generate(ids, max_new_tokens=1, do_sample=False, **kwargs)
        t1 = clock(device)
        seqs = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
        t2 = clock(device)
        best = min(best, ((t2 - t1) - (t1 - t0)) / (new_tokens - 1) * 1e3)
    return best, seqs


def measure(variant: str, batch: int, args) -> dict:
    model = make_model(variant, args)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, 32000, (batch, args.context), generator=g).to(args.device)
    with torch.no_grad():
        eager_ms, eager = per_token_ms(model, ids, args.new_tokens, args.rounds, args.device)
        static = dict(cache_implementation="static", compile_config=compile_config())
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, **static)  # compiles
        compile_s = time.perf_counter() - t0
        compiled_ms, compiled = per_token_ms(model, ids, args.new_tokens, args.rounds, args.device, **static)
    return dict(
        variant=variant,
        batch=batch,
        context=args.context,
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
        speedup=eager_ms / compiled_ms,
        first_compiled_call_s=compile_s,
        compiled_ran=hasattr(model, "_compiled_call"),
        identical=bool(torch.equal(eager, compiled)),
    )


def plot(rows, path: Path, machine: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['variant']}\nbatch {r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(rows), 3.6))
    ax.bar([i - 0.2 for i in x], [r["eager_ms"] for r in rows], 0.4, label="eager (default cache)")
    ax.bar([i + 0.2 for i in x], [r["compiled_ms"] for r in rows], 0.4, label="static cache, compiled by generate")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decoded token")
    ax.set_title(f"generate: eager vs compiled decode step ({machine})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = device_name(args.device)
    meta = dict(
        machine=machine,
        threads=args.threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        hidden=args.hidden,
        layers=args.layers,
        block_len=args.block_len,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        command="python -m benchmarks.generate_compile " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    print(f"{machine}, {args.threads} thread(s); hidden {args.hidden}, {args.layers} layers, context {args.context}")
    print(
        f"{'model':<10} {'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} {'compile s':>10} identical"
    )
    with RowLog(OUT, meta) as log:
        for variant in args.variants:
            for batch in args.batches:
                r = log.add(measure(variant, batch, args))
                print(
                    f"{r['variant']:<10} {r['batch']:>5} {r['eager_ms']:>9.2f} {r['compiled_ms']:>12.2f} "
                    f"{r['speedup']:>8.2f}x {r['first_compiled_call_s']:>10.1f} {r['identical']}",
                    flush=True,
                )
        rows = log.rows
        if args.no_write:
            log.done()
            return rows
        write_json_atomic(OUT, dict(meta=meta, rows=rows))
        plot(rows, OUT.with_suffix(".png"), machine)
        lines = [
            "## Compiled decoding from generate (issue #35)",
            "",
            f"{machine}, {args.threads} thread(s), torch {torch.__version__}, transformers {transformers.__version__}; "
            f"hidden {args.hidden}, {args.layers} layers, W = {args.block_len}, vocabulary 32000, fp32, after a "
            f"{args.context}-token prompt. `{meta['command']}`. ms per decoded token (best of {args.rounds}; the "
            "prefill cancels out): eager = `generate` with its default cache (`DynamicCache` of BST layers); "
            'compiled = `cache_implementation="static"` with a `compile_config` (transformers compiles the decode '
            "step; the first call's compile time beside it).",
            "",
            "| model | batch | eager ms/token | compiled ms/token | speed-up | first compiled call (s) | greedy identical |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {r['variant']} | {r['batch']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                f"{r['speedup']:.2f}x | {r['first_compiled_call_s']:.0f} | {'yes' if r['identical'] else 'NO'} |"
                for r in rows
            ),
            "",
            "![eager vs compiled decoding](benchmarks/generate_compile.png)",
        ]
        write_section("generate_compile", lines)
        log.done()
    return rows


if __name__ == "__main__":
    main()
