"""torch.compile against eager on CPU: first-call (compile) time and steady-state speed, forward and training step.

    python -m benchmarks.compile_speed --configs training/presets/bst-tiny-sh-s4.json --lengths 512 --write-docs

For each model config and length: eager and ``torch.compile(model)`` (inductor) are timed in the same process,
alternating call by call, so that background load hits both alike. ``forward``: evaluation forward under
``no_grad``; ``train``: forward + backward of the LM loss in training mode. ``first call`` is the wall time of the
first compiled call (tracing + inductor + the run itself; later shapes compile again). The FFT convolution is a
custom op that inductor leaves as one opaque call (``--fft``: ``op``, the model's default; ``disable``: a graph
break around it with ``torch.compiler.disable``; ``inductor``: the pre-op code traced into the graph, the ~150 s
first call of issue #14). Inductor's caches are off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``): every first call
is a cold compile. Writes JSON (``--output``) and, with ``--write-docs``, the ``compile`` section of
docs/benchmarks.md.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path


# Cold compiles: inductor's on-disk caches would let a later contender reuse an earlier one's kernels.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch

from benchmarks.bench_common import RowLog, existing_file, positive_int
from benchmarks.docs_section import tune_malloc, write_section
from modeling_bst import BSTConfig, BSTForCausalLM, ssm_bst
from reporting import cpu_name


def _inductor_fft_conv(u, k_f):
    length = u.shape[-1]
    u_f = torch.fft.rfft(u, n=2 * length)
    return torch.fft.irfft(u_f.unsqueeze(1) * k_f.unsqueeze(0), n=2 * length)[..., :length]


FFT_VARIANTS = {
    "op": ssm_bst.fft_conv,
    "disable": torch.compiler.disable(ssm_bst.fft_conv),
    "inductor": _inductor_fft_conv,
}


def make_step(model, mode: str, x: torch.Tensor):
    if mode == "forward":

        def step():
            with torch.no_grad():
                return model(x, use_cache=False).logits

    else:

        def step():
            model.zero_grad(set_to_none=True)
            out = model(x, labels=x, use_cache=False)
            out.loss.backward()
            return out.logits.detach()

    return step


def run(config_path: str, length: int, mode: str, fft: str, repeats: int, seed: int = 0) -> dict:
    ssm_bst.fft_conv = FFT_VARIANTS[fft]
    torch._dynamo.reset()
    config = BSTConfig.from_json_file(config_path)
    torch.manual_seed(seed)
    model = BSTForCausalLM(config).train(mode == "train")
    x = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    eager = make_step(model, mode, x)
    compiled = make_step(torch.compile(model), mode, x)
    ref = eager()
    t0 = time.perf_counter()
    out = compiled()
    first = time.perf_counter() - t0
    max_diff = (out - ref).abs().max().item()
    times = {"eager": [], "compiled": []}
    for _ in range(repeats):  # alternating, eager first
        for name, fn in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    eager_s, compiled_s = min(times["eager"]), min(times["compiled"])
    return {
        "config": Path(config_path).stem,
        "parameters": sum(p.numel() for p in model.parameters()),
        "length": length,
        "mode": mode,
        "fft": fft,
        "first_call_s": first,
        "eager_s": eager_s,
        "compiled_s": compiled_s,
        "speedup": eager_s / compiled_s,
        "max_abs_diff": max_diff,
        "repeats": repeats,
    }


def write_docs(rows: list[dict], meta: dict):
    lines = [
        "## torch.compile (CPU)",
        "",
        f"`python -m benchmarks.compile_speed {meta['argv']}`: {meta['cpu']}, {meta['threads']} thread(s), "
        f"torch {meta['torch']}. Eager and `torch.compile(model)` timed in one process, alternating call by call "
        f"(best of {'/'.join(sorted({str(r['repeats']) for r in rows}))}); `first call` = tracing + inductor + that call. `forward`: evaluation "
        "forward under `no_grad`; `train`: forward + backward of the LM loss. `fft`: `op` = the FFT convolution as "
        "a custom op (the model's code), `disable` = a `torch.compiler.disable` graph break around it, `inductor` "
        "= the FFTs traced into the graph (the old behaviour). `max |diff|`: largest logit difference "
        "compiled vs eager.",
    ]
    if meta.get("note"):
        lines += ["", meta["note"]]
    lines += [
        "",
        "| config | L | mode | fft | first call (s) | eager (ms) | compiled (ms) | speed-up | max \\|diff\\| |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['length']} | {r['mode']} | {r['fft']} | {r['first_call_s']:.1f} | "
            f"{1e3 * r['eager_s']:.1f} | {1e3 * r['compiled_s']:.1f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |"
        )
    write_section("compile", lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", type=existing_file, default=["training/presets/bst-tiny-sh-s4.json"])
    p.add_argument("--lengths", nargs="+", type=positive_int, default=[512])
    p.add_argument("--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"])
    p.add_argument("--fft", nargs="+", default=["op", "disable"], choices=sorted(FFT_VARIANTS))
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--output", default="docs/benchmarks/compile_speed.json")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--note", default="", help="a line for the docs section (e.g. machine load)")
    p.add_argument(
        "--from-json",
        nargs="+",
        type=existing_file,
        default=None,
        help="write the docs section from earlier runs' JSON",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before anything is built or compiled (the configs are read here)."""
    p = build_parser()
    args = p.parse_args(argv)
    if not args.from_json:
        for path in args.configs:
            try:
                BSTConfig.from_json_file(path)
            except Exception as exc:  # a broken config fails now, not after the earlier configs' compiles
                p.error(f"--configs {path}: not a BST config ({type(exc).__name__}: {exc})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        runs = [json.loads(Path(f).read_text()) for f in args.from_json]
        meta = dict(runs[0]["meta"], argv=" ; ".join(r["meta"]["argv"] for r in runs), note=args.note)
        write_docs([row for r in runs for row in r["rows"]], meta)
        return None
    torch.set_num_threads(args.threads)
    tune_malloc()
    meta = {
        "argv": " ".join(sys.argv[1:]),
        "cpu": cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "note": args.note,
    }
    out = Path(args.output)
    with RowLog(out, meta) as log:
        for config in args.configs:
            for length in args.lengths:
                for mode in args.modes:
                    for fft in args.fft:
                        row = log.add(run(config, length, mode, fft, args.repeats))
                        print(
                            f"{row['config']:>16} L={length:<5} {mode:<7} fft={fft:<8} first {row['first_call_s']:7.1f} s"
                            f"  eager {1e3 * row['eager_s']:8.1f} ms  compiled {1e3 * row['compiled_s']:8.1f} ms"
                            f"  x{row['speedup']:.2f}  diff {row['max_abs_diff']:.1e}",
                            flush=True,
                        )
        rows = log.rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if args.write_docs:
            write_docs(rows, meta)
        log.done()
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
