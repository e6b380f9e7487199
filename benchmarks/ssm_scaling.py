"""SSM cost at long context (issue #15): BST:MH linear in L, unstruct decoding without a per-token history copy.

Two A/B measurements in one run, the two code paths alternated round by round (minimum kept), one thread:

* **MH (and SH, Slide for reference) one-layer cost at L = 4k / 8k / 16k**, the paper's Fig. 3 layer (D = 512,
  W = 128, N = 16, 16 heads, D_s = D): evaluation forward (no_grad) and a training step (forward + backward).
  "whole" is the whole-length FFT convolution (the first code path, ``S4DKernel.chunk_len = 0``): its (H, D_s,
  L + 1) spectrum outgrows the evaluation memo above 4k and training rebuilds it at every step. "default" is the
  model's policy (``S4DKernel.use_chunks``): ``S4DKernel.chunked_forward`` (64-token chunks + the free response of
  the chunk-start states) in training and where the memo does not fit, the memoised whole spectrum otherwise; MH
  runs the segmented path (``TokenContextStates.segmented_context``: chunked SSM output, lift and K/V projection a
  few chunks at a time). "unsegmented" (MH only, ``segment_len = 0``): the previous MH code, the chunked SSM output
  of the whole sequence then the lift. ``--layers`` / ``--paths`` pick a subset (for a quick A/B).
* **Unstruct decode ms/token at 1k..64k** of the ~60M decode model of ``generation_speed.py`` (hidden 512, 8 layers,
  filters of 64k taps), the mean over ``--steps`` decode steps (at least 2 M, so that chunk starts are included):
  "direct" is one dot product of the whole history with the filter taps per token (the previous code: O(context));
  "chunked" is the model's decoding in chunks of M = ``ssm_bst.UNSTRUCT_DECODE_CHUNK`` steps (one FFT convolution
  per chunk gives the earlier inputs' share of its M outputs, a step adds a dot product over <= M recent inputs).

    python -m benchmarks.ssm_scaling [--lengths 4096 8192 16384] [--contexts 1024 16384 65536] [--rounds 3]
                                     [--parts layers decode]   # one part: the other is kept from the saved JSON
                                     [--layers BST:MH:S4] [--paths unsegmented default]

Writes docs/benchmarks/ssm_scaling.json, docs/benchmarks/ssm_scaling.png and the ``ssm_scaling`` section of
docs/benchmarks.md.
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import (
    generation_speed,
    layer_speed,
)
from benchmarks.bench_common import RowLog, existing_file, positive_int
from benchmarks.docs_section import clock, tune_malloc, write_section
from modeling_bst import ssm_bst
from modeling_bst.context_bst import MH_SEGMENT_LEN, TokenContextStates
from reporting import cpu_name


ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
LAYERS = ["Slide", "BST:SH:S4", "BST:MH:S4"]


def set_path(module: torch.nn.Module, path: str):
    """``whole``: one FFT over the whole length; ``unsegmented``: the chunked S4D output of the whole sequence, then
    the lift (MH before the segmented path); ``default``: the model's policy."""
    for m in module.modules():
        if isinstance(m, ssm_bst.S4DKernel):
            m.chunk_len = 0 if path == "whole" else ssm_bst.S4D_CHUNK_LEN
        if isinstance(m, TokenContextStates):
            m.segment_len = MH_SEGMENT_LEN if m.mode == "mh" and path != "unsegmented" else 0


def segmented(layer: torch.nn.Module) -> bool:
    """Whether the layer's default path is the segmented one (an unsegmented A/B path exists)."""
    return any(isinstance(m, TokenContextStates) and m.segment_len for m in layer.modules())


