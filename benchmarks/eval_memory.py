"""Peak memory of one long evaluation forward (issue #6: a 65k-token evaluation of a ~200M model in 12 GiB of CPU memory).

    python -m benchmarks.eval_memory                                  # bst-sh-s4 (~200M), 4k/16k/65k tokens, bf16
    python -m benchmarks.eval_memory --preset slide-12l --tokens 65536 --chunk 4096 --dtype float32 --no_docs

Each configuration runs in a fresh process (so ``ru_maxrss`` is that run's own peak): build the preset with random
weights (the 32k vocabulary; SSM parameters stay float32 as in ``from_pretrained``), then score one sequence of N
tokens with ``training.evaluate.window_nll``: fed in chunks of C tokens with the BST cache carried between them, which
gives the same NLL as one N-token forward (tests/training/test_training.py::test_chunked_evaluation_equals_whole_windows)
while the activations and the (C x 32k) logits stay bounded by C. Reported: parameters, resident memory after
building the model, peak resident memory of the whole process, the evaluation time and tokens/s. Writes
``docs/benchmarks/eval_memory.{json,png}`` and the ``eval_memory`` section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_common import TORCH_DTYPE_ALIASES, RowLog, alias_choice, positive_float, positive_int


ROOT = Path(__file__).resolve().parent.parent


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 2**20


def child(preset: str, tokens: int, chunk: int, dtype: str, threads: int) -> dict:
    import torch

    from modeling_bst import BSTConfig, BSTForCausalLM
    from training.evaluate import window_nll

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = BSTConfig.from_json_file(str(ROOT / "training" / "presets" / f"{preset}.json"))
    if config.ssm_kind == "unstruct":
        config.max_position_embeddings = max(config.max_position_embeddings, tokens)
    with torch.device("meta"):
        model = BSTForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.init_weights()
    if dtype != "float32":
        keep = set(model.ssm_parameter_names())
        for name, p in model.named_parameters():
            if name not in keep:
                p.data = p.data.to(getattr(torch, dtype))
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    rss_model = _rss_gib()
    ids = torch.randint(0, config.vocab_size, (1, tokens + 1))
    t0 = time.perf_counter()
    nll, _ = window_nll(model, ids[:, :-1], ids[:, 1:], chunk_size=chunk)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return {
        "preset": preset,
        "tokens": tokens,
        "chunk": chunk,
        "dtype": dtype,
        "threads": threads,
        "parameters": params,
        "rss_model_gib": round(rss_model, 3),
        "peak_rss_gib": round(peak, 3),
        "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens / seconds, 1),
        "nll_per_token": float(nll) / tokens,
    }


def run(preset: str, tokens: int, chunk: int, dtype: str, threads: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.eval_memory", "--child", "--preset", preset, "--tokens", str(tokens)]
    cmd += ["--chunk", str(chunk)]
    cmd += ["--dtype", dtype, "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:  # the child's own error, not just its exit status
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{preset} at {tokens} tokens: child process exited with {proc.returncode}:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_docs(rows: list[dict], budget_gib: float) -> None:
    import platform

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    import transformers

    from benchmarks.docs_section import write_section
    from reporting import cpu_name

    out_dir = ROOT / "docs" / "benchmarks"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval_memory.json").write_text(json.dumps(rows, indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["preset"], r["chunk"], r["dtype"]) for r in rows}):
        pts = sorted((r["tokens"], r["peak_rss_gib"]) for r in rows if (r["preset"], r["chunk"], r["dtype"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} chunk {key[1]} {key[2]}")
    ax.axhline(budget_gib, color="red", linestyle="--", label=f"{budget_gib:g} GiB budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in one evaluation sequence")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "eval_memory.png", dpi=110)
    plt.close(fig)
    lines = [
        "## Long evaluation memory (issue #6)",
        "",
        f"Machine: {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}, Python "
        f"{platform.python_version()}. Command: `python -m benchmarks.eval_memory` (one fresh process per row; "
        "random weights, 32k vocabulary; the sequence is fed in chunks with the cache carried, exact w.r.t. one "
        "forward).",
        "",
        "| preset | params | tokens | chunk | dtype | RSS after build | peak RSS | time | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['parameters'] / 1e6:.0f}M | {r['tokens']} | {r['chunk']} | {r['dtype']} | "
            f"{r['rss_model_gib']:.2f} GiB | {r['peak_rss_gib']:.2f} GiB | {r['seconds']:.0f} s | "
            f"{r['tokens_per_second']:.0f} |"
        )
    worst = max(r["peak_rss_gib"] for r in rows if r["tokens"] == max(x["tokens"] for x in rows))
    lines += [
        "",
        f"The longest sequence peaks at {worst:.2f} GiB ({'within' if worst <= budget_gib else 'OVER'} the "
        f"{budget_gib:g} GiB budget); memory does not grow with the sequence because the cache is bounded "
        "(W-token rings, the S4 state) and only one chunk's activations and logits exist at a time.",
        "",
        "![peak memory vs evaluation length](benchmarks/eval_memory.png)",
    ]
    write_section("eval_memory", lines)


PRESETS = sorted(f.stem for f in (ROOT / "training" / "presets").glob("*.json"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--preset", default="bst-sh-s4", choices=PRESETS, help="a config of training/presets/")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--chunk", type=positive_int, default=4096)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        type=alias_choice(TORCH_DTYPE_ALIASES),
        choices=["float32", "bfloat16"],
        help="float32 (alias fp32) or bfloat16 (alias bf16)",
    )
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--budget_gib", type=positive_float, default=12.0)
    p.add_argument("--no_docs", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every one checked before a model is built."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.preset, args.tokens[0], args.chunk, args.dtype, args.threads)))
        return []
    meta = dict(preset=args.preset, chunk=args.chunk, dtype=args.dtype, threads=args.threads, argv=sys.argv[1:])
    with RowLog(ROOT / "docs" / "benchmarks" / "eval_memory.json", meta) as log:
        for n in args.tokens:
            r = log.add(run(args.preset, n, args.chunk, args.dtype, args.threads))
            print(
                f"{r['preset']} ({r['parameters'] / 1e6:.0f}M) {n} tokens chunk {r['chunk']} {r['dtype']}: "
                f"peak {r['peak_rss_gib']:.2f} GiB (model {r['rss_model_gib']:.2f}), {r['seconds']:.0f} s",
                flush=True,
            )
        if not args.no_docs:
            write_docs(log.rows, args.budget_gib)
        log.done()
    return log.rows


if __name__ == "__main__":
    main()
