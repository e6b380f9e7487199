"""Batched decoding throughput (issue #35, item 1): tokens/s of ``model.generate`` (greedy, a fixed number of new
tokens after a prefilled context) for batch sizes 1..128 at contexts 1k..64k.

    python -m benchmarks.decode_throughput [--contexts 1024 16384 65536] [--batches 1 8 32 128] [--hidden 256
        --layers 4] [--new-tokens 8] [--repeats 2] [--memory-budget-gib 20] [--time-budget-s 840]
    python -m benchmarks.decode_throughput --quick --output /tmp/x.json --docs /tmp/x.md   # tiny sizes (the test's)

Contenders, one width/depth (hidden D, ``--layers`` layers, 64-dim heads, MLP 4D, vocabulary V, fp32):

* ``BST:SH:S4`` and ``BST:SH:unstruct`` (BSTForCausalLM, window W = ``--block-len``, BST layers at 0, n/2, n-1;
  unstruct is built per context with ``max_position_embeddings`` = context + new tokens, since its filters, and so
  its decode state, are as long as that);
* ``Llama (dynamic)`` and ``Llama (static)``: HF ``LlamaForCausalLM`` (SDPA) with a ``DynamicCache`` and with a
  ``StaticCache`` (what ``cache_implementation="static"`` builds; passed in as an instance here because it is
  filled from the prefilled context, see below).

How a cell (context N, batch B) is measured: each model prefills N - 1 random tokens once at batch 1 (timed: the
``prefill_s`` column); for every try that cache is copied and repeated to B identical rows (BST:
``Cache.batch_repeat_interleave``; Llama: the keys/values expanded into a fresh Dynamic/StaticCache), and
``generate`` runs from it on the B x N token ids (so generate's own first forward is the last context token) for
``--new-tokens`` T greedy tokens (``min_new_tokens`` = T). A streamer stamps the time of every step; decode
tokens/s = B (T - 1) / (time of the last step - time of the first step): neither the prefill nor generate's first
forward is in it. Decoding compute does not depend on the token values, so identical rows cost what distinct rows
cost. The contenders alternate within a cell (A B C D A B C D ...) and each keeps its best try.

Memory: peak resident memory (RSS) of the process during the cell, above the RSS before the batch's cache was made
(``VmHWM`` from /proc/self/status, reset through /proc/self/clear_refs before each try; the largest over the tries),
so it counts the B-row cache and generate's working memory, not the weights or the batch-1 prefill. glibc's mmap
threshold is fixed at 128 KiB (so a freed cache goes back to the system and the next try's peak counts its own). RSS
rather than an allocator counter because torch has no CPU allocator statistics and tracemalloc does not see torch
tensors.
Before a cell a model is skipped (and recorded with the reason) if its estimate exceeds the memory budget: Llama's
KV cache is 2 * layers * B * (N + T) * D * 4 bytes (fp32), x (1 + 1/layers) for DynamicCache (a layer's
concatenation copies it), BST's is B x its batch-1 cache bytes x 2 (the unstruct history keeps a slack buffer);
or if its time estimate (the step time at the previous batch, scaled by B) would run past ``--cell-budget-s`` or the
run's ``--time-budget-s``.

Useful-FLOP bound. FLOPs per decoded token (multiply-add = 2), P = weights of the Linear layers without the LM head
(counted from each model), d = heads x head_dim, Ds = the SSM width (D/4 for SH), S = ssm_state_size, n_bst BST
layers of n:

    Llama(N)          = 2 P + 2 D V + n * 4 d N                             (attention over the N cached keys)
    BST:SH:S4(N)      = 2 P + 2 D V + n * 4 d (W + 1) + n_bst * (4 d W + 8 Ds S)
                        (sliding-window ring of W + 1 keys per layer; a BST layer also attends to the W context
                        states; the S4D step updates S/2 complex modes per channel)
    BST:SH:unstruct(N) = BST:SH:S4(N) - n_bst 8 Ds S + n_bst * 2 Ds (N + T)
                        (a step's SSM output is the filter's dot product with the input history; the implementation
                        gets it by chunked FFT)

The bound on a tokens/s ratio BST/Llama is Llama(N) / BST(N): what BST would reach if both ran at the same FLOP/s.
A ratio's "fraction of bound" = measured ratio / bound (issue #35's goal: >= 0.8 against StaticCache from 16k up).
Small-batch decode is bound by memory traffic and per-op overhead rather than FLOPs, so the bound is an upper
reference, not a prediction.

Writes ``--output`` (JSON; rows also in ``<output>.partial.jsonl`` as they come), a PNG beside it (tokens/s vs batch
size per context, one colour per model) and the ``decode_throughput`` section of ``--docs`` (docs/benchmarks.md).
"""