def layer_ab(lengths, rounds, names=None, paths=("whole", "unsegmented", "default"), on_row=None):
    """{mode: {L: {contender/path: min ms}}} for mode in eval / train; ``on_row(row)`` is called with each (mode, L)
    as it is measured."""
    names = names or LAYERS + ["BST:SH:S4 D_s=D/4"]
    out = {"eval": {}, "train": {}, "gflop": {}}
    for seq_len in lengths:
        flops = out["gflop"].setdefault(str(seq_len), {})
        x = torch.randn(1, seq_len, layer_speed.D)
        layers = {name: layer_speed.bst_layer(name, seq_len, 0)[0] for name in LAYERS if name in names}
        if "BST:SH:S4 D_s=D/4" in names:
            # The paper's own SSM width for SH (D_s = D/4; the Fig. 3 speed setup above keeps D_s = D).
            sh4 = layer_speed.bst_layer("BST:SH:S4", seq_len, 0, ssm_hidden=layer_speed.D // 4)[0]
            layers["BST:SH:S4 D_s=D/4"] = sh4
        contenders = [("Slide", None)] if "Slide" in layers else []
        contenders += [
            (n, p) for n in layers if n != "Slide" for p in paths if p != "unsegmented" or segmented(layers[n])
        ]
        for name, layer in layers.items():
            layer.eval()
            flops[name] = layer_speed.executed_gflop(layer, x)
        for mode in ("eval", "train"):
            times = {f"{n}/{p}" if p else n: [] for n, p in contenders}
            for r in range(rounds + 1):  # round 0 warms up
                for name, path in contenders:
                    layer = layers[name].train(mode == "train")
                    if path is not None:
                        set_path(layer, path)
                    t0 = clock("cpu")
                    if mode == "eval":
                        with torch.no_grad():
                            layer(x)
                    else:
                        xg = x.clone().requires_grad_(True)
                        layer(xg)[0].float().sum().backward()
                        layer.zero_grad(set_to_none=True)
                    if r:
                        times[f"{name}/{path}" if path else name].append(1e3 * (clock("cpu") - t0))
                    gc.collect()
            out[mode][str(seq_len)] = {k: min(v) for k, v in times.items()}
            if on_row is not None:
                on_row(dict(part="layers", mode=mode, length=seq_len, ms=out[mode][str(seq_len)], gflop=flops))
            print(mode, seq_len, {k: round(v) for k, v in out[mode][str(seq_len)].items()}, flush=True)
        del layers
        gc.collect()
    return out


def set_decode_chunk(module: torch.nn.Module, chunked: bool):
    """Unstruct decoding in chunks of M steps (the model's default) or one dot product over the whole history per
    step (M = L_max: no chunk ever starts, every step takes the direct path)."""
    for m in module.modules():
        if isinstance(m, ssm_bst.UnstructFilter):
            m.decode_chunk = min(ssm_bst.UNSTRUCT_DECODE_CHUNK, m.max_len) if chunked else m.max_len


def decode_ab(contexts, steps, rounds, on_row=None):
    """{path: {context: mean ms/token}} for the unstruct decode model, "direct" vs "chunked", alternated round by
    round (the smallest round mean kept); ``on_row(row)`` is called with each (round, context, path)'s mean."""
    model = generation_speed.build("bst-unstruct", 512, 8, max(contexts))
    out = {"direct": {}, "chunked": {}}
    for r in range(rounds):  # every round measures every (context, path): a change in machine load hits them all
        for context in contexts:
            for path in out:
                set_decode_chunk(model, path == "chunked")
                with torch.no_grad():
                    ms, _ = generation_speed.measure("bst-unstruct", model, context, steps, stat="mean")
                key = str(context)
                out[path][key] = min(ms, out[path].get(key, float("inf")))
                if on_row is not None:
                    on_row(dict(part="decode", round=r, context=context, path=path, ms=ms))
                print("decode", path, context, round(ms, 1), flush=True)
                gc.collect()
    set_decode_chunk(model, True)
    return out


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, mode in zip(axes[:2], ("eval", "train")):
        per_len = results["layers"][mode]
        lengths = sorted(int(k) for k in per_len)
        for key in per_len[str(lengths[0])]:
            ax.plot(lengths, [per_len[str(n)][key] for n in lengths], marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("ms")
        ax.set_title(f"one layer, {'forward (eval)' if mode == 'eval' else 'forward + backward'}")
        ax.legend(fontsize=8)
    ax = axes[2]
    dec = results["decode"]
    for variant in dec:
        ctx = sorted(int(k) for k in dec[variant])
        ax.plot(ctx, [dec[variant][str(c)] for c in ctx], marker="o", label=f"unstruct decode, {variant}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per token")
    ax.set_title("unstruct decoding (~60M model)")
    ax.legend(fontsize=8)
    fig.suptitle(f"SSM scaling, CPU 1 thread ({results['meta']['cpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results) -> list[str]:
    meta, layers, dec = results["meta"], results["layers"], results["decode"]
    lengths = sorted(int(k) for k in layers["eval"])
    lines = [
        "## SSM cost at long context: BST:MH and unstruct decoding (issue #15)",
        "",
        f"Machine: {meta['cpu']}, 1 thread; torch {meta['torch']}; load average before/after "
        f"{meta['loadavg_before']:.1f} / {meta['loadavg_after']:.1f}. Both paths of each A/B alternate round by "
        f"round in one process (minimum of {meta['rounds']} rounds). Command: `{meta['command']}`."
        + "".join(
            f" The {part} results are kept from an earlier run (`{meta[part + '_from']}`)."
            for part in ("layers", "decode")
            if meta.get(part + "_from")
        ),
        "",
        "One layer of the paper's Fig. 3 setup (D = 512, W = 128, N = 16, 16 heads, D_s = D unless stated), ms. "
        "*whole*: one FFT convolution over the whole length, always (the first code); *default*: what the model "
        "now does: `S4DKernel.chunked_forward` (64-token chunks plus the free response of the chunk-start states; "
        "exact) in training, and in evaluation the memoised whole-length spectrum while it fits the 512 MiB memo; "
        "MH runs segmented for any length (`TokenContextStates.segmented_context`: the chunked SSM output, lift, "
        f"norm and K/V projection {MH_SEGMENT_LEN} tokens at a time, no (L, H, D_s) or (L, H, D) tensor); "
        "*unsegmented* (MH only): the chunked SSM output of the whole sequence, then the lift (the previous MH code).",
        "",
    ]
    keys = list(layers["eval"][str(lengths[0])])
    lines += ["| pass | L | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for mode in ("eval", "train"):
        for n in lengths:
            r = layers[mode][str(n)]
            cells = " | ".join(f"{r[k]:.0f}" for k in keys)
            lines.append(f"| {'forward' if mode == 'eval' else 'forward + backward'} | {n} | {cells} |")
    lines += [
        "",
        "Time ratios to Slide (the *default* path) against the executed matmul + "
        "attention FLOP ratio (`torch.utils.flop_counter`, FFTs and elementwise work not counted: on one thread "
        "every contender runs its matmuls near the machine's peak, so the FLOP ratio is the floor of the time "
        "ratio). Issue #15 target: SH time ratio within 1.05x of its FLOP ratio.",
        "",
        "| L | contender | GFLOP (forward) | FLOP ratio | forward time ratio | train time ratio | time / FLOP ratio "
        "(forward) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in lengths:
        g = layers["gflop"][str(n)]
        for name in g:
            if name == "Slide" or "Slide" not in g:
                continue
            key = f"{name}/default"
            if key not in layers["eval"][str(n)]:  # --paths without default: no ratio to state
                continue
            fr = g[name] / g["Slide"]
            te = layers["eval"][str(n)][key] / layers["eval"][str(n)]["Slide"]
            tt = layers["train"][str(n)][key] / layers["train"][str(n)]["Slide"]
            lines.append(f"| {n} | {name} | {g[name]:.1f} | {fr:.2f}x | {te:.2f}x | {tt:.2f}x | {te / fr:.2f} |")
    ctx = sorted(int(k) for k in next(iter(dec.values())))
    lines += [
        "",
        "Unstruct decoding, ~60M model of the decode benchmark (hidden 512, 8 layers, 3 BST layers, filters of "
        f"{max(ctx) + 64} taps), ms per token: mean of {meta.get('decode_steps', '?')} steps after a prefill (chunk "
        "starts included), smallest of the rounds. *direct*: one dot product of the whole history with the taps per "
        f"token (the previous code); *chunked*: the model's decoding in chunks of M = {meta.get('decode_chunk', '?')} "
        "steps (one FFT convolution per chunk, then a dot product over <= M recent inputs). Issue #15 target: 64k "
        "within 1.2x of 1k.",
        "",
        "| context | " + " | ".join(str(c) for c in ctx) + f" | {max(ctx)} / {min(ctx)} |",
        "|---|" + "---|" * (len(ctx) + 1),
    ]
    for path in dec:
        vals = [dec[path][str(c)] for c in ctx]
        lines.append(f"| {path} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {vals[-1] / vals[0]:.2f} |")
    lines += ["", "![SSM scaling](benchmarks/ssm_scaling.png)"]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--steps", type=positive_int, default=2 * ssm_bst.UNSTRUCT_DECODE_CHUNK, help="decode steps per context (mean)"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["layers", "decode"],
        default=["layers", "decode"],
        help="what to measure; a part not measured is kept from the saved docs/benchmarks/ssm_scaling.json",
    )
    names = LAYERS + ["BST:SH:S4 D_s=D/4"]
    parser.add_argument("--layers", nargs="+", choices=names, default=names, help="layer contenders")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=["whole", "unsegmented", "default"],
        default=["whole", "unsegmented", "default"],
        help="SSM paths of the BST layers (unsegmented: only where the default is the segmented one, MH)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--render", type=existing_file, default=None, help="re-render the plot and section from a saved JSON"
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before anything is built or timed (a part left out must have saved results)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    saved = OUT / "ssm_scaling.json"
    if not args.render:
        old = json.loads(saved.read_text()) if saved.exists() else {}
        missing = [p for p in ("layers", "decode") if p not in args.parts and p not in old]
        if missing:
            parser.error(f"--parts leaves out {missing} but {saved} has no saved results for it")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        plot(results, OUT / "ssm_scaling.png")
        write_section("ssm_scaling", markdown(results))
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tune_malloc()
    meta = dict(
        cpu=cpu_name(),
        torch=torch.__version__,
        rounds=args.rounds,
        loadavg_before=os.getloadavg()[0],
        command="python -m benchmarks.ssm_scaling " + " ".join(sys.argv[1:]),
    )
    t0 = time.perf_counter()
    saved = OUT / "ssm_scaling.json"
    old = json.loads(saved.read_text()) if saved.exists() else {}
    results = {"meta": meta}
    with RowLog(saved, meta) as log:
        for part in ("layers", "decode"):
            if part not in args.parts:
                results[part] = old[part]
                meta[f"{part}_from"] = old["meta"].get("command", "an earlier run")
                if part == "decode":  # the kept part's settings, for its table text
                    meta.update({k: old["meta"][k] for k in ("decode_steps", "decode_chunk") if k in old["meta"]})
            elif part == "layers":
                results[part] = layer_ab(args.lengths, args.rounds, args.layers, args.paths, on_row=log.add)
            else:
                meta.update(decode_steps=args.steps, decode_chunk=ssm_bst.UNSTRUCT_DECODE_CHUNK)
                results[part] = decode_ab(args.contexts, args.steps, args.rounds, on_row=log.add)
        meta["loadavg_after"] = os.getloadavg()[0]
        meta["seconds"] = round(time.perf_counter() - t0)
        text = markdown(results)
        print("\n".join(text))
        if not args.no_write:
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / "ssm_scaling.json").write_text(json.dumps(results, indent=1))
            plot(results, OUT / "ssm_scaling.png")
            write_section("ssm_scaling", text)
        log.done()


if __name__ == "__main__":
    main()
