"""Decode speed and memory vs context length: BST (recurrent cache) vs recompute, HF Llama (KV cache), HF Mamba.

For each context N: prefill N random tokens with one forward, then time single-token decode steps (best of
``--steps`` after warm-up). Memory is the cache's tensor bytes. Same width/depth for every model.

    python -m benchmarks.generation_speed [--quick] [--contexts 1024 4096 16384 65536] [--hidden 512 --layers 8]

Prints a table, writes docs/benchmarks/generation_speed.{json,png} and a section of docs/benchmarks.md.
``--device cuda`` times on the GPU (synchronised) and writes generation_speed_gpu.{json,png} only;
``--compile reduce-overhead`` also times compiled decode steps of BST S4 and Llama with a StaticCache (CUDA graphs on a
GPU), each compile checked against eager (largest logit difference and dynamo's graph count go into the JSON's meta);
benchmarks/gpu_suite.py uses the same functions.
Goal (issue #3/#6): BST per-token time flat (64k/1k <= 1.1) and faster than Llama from 4k context on.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM, StaticCache

import modeling_bst
from benchmarks.bench_common import RowLog, device_arg, non_negative_int, positive_int
from benchmarks.docs_section import clock, write_section
from modeling_bst import BSTConfig, BSTForCausalLM
from reporting import cpu_name, device_name


ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes") and callable(obj.nbytes):
        return obj.nbytes()
    total = 0
    for layer in getattr(obj, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, dict):
                total += sum(v.numel() * v.element_size() for v in value.values() if isinstance(v, torch.Tensor))
    return total


def build(kind: str, hidden: int, layers: int, max_context: int):
    heads = max(1, hidden // 64)
    if kind in ("bst-s4", "bst-unstruct", "bst-recompute"):
        config = BSTConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            head_dim=64,
            intermediate_size=4 * hidden,
            max_position_embeddings=max_context + 64,
            block_len=512,
            bst_layer_indices=sorted({0, layers // 2, layers - 1}),
            ssm_kind="unstruct" if kind == "bst-unstruct" else "s4",
            dropout=0.0,
            attention_dropout=0.0,
        )
        return BSTForCausalLM(config).eval()
    if kind.startswith("llama"):
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=max_context + 64,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config).eval()
    config = MambaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2 * layers, state_size=16)
    return MambaForCausalLM(config).eval()


@torch.no_grad()
def measure(kind: str, model, context: int, steps: int, device: str = "cpu", step_model=None, stat: str = "best"):
    """Best (``stat="mean"``: mean) ms per decode step after a prefill of ``context`` tokens, and the cache's bytes.
    ``step_model`` (default ``model``) runs the steps: a compiled ``model`` for example; the prefill always runs on
    ``model``. The mean is what an amortised step costs (unstruct chunks: one FFT per M steps); take ``steps`` >= M."""
    ids = torch.randint(0, VOCAB, (1, context), device=device)
    token = torch.randint(0, VOCAB, (1, 1), device=device)
    step_model = model if step_model is None else step_model
    if kind == "bst-recompute":
        seq = ids
        best = float("inf")
        for _ in range(steps):
            start = clock(device)
            model(seq, use_cache=False, logits_to_keep=1)
            best = min(best, clock(device) - start)
        return best * 1000, 0
    if kind == "llama-static":
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
        out = model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    elif kind == "llama-dynamic":
        out = model(ids, use_cache=True, logits_to_keep=1, past_key_values=DynamicCache(config=model.config))
    elif kind == "mamba":
        out = model(ids, use_cache=True)
    else:
        out = model(ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        cache = getattr(out, "cache_params", None)
    position = context
    best = float("inf")
    times = []
    for i in range(steps + 2):
        start = clock(device)
        if kind == "mamba":
            out = step_model(token, cache_params=cache, use_cache=True)
            cache = out.cache_params
        elif kind.startswith("llama"):
            pos = torch.tensor([[position]], device=device)
            out = step_model(token, use_cache=True, position_ids=pos, past_key_values=cache)
            cache = out.past_key_values
        else:
            out = step_model(token, use_cache=True, past_key_values=cache)
            cache = out.past_key_values
        position += 1
        if i >= 2:
            times.append(clock(device) - start)
            best = min(best, times[-1])
    return (best if stat == "best" else sum(times) / len(times)) * 1000, tensor_bytes(cache)


KINDS = ["bst-s4", "bst-unstruct", "bst-recompute", "llama-dynamic", "llama-static", "mamba"]


# Models whose decode step is compiled with ``--compile``: BST S4 (its cache a pytree of fixed shapes) and Llama with a
# StaticCache (the transformers way to a capturable decode step).
COMPILED_KINDS = ("bst-s4", "llama-static")


def compile_step(model, mode: str):
    """``torch.compile`` of the model for decode steps, static shapes, one graph: CUDA graphs with
    ``mode="reduce-overhead"`` on a GPU (inductor alone on the CPU), or dynamo with the eager backend
    (``mode="eager"``: no code generation, what the CPU dry runs use to count graphs quickly)."""
    if mode == "eager":
        return torch.compile(model, backend="eager", dynamic=False)
    return torch.compile(model, mode=mode, dynamic=False)


@torch.no_grad()
def compiled_max_diff(kind: str, model, step_model, device: str, context: int = 64, steps: int = 3) -> float:
    """Largest |logit difference| between ``step_model`` and ``model`` over a few greedy decode steps from copies of
    one cache (the compile checked against eager)."""
    ids = torch.randint(0, VOCAB, (1, context), device=device)
    if kind == "llama-static":
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
    else:
        cache = DynamicCache(config=model.config) if kind == "llama-dynamic" else None
    out = model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    caches = [out.past_key_values, copy.deepcopy(out.past_key_values)]
    token, diff = out.logits[:, -1:].argmax(-1), 0.0
    for t in range(steps):
        extra = {"position_ids": torch.tensor([[context + t]], device=device)} if kind.startswith("llama") else {}
        a = model(token, use_cache=True, **extra, past_key_values=caches[0]).logits
        b = step_model(token, use_cache=True, **extra, past_key_values=caches[1]).logits
        diff = max(diff, (a.float() - b.float()).abs().max().item())
        token = a[:, -1:].argmax(-1)
    return diff


def compile_counters() -> dict:
    """Dynamo's graph counts and inductor's CUDA-graph skips since the last ``counters.clear()``: why graphs did not
    help, if not (``unique_graphs`` far above the number of contexts: recompiled on every step)."""
    from torch._dynamo.utils import counters

    picked = {
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    picked.update({k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    return picked


def measure_compiled(
    models: dict, contexts, steps: int, device: str, mode: str, skip=None, on_row=None
) -> tuple[list, dict]:
    """Compiled decode steps of [`COMPILED_KINDS`]: each compile checked against eager first, then timed at every
    context (those of them in ``models``) but those ``skip(kind, context)`` rules out (the eager run's limits).
    Returns rows (``model`` = kind + "-compiled") and per kind the check and dynamo's counters; ``on_row(row)`` is
    called with each row as it is measured."""
    from torch._dynamo.utils import counters

    rows, report = [], {}
    for kind in [k for k in COMPILED_KINDS if k in models]:
        counters.clear()
        torch._dynamo.reset()
        step_model = compile_step(models[kind], mode)
        record = report[kind] = {
            "max_abs_logit_diff_vs_eager": compiled_max_diff(kind, models[kind], step_model, device)
        }
        for context in contexts:
            if skip is not None and skip(kind, context):
                continue
            ms, nbytes = measure(kind, models[kind], context, steps, device, step_model=step_model)
            rows.append(dict(model=f"{kind}-compiled", context=context, ms_per_token=ms, cache_bytes=nbytes))
            if on_row is not None:
                on_row(rows[-1])
            print(f"{kind + '-compiled':<15} {context:>8} {ms:>9.2f} {nbytes / 2**20:>10.2f}", flush=True)
        record.update(compile_counters())
        print(f"{kind} compiled ({mode}): {record}", flush=True)
    torch._dynamo.reset()
    return rows, report


def write_docs(rows, meta, contexts):
    kinds = list(dict.fromkeys(r["model"] for r in rows))
    table = {(r["model"], r["context"]): r for r in rows}
    lines = [
        "## Decode speed vs context (issues #3, #6)",
        "",
        f"Machine: {meta['cpu']}, {meta['threads']} thread(s); torch {meta['torch']}, transformers "
        f"{meta['transformers']}. Models: hidden {meta['hidden']}, {meta['layers']} layers (Mamba: twice the layers, "
        "similar size), 32k vocabulary, batch 1, fp32. Prefill N tokens in one forward, then the best of "
        f"{meta['steps']} single-token steps. Cache = tensor bytes of the returned cache. "
        f"Command: `{meta['command']}`.",
        "",
        "| model | "
        + " | ".join(f"{c} ms/token" for c in contexts)
        + " | "
        + " | ".join(f"{c} cache" for c in contexts)
        + " |",
        "|---|" + "---|" * (2 * len(contexts)),
    ]
    for kind in kinds:
        ms = [f"{table[(kind, c)]['ms_per_token']:.1f}" if (kind, c) in table else "-" for c in contexts]
        mem = [f"{table[(kind, c)]['cache_bytes'] / 2**20:.1f} MiB" if (kind, c) in table else "-" for c in contexts]
        lines.append(f"| {kind} | " + " | ".join(ms) + " | " + " | ".join(mem) + " |")
    first, last = contexts[0], contexts[-1]
    notes = []
    for kind in kinds:
        if (kind, first) in table and (kind, last) in table:
            ratio = table[(kind, last)]["ms_per_token"] / table[(kind, first)]["ms_per_token"]
            notes.append(f"- {kind}: {last}/{first} per-token time ratio {ratio:.2f}")
    for c in contexts:
        if ("bst-s4", c) not in table:
            continue
        bst = table[("bst-s4", c)]["ms_per_token"]
        peers = [
            f"{table[(k, c)]['ms_per_token'] / bst:.2f}x Llama {label}"
            for k, label in (("llama-dynamic", "DynamicCache (generate()'s default)"), ("llama-static", "StaticCache"))
            if (k, c) in table
        ]
        if peers:
            notes.append(f"- context {c}: BST S4 decodes at " + ", ".join(peers) + " tokens/s")
    if ("bst-s4", first) in table and ("bst-s4", last) in table:
        flat = table[("bst-s4", last)]["ms_per_token"] / table[("bst-s4", first)]["ms_per_token"]
        notes.append(
            f"- target per-token time {last}/{first} <= 1.1: {flat:.2f} ({'met' if flat <= 1.1 else 'NOT met'})"
        )
    if ("bst-s4", 16384) in table and ("llama-dynamic", 16384) in table:
        dyn = table[("llama-dynamic", 16384)]["ms_per_token"] / table[("bst-s4", 16384)]["ms_per_token"]
        notes.append(
            f"- target >= 3x HF Llama tokens/s at 16k: {dyn:.2f}x against DynamicCache "
            f"({'met' if dyn >= 3 else 'NOT met'})"
            + (
                f", {table[('llama-static', 16384)]['ms_per_token'] / table[('bst-s4', 16384)]['ms_per_token']:.2f}x "
                "against a preallocated StaticCache"
                if ("llama-static", 16384) in table
                else ""
            )
        )
    lines += ["", *notes, "", "![decode time vs context](benchmarks/generation_speed.png)"]
    write_section("generation_speed", lines)


def plot(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in dict.fromkeys(r["model"] for r in rows):
        pts = [(r["context"], r["ms_per_token"]) for r in rows if r["model"] == kind]
        ax.plot(*zip(*pts), marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decoded token")
    ax.set_title("Decode cost vs context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument(
        "--recompute-max", type=non_negative_int, default=4096, help="largest context for the no-cache baseline"
    )
    parser.add_argument(
        "--mamba-max", type=non_negative_int, default=4096, help="largest context for Mamba (slow torch prefill)"
    )
    parser.add_argument(
        "--llama-max",
        type=non_negative_int,
        default=None,
        help="largest context for Llama (its full-attention prefill is quadratic)",
    )
    parser.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, contexts 1k/4k/16k")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--compile",
        default=None,
        choices=["reduce-overhead", "default", "max-autotune", "eager"],
        help="also time compiled decode steps of bst-s4 and llama-static (torch.compile mode; 'eager': dynamo only), "
        "each checked against eager first",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=KINDS,
        choices=KINDS,
        help="models to time (default all), e.g. --kinds bst-unstruct",
    )
    parser.add_argument(
        "--stat",
        default="best",
        choices=["best", "mean"],
        help="per-token time: best of --steps, or their mean (amortised cost: unstruct chunks refresh every 256 steps)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="run all contexts this many times, alternating"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print only: no JSON/PNG, no docs/benchmarks.md section"
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before a model is built."""
    return build_parser().parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.contexts = 256, 4, [1024, 4096, 16384]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    max_context = max(args.contexts)
    meta = dict(
        cpu=cpu_name(),
        device=device_name(args.device),
        threads=args.threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        hidden=args.hidden,
        layers=args.layers,
        steps=args.steps,
        stat=args.stat,
        modeling_bst=str(Path(modeling_bst.__file__).parent),
        command="python -m benchmarks.generation_speed " + " ".join(sys.argv[1:]),
    )
    kinds = [k for k in KINDS if k in args.kinds]
    built = {"bst-s4" if k == "bst-recompute" else k for k in kinds}
    models = {k: build(k, args.hidden, args.layers, max_context).to(args.device) for k in built}
    if "bst-recompute" in kinds:
        models["bst-recompute"] = models["bst-s4"]
    out = ROOT / "docs" / "benchmarks"
    stem = "generation_speed_gpu" if torch.device(args.device).type == "cuda" else "generation_speed"
    log = RowLog(out / f"{stem}.json", meta)
    print(f"{'model':<15} {'context':>8} {'ms/token':>9} {'cache MiB':>10}")

    def skipped(kind: str, context: int) -> bool:
        """Contexts beyond a contender's limit (slow prefill or memory), the same for eager and compiled steps."""
        if kind == "bst-recompute":
            return context > args.recompute_max
        if kind == "mamba":
            return context > args.mamba_max
        return kind.startswith("llama") and args.llama_max is not None and context > args.llama_max

    with log:
        for context in [c for _ in range(args.repeats) for c in args.contexts]:
            for kind in kinds:
                if skipped(kind, context):
                    continue
                steps = args.steps if kind != "bst-recompute" else 2
                ms, nbytes = measure(kind, models[kind], context, steps, args.device, stat=args.stat)
                log.add(dict(model=kind, context=context, ms_per_token=ms, cache_bytes=nbytes))
                print(f"{kind:<15} {context:>8} {ms:>9.2f} {nbytes / 2**20:>10.2f}", flush=True)
        if args.compile is not None:
            meta["compile_mode"] = args.compile
            _, meta["compiled"] = measure_compiled(
                models, args.contexts, args.steps, args.device, args.compile, skip=skipped, on_row=log.add
            )
        rows = log.rows
        if args.no_write:
            print(json.dumps(meta))
        else:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
            plot(rows, out / f"{stem}.png")
            if stem == "generation_speed":
                write_docs(rows, meta, args.contexts)
        log.done()


if __name__ == "__main__":
    main()