import argparse
import copy
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.generation.streamers import BaseStreamer

from benchmarks.bench_common import (
    RowLog,
    existing_file,
    positive_float,
    positive_int,
    read_partial,
    write_json_atomic,
)
from benchmarks.docs_section import BENCHMARKS_MD, write_section
from modeling_bst import BSTConfig, BSTForCausalLM
from reporting import cpu_name


ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "bst-decode-throughput/1"
MODELS = ["BST:SH:S4", "BST:SH:unstruct", "Llama (dynamic)", "Llama (static)"]
COLOURS = {"BST:SH:S4": "tab:blue", "BST:SH:unstruct": "tab:cyan", "Llama (dynamic)": "tab:red"}
COLOURS["Llama (static)"] = "tab:orange"
GIB = 1024**3
QUICK = dict(hidden=64, layers=2, block_len=16, vocab=512, contexts=[64, 256], batches=[1, 4], new_tokens=4)
QUICK.update(repeats=1)


# -- models ------------------------------------------------------------------------------------------------------------
def build(name: str, args, context: int):
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    if name.startswith("BST"):
        config = BSTConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            head_dim=args.hidden // heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=context + args.new_tokens + 8,
            block_len=args.block_len,
            bst_layer_indices=sorted({0, args.layers // 2, args.layers - 1}),
            context_mode="sh",
            ssm_kind="unstruct" if name.endswith("unstruct") else "s4",
            dropout=0.0,
            attention_dropout=0.0,
        )
        return BSTForCausalLM(config).eval()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=args.hidden // heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=context + args.new_tokens + 8,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def linear_weights(model) -> int:
    return sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in name
    )


def flops_per_token(name: str, model, context: int, new_tokens: int) -> float:
    """The docstring's useful FLOPs per decoded token at ``context``."""
    c = model.config
    d = c.num_attention_heads * c.head_dim
    base = 2 * linear_weights(model) + 2 * c.hidden_size * c.vocab_size
    if name.startswith("Llama"):
        return base + c.num_hidden_layers * 4 * d * context
    n_bst = len(c.bst_layer_indices)
    w = c.block_len
    flops = base + c.num_hidden_layers * 4 * d * (w + 1) + n_bst * 4 * d * w
    if name.endswith("unstruct"):
        return flops + n_bst * 2 * c.ssm_channels * (context + new_tokens)
    return flops + n_bst * 8 * c.ssm_channels * c.ssm_state_size


def cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in cache.layers:
        tensors = [t for _, t in layer.tensors()] if hasattr(layer, "tensors") else [layer.keys, layer.values]
        if getattr(layer, "pending", None) is not None:
            tensors.append(layer.pending)
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def kv_bytes(config, batch: int, length: int) -> int:
    return 2 * config.num_hidden_layers * batch * length * config.num_key_value_heads * config.head_dim * 4


# -- memory --------------------------------------------------------------------------------------------------------------
def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def fixed_mmap_threshold() -> bool:
    """glibc: every block above 128 KiB its own mmap, returned to the system when freed (M_MMAP_THRESHOLD set by hand
    also stops glibc raising the threshold up to 32 MiB after frees): otherwise a try reuses heap memory an earlier
    try freed and its RSS peak undercounts. Applied to every contender alike."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> bool:
    """Set VmHWM (peak RSS) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- one try -------------------------------------------------------------------------------------------------------------
class StepClock(BaseStreamer):
    """``generate`` puts the prompt, then every step's tokens: one time stamp each."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.no_grad()
def prefill(name: str, model, ids, synthetic: bool = False):
    """The batch-1 cache of ``ids`` (all but the last context token) and its seconds. ``synthetic`` (Llama only):
    random keys/values of the prefill's shape instead of the prefill (see ``--synthetic-kv-from``)."""
    start = time.perf_counter()
    if name.startswith("Llama") and synthetic:
        c = model.config
        cache = DynamicCache(config=c)
        gen = torch.Generator().manual_seed(ids.shape[1])
        for i in range(c.num_hidden_layers):
            k, v = (torch.randn(1, c.num_key_value_heads, ids.shape[1], c.head_dim, generator=gen) for _ in "kv")
            cache.update(k, v, i)
    elif name.startswith("Llama"):
        cache = DynamicCache(config=model.config)
        model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    else:
        cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
    return cache, time.perf_counter() - start


def replicate(name: str, model, cache1, batch: int, max_len: int):
    """A fresh cache of ``batch`` copies of the batch-1 cache's row."""
    if name.startswith("BST"):
        cache = copy.deepcopy(cache1)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        return cache
    if name == "Llama (dynamic)":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    for i, layer in enumerate(cache1.layers):
        k, v = layer.keys, layer.values
        cache.update(k.expand(batch, *k.shape[1:]), v.expand(batch, *v.shape[1:]), i)
    return cache


@torch.no_grad()
def decode_once(name: str, model, cache1, ids, batch: int, new_tokens: int) -> dict:
    """One try: ``generate`` of ``new_tokens`` from the replicated cache; decode seconds, peak RSS above the start."""
    gc.collect()
    base = rss_bytes()
    reset_peak_rss()
    cache = replicate(name, model, cache1, batch, ids.shape[1] + new_tokens + 1)
    ids_b = ids.expand(batch, -1).contiguous()
    clock = StepClock()
    out = model.generate(
        ids_b,
        attention_mask=torch.ones_like(ids_b),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        pad_token_id=0,
        past_key_values=cache,
    )
    peak = rss_bytes("VmHWM") - base
    steps = len(clock.times) - 2  # the prompt's put and the first token's (generate's own first forward)
    assert out.shape == (batch, ids.shape[1] + new_tokens) and steps == new_tokens - 1, (out.shape, steps)
    seconds = clock.times[-1] - clock.times[1]
    del cache, out
    return dict(
        decode_s=seconds,
        step_s=seconds / steps,
        first_step_s=clock.times[1] - clock.times[0],
        peak_rss_bytes=peak,
        tokens=out_tokens(batch, steps),
    )


def out_tokens(batch: int, steps: int) -> int:
    return batch * steps


# -- the run -------------------------------------------------------------------------------------------------------------
def estimate_bytes(name: str, model, cache1, batch: int, length: int) -> int:
    logits = 2 * batch * model.config.vocab_size * 4
    if name == "Llama (static)":
        return kv_bytes(model.config, batch, length) + logits
    if name == "Llama (dynamic)":
        return int(kv_bytes(model.config, batch, length) * (1 + 1 / model.config.num_hidden_layers)) + logits
    return 2 * batch * cache_bytes(cache1) + logits


def run(args, log: RowLog) -> list:
    t0 = time.perf_counter()
    budget_bytes = args.memory_budget_gib * GIB
    rows = []
    for context in args.contexts:
        ids = torch.randint(0, args.vocab, (1, context), generator=torch.Generator().manual_seed(context))
        models, caches, last_step, info = {}, {}, {}, {}
        for name in args.models:
            # Llama (static) shares the weights and the prefill of Llama (dynamic) when both run.
            twin = "Llama (dynamic)" if name == "Llama (static)" else None
            if twin in models:
                models[name], caches[name] = models[twin], caches[twin]
                info[name] = dict(info[twin])
                continue
            models[name] = build(name, args, context)
            synthetic = name.startswith("Llama") and context >= args.synthetic_kv_from
            caches[name], seconds = prefill(name, models[name], ids[:, :-1], synthetic)
            info[name] = dict(prefill_s=seconds, cache1_bytes=cache_bytes(caches[name]), synthetic_kv=synthetic)
            print(f"N={context} {name}: prefill {seconds:.2f} s, cache {info[name]['cache1_bytes'] / 2**20:.1f} MiB")
        for name in args.models:
            info[name]["flops_per_token"] = flops_per_token(name, models[name], context, args.new_tokens)
        for batch in args.batches:
            results, skipped = {}, {}
            for name in args.models:
                need = estimate_bytes(name, models[name], caches[name], batch, context + args.new_tokens + 1)
                if need + rss_bytes() > budget_bytes:
                    skipped[name] = (
                        f"memory: estimated {need / GIB:.1f} GiB + {rss_bytes() / GIB:.1f} GiB resident > "
                        f"{args.memory_budget_gib:g} GiB budget"
                    )
                    continue
                if name in last_step:
                    prev_batch, step_s = last_step[name]
                    est = args.repeats * (args.new_tokens + 1) * step_s * batch / prev_batch
                    if est > args.cell_budget_s:
                        skipped[name] = f"time: estimated {est:.0f} s > {args.cell_budget_s:g} s per cell"
                        continue
                    if time.perf_counter() - t0 + est > args.time_budget_s:
                        skipped[name] = f"time: estimated {est:.0f} s would pass the run's {args.time_budget_s:g} s"
                        continue
                results[name] = []
            for _ in range(args.repeats):  # alternate the contenders: A B C D A B C D
                for name in results:
                    results[name].append(decode_once(name, models[name], caches[name], ids, batch, args.new_tokens))
            for name in args.models:
                row = dict(context=context, batch=batch, model=name, **info[name])
                if name in skipped:
                    row.update(skipped=skipped[name])
                else:
                    tries = results[name]
                    best = min(tries, key=lambda r: r["decode_s"])
                    row.update(
                        tokens_per_s=best["tokens"] / best["decode_s"],
                        step_ms=best["step_s"] * 1000,
                        first_step_s=best["first_step_s"],
                        peak_rss_bytes=max(r["peak_rss_bytes"] for r in tries),
                        tries_tokens_per_s=[r["tokens"] / r["decode_s"] for r in tries],
                    )
                    last_step[name] = (batch, best["step_s"])
                rows.append(log.add(row))
                print(
                    f"N={context:>6} B={batch:>4} {name:<16} "
                    + (
                        f"skipped ({row['skipped']})"
                        if "skipped" in row
                        else f"{row['tokens_per_s']:9.1f} tok/s  step {row['step_ms']:8.1f} ms  "
                        f"peak +{row['peak_rss_bytes'] / 2**20:8.1f} MiB"
                    ),
                    flush=True,
                )
        del models, caches
        gc.collect()
    return rows


def ratios(rows: list, reference: str) -> list:
    """BST/``reference`` tokens/s ratio per cell, with the useful-FLOP bound and the fraction of it reached."""
    by = {(r["context"], r["batch"], r["model"]): r for r in rows}
    out = []
    for r in rows:
        if not r["model"].startswith("BST"):
            continue
        ref = by.get((r["context"], r["batch"], reference))
        if ref is None:
            continue
        bound = ref["flops_per_token"] / r["flops_per_token"]
        item = dict(context=r["context"], batch=r["batch"], model=r["model"], reference=reference, bound=bound)
        if "tokens_per_s" in r and "tokens_per_s" in ref:
            item["ratio"] = r["tokens_per_s"] / ref["tokens_per_s"]
            item["fraction_of_bound"] = item["ratio"] / bound
        else:
            item["ratio"] = None
            item["note"] = "BST skipped" if "tokens_per_s" not in r else f"{reference} skipped"
        out.append(item)
    return out


def goals(rows: list, args) -> dict:
    static = [
        r for r in ratios(rows, "Llama (static)") if r["model"] == "BST:SH:S4" and r["context"] >= 16384 and r["ratio"]
    ]
    fractions = [r["fraction_of_bound"] for r in static]
    held = {}
    for r in rows:  # 64k batches BST:SH:S4 ran whose Llama KV cache alone would not fit 24 GiB
        if r["model"] == "BST:SH:S4" and r["context"] >= 65536 and "tokens_per_s" in r:
            llama_kv = 2 * args.layers * r["batch"] * (r["context"] + args.new_tokens) * args.hidden * 4
            if llama_kv > 24 * GIB:
                held[r["batch"]] = llama_kv / GIB
    return dict(
        fraction_of_bound_vs_static_from_16k=fractions,
        within_0_8_of_bound=bool(fractions) and min(fractions) >= 0.8,
        batch_at_64k_llama_cannot_hold_in_24gib={str(k): round(v, 1) for k, v in held.items()},
        batch_goal_met=bool(held),
    )


# -- outputs -------------------------------------------------------------------------------------------------------------
def plot(rows: list, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for name in MODELS:
            pts = [(r["batch"], r.get("tokens_per_s")) for r in rows if r["context"] == context and r["model"] == name]
            pts = [p for p in pts if p[1] is not None]  # skipped cells have none
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, "o-", color=COLOURS[name], label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"context {context // 1024}k" if context >= 1024 else f"context {context}")
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Batched greedy decoding after a prefilled context (prefill excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_bytes(n) -> str:
    return "-" if n is None else (f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB")


def markdown(report: dict) -> list[str]:
    meta, rows = report["meta"], report["rows"]
    a = meta["args"]
    lines = [
        "## Batched decoding throughput (issue #35)",
        "",
        f"`python -m benchmarks.decode_throughput {meta['argv']}` on {meta['machine']}, {a['threads']} thread(s), "
        f"torch {meta['torch']}, transformers {meta['transformers']}, fp32; {meta['date']}.",
        f"Hidden {a['hidden']}, {a['layers']} layers, 64-dim heads, vocabulary {a['vocab']}, window W = "
        f"{a['block_len']}; greedy `generate` of {a['new_tokens']} tokens after a batch-1 prefill of the context "
        f"replicated to B rows; decode tokens/s = B x {a['new_tokens'] - 1} steps / their time (prefill excluded), "
        f"best of {a['repeats']} alternated tries. Memory: peak RSS above the start of the cell's try (the B-row "
        f"cache and generate's working memory). Cells estimated above {a['memory_budget_gib']:g} GiB or the time "
        "budget are skipped. Formulas and method: `benchmarks/decode_throughput.py`.",
        *(
            f"Rows marked with run {i} come from an earlier run with the same settings (`{m.get('argv', '')}`, "
            f"{m.get('date', '')}, {m.get('machine', '')}), included with `--include {m['source']}`."
            for i, m in enumerate(report.get("included_runs", []), 1)
        ),
        "",
        "| context | batch | model | tokens/s | ms/step | peak memory | prefill (batch 1) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r:
            cells = f"skipped: {r['skipped']} | | |"
        else:
            cells = f"{r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | {fmt_bytes(r['peak_rss_bytes'])} |"
        prefill_s = "random KV" if r.get("synthetic_kv") else f"{r['prefill_s']:.1f} s"
        run = f" (run {r['run']})" if "run" in r else ""
        lines.append(f"| {r['context']} | {r['batch']} | {r['model']}{run} | {cells} {prefill_s} |")
    lines += [
        "",
        "Ratios of BST tokens/s to Llama's at the same cell, with the useful-FLOP bound (Llama FLOPs/token over "
        "BST's) and the fraction of it reached:",
        "",
        "| context | batch | BST model | vs | ratio | bound | fraction of bound |",
        "|---:|---:|---|---|---:|---:|---:|",
    ]
    for ref in ("Llama (static)", "Llama (dynamic)"):
        for r in ratios(rows, ref):
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            frac = "-" if r["ratio"] is None else f"{r['fraction_of_bound']:.2f}"
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['model']} | {ref}{note} | {ratio} | {r['bound']:.2f} | {frac} |"
            )
    if report["meta"].get("note"):
        lines += ["", report["meta"]["note"]]
    g = report["goals"]
    fr = ", ".join(f"{f:.2f}" for f in g["fraction_of_bound_vs_static_from_16k"]) or "none measured"
    held = ", ".join(f"B={b} (Llama KV {v} GiB)" for b, v in g["batch_at_64k_llama_cannot_hold_in_24gib"].items())
    lines += [
        "",
        f"Goals (issue #35): BST:SH:S4 within 0.8 of the useful-FLOP bound vs StaticCache from 16k up: "
        f"{'met' if g['within_0_8_of_bound'] else 'not met'} (fractions {fr}). A batch at 64k that Llama cannot "
        f"hold in 24 GiB: {'met, ' + held if g['batch_goal_met'] else 'not met (no such 64k cell ran)'}.",
    ]
    return lines


# -- flags ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test); explicit flags still win")
    p.add_argument("--contexts", type=positive_int, nargs="+")
    p.add_argument("--batches", type=positive_int, nargs="+")
    p.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    p.add_argument("--hidden", type=positive_int)
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--block-len", type=positive_int)
    p.add_argument("--vocab", type=positive_int)
    p.add_argument("--new-tokens", type=positive_int, help="tokens generated per try (>= 2)")
    p.add_argument("--repeats", type=positive_int, help="alternated tries per cell (each contender keeps its best)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--memory-budget-gib", type=positive_float, default=20.0)
    p.add_argument("--cell-budget-s", type=positive_float, default=240.0, help="skip a model's cell estimated longer")
    p.add_argument("--time-budget-s", type=positive_float, default=840.0, help="skip cells past this run time")
    p.add_argument(
        "--synthetic-kv-from",
        type=positive_int,
        default=65536,
        help="Llama at contexts >= this: the batch-1 cache filled with random keys/values instead of a prefill (what "
        "a decode step costs does not depend on the values; a 64k prefill on one CPU thread takes many minutes)",
    )
    p.add_argument(
        "--include",
        type=existing_file,
        nargs="+",
        default=[],
        help="rows of earlier runs with the same model settings (their JSON or .partial.jsonl) reported beside this "
        "run's: a run stopped at one context and resumed with the others",
    )
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks" / "decode_throughput.json")
    p.add_argument("--docs", type=Path, default=BENCHMARKS_MD, help="markdown file whose section is rewritten")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--note", default="", help="a sentence for the docs section (e.g. the machine's load)")
    p.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite the PNG and the docs section from the --output JSON of an earlier run",
    )
    return p


DEFAULTS = dict(hidden=256, layers=4, block_len=512, vocab=32000, contexts=[1024, 16384, 65536])
DEFAULTS.update(batches=[1, 8, 32, 128], new_tokens=8, repeats=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first generated token's step is not timed)")
    if args.hidden % 64 and args.hidden > 64:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 64 (64-dim heads)")
    if args.layers < 2:
        parser.error("--layers must be at least 2")
    if len(set(args.models)) != len(args.models):
        parser.error("--models: each model once")
    args.contexts = sorted(set(args.contexts))
    args.batches = sorted(set(args.batches))
    return args


SAME_SETTINGS = ("hidden", "layers", "block_len", "vocab", "new_tokens", "threads")


def included_rows(args) -> tuple[list, list]:
    """Rows of ``--include`` files (same model settings, else SystemExit) and their runs' meta."""
    rows, metas = [], []
    for path in args.include:
        if path.endswith(".jsonl"):
            meta, found = read_partial(path)
        else:
            report = json.loads(Path(path).read_text())
            meta, found = report["meta"], report["rows"]
        differ = [k for k in SAME_SETTINGS if meta.get("args", {}).get(k) != getattr(args, k)]
        if differ:
            raise SystemExit(f"--include {path}: other settings ({', '.join(differ)}) than this run")
        metas.append(dict(meta, source=path))
        rows += [dict(r, run=len(metas)) for r in found]
    return rows, metas


def render(args) -> dict:
    report = json.loads(args.output.read_text())
    if args.note:
        report["meta"]["note"] = args.note
        write_json_atomic(args.output, report)
    plot(report["rows"], args.output.with_suffix(".png"))
    if not args.no_docs:
        write_section("decode_throughput", markdown(report), args.docs)
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render(args)
    earlier, earlier_meta = included_rows(args)
    torch.set_num_threads(args.threads)
    mmap_fixed = fixed_mmap_threshold()
    meta = dict(
        machine=f"{cpu_name()} ({platform.machine()}, {__import__('os').cpu_count()} CPUs)",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=sys.version.split()[0],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        argv=" ".join(sys.argv[1:] if argv is None else argv),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        note=args.note,
        memory="peak RSS (VmHWM reset via /proc/self/clear_refs) above the RSS before the try; glibc "
        + ("M_MMAP_THRESHOLD fixed at 128 KiB" if mmap_fixed else "malloc defaults (mallopt unavailable)"),
    )
    # warm-up: the first seconds of a process run matmuls slowly (docs: benchmarking notes)
    a = torch.randn(512, 512)
    end = time.perf_counter() + (0.2 if args.quick else 3.0)
    while time.perf_counter() < end:
        a @ a
    with RowLog(args.output, meta) as log:
        rows = run(args, log)
        ours = {(r["context"], r["batch"], r["model"]) for r in rows}
        rows = [r for r in earlier if (r["context"], r["batch"], r["model"]) not in ours] + rows
        rows.sort(key=lambda r: (r["context"], r["batch"], MODELS.index(r["model"])))
        report = dict(schema=SCHEMA, meta=meta, rows=rows, included_runs=earlier_meta)
        report["ratios"] = ratios(rows, "Llama (static)") + ratios(rows, "Llama (dynamic)")
        report["goals"] = goals(rows, args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.output, report)
        plot(rows, args.output.with_suffix(".png"))
        if not args.no_docs:
            write_section("decode_throughput", markdown(report), args.docs)
        log.done()
    print("\n".join(markdown(report)))
    return report


if __name__ == "__main__":
    main()
