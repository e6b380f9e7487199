"""The GPU suite (issue #15): one command that, on one NVIDIA GPU, runs the ``gpu`` tests and the GPU benchmarks and
writes one JSON and a markdown summary.

    bash benchmarks/gpu_suite.sh OUTDIR              # = python -m benchmarks.gpu_suite OUTDIR
    bash benchmarks/gpu_suite.sh OUTDIR --dry-run    # every part with tiny sizes on the CPU (about a minute)

Parts, each in its own process with its own time budget (seconds; ``--budget PART=S`` changes one), killed
``GRACE`` seconds after it; a part writes its results after every measurement, so a killed part keeps what it
measured, and within a part a measurement whose estimated time exceeds what is left is skipped and recorded; each
finished part's entry is appended to OUTDIR/gpu_suite.partial.jsonl at once (benchmarks/bench_common.py's ``RowLog``,
removed when gpu_suite.json is written), so a suite stopped midway keeps the parts it finished:

* ``tests`` (120 s): ``pytest -m gpu tests/models/bst/test_gpu.py`` (every model family on CUDA vs CPU float64, step ==
  parallel, generate, FFT in fp32 under bf16 autocast, no host-device sync in an S4 decode step);
* ``layer_speed`` (150 s): paper Fig. 3 (left), one layer forward, D = 512, W = 128, N = 16, 16 heads, batch 1,
  Slide / BST:SH,MH,MF:S4 / BST:SH:unstruct / BRecT at L = 1k..65k, bf16 autocast then fp32
  (benchmarks/layer_speed.py's ``time_length`` with ``device="cuda"``), executed GFLOP at L = 4096;
* ``train`` (150 s; the GPU sitting gives it 240 s and runs it first): BST:SH:S4, Slide and HF Llama (SDPA; and
  flash-attention-2 in eager bf16 where ``flash_attn`` is installed) of the ~60M preset trained in one process and
  mode per row, the most important rows first: L = 4096 batch 1 eager, then compiled (``torch.compile(model)``,
  default mode, a fresh compile per row; its first step, the compile, not timed and recorded), then L = 16384 eager
  and compiled, then batch 8, then ~200M at L = 16384; bf16 autocast, fused AdamW on CUDA
  (benchmarks/train_throughput.py's ``measure``). Per row: tokens/s (batch x L / the best step), MFU (useful FLOPs /
  the GPU's measured bf16 matmul rate), and from two steps under torch.profiler the device events (kernels, copies)
  per step and the GPU busy fraction: the union of those events' intervals per step / the best unprofiled step. A
  row estimated beyond the time left is skipped and recorded (later rows that fit still run); a contender whose
  compile fails, or that runs out of memory, is an error row. With ``--profile``, then two steps of BST:SH:S4 and of
  Llama (~60M, L = 4096, bf16) under torch.profiler: the top ops by device self time go into the report, the
  profiler's tables to OUTDIR/train_profile_<kind>.txt (``python -m benchmarks.train_ops`` counts the ops behind
  these step times);
* ``decode`` (120 s): decode ms per step after a prefill of 1k..64k tokens, hidden 512, 8 layers, batch 1 and
  batch 8 (``batch`` rows; ``tokens_per_s`` = batch / step time): BST S4 and unstruct (BSTCache), HF Llama with
  DynamicCache and StaticCache, eager; then BST S4 and Llama StaticCache with ``torch.compile(mode="reduce-overhead")``
  (CUDA graphs), checked against eager logits, batch 1 then batch 8; each compiled model's ``cudagraph_skips`` (must
  be 0: every step replayed as a CUDA graph) and ``cudagraphs_ok`` are recorded; where compiling fails, the error is
  recorded and the eager numbers stand (benchmarks/generation_speed.py's ``measure``; ``measure_batch`` for batches).

The budgets add up to 540 s, so the suite ends within 10 minutes on an H100 with the processes' start-up. The
summary states the paper's GPU targets (BST:SH < 2x Slide at L = 4k; BRecT 6-11x slower than BST:SH) next to the
measured ratios and their executed-FLOP bounds. ``--dry-run`` runs the same parts and writes the same structure
with tiny sizes on the CPU (tests/benchmarks/test_gpu_suite.py runs it in the default suite).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.bench_common import RowLog, positive_float, write_json_atomic  # noqa: E402
from benchmarks.docs_section import clock  # noqa: E402
from reporting import device_name  # noqa: E402


SCHEMA = "bst-gpu-suite/1"
PARTS = ("tests", "layer_speed", "train", "decode")
BUDGETS = {"tests": 120, "layer_speed": 150, "train": 150, "decode": 120}
GRACE = 20  # seconds a part may overrun its budget before it is killed
LAYER_CONTENDERS = ["Slide", "BST:SH:S4", "BST:MH:S4", "BST:MF:S4", "BST:SH:unstruct", "BRecT"]


def layer_contenders(device: str) -> list[str]:
    return list(LAYER_CONTENDERS)


PLANS = {
    "full": dict(
        device="cuda",
        tests=["tests/models/bst/test_gpu.py"],
        layer_speed=dict(
            lengths=[1024, 2048, 4096, 8192, 16384, 32768, 65536], dtypes=["bf16", "fp32"], rounds=5, hidden=512
        ),
        flop_length=4096,
        # (size, L, batch, mode), the most important first: the budget skips the tail (issue #44, item 4)
        train=dict(
            rows=[
                ("60m", 4096, 1, "eager"),
                ("60m", 4096, 1, "compiled"),
                ("60m", 16384, 1, "eager"),
                ("60m", 16384, 1, "compiled"),
                ("60m", 4096, 8, "eager"),
                ("60m", 4096, 8, "compiled"),
                ("60m", 16384, 8, "eager"),
                ("60m", 16384, 8, "compiled"),
                ("200m", 16384, 1, "eager"),
            ],
            dtypes=["bf16"],
            compile="default",  # torch.compile(model): inductor, no CUDA graphs
            compile_estimate_s=150,  # the first compiled row: three cold compiles of a 60m model (~40-60 s each)
            rounds=2,
            steps=2,
            busy_steps=2,
            peak_size=8192,
        ),
        profile=dict(size="60m", seq_len=4096, dtype="bf16", kinds=["bst", "llama"], steps=2),
        decode=dict(
            hidden=512,
            layers=8,
            contexts=[1024, 4096, 16384, 65536],
            compiled_contexts=[1024, 4096, 16384, 65536],
            batches=[1, 8],
            steps=20,
            compile="reduce-overhead",
        ),
    ),
    "dry": dict(
        device="cpu",
        tests=["tests/models/bst/test_gpu.py"],
        # One block (W = 128), one timed round, layers of width 64 (2 heads): at the paper's D = 512 the same code
        # only builds and runs ~2x longer.
        layer_speed=dict(lengths=[128], dtypes=["fp32", "bf16"], rounds=1, hidden=64),
        flop_length=128,
        # dynamo with the eager backend for the compiled row: no inductor build (minutes on a CPU)
        train=dict(
            rows=[("tiny", 128, 1, "eager"), ("tiny", 128, 1, "compiled"), ("tiny", 128, 2, "eager")],
            dtypes=["fp32"],
            compile="eager",
            compile_estimate_s=30,
            rounds=1,
            steps=1,
            busy_steps=1,
            peak_size=256,
        ),
        profile=dict(size="tiny", seq_len=128, dtype="fp32", kinds=["bst", "llama"], steps=1),
        decode=dict(
            hidden=64,
            layers=1,  # one BST layer: dynamo's trace of the compiled step is most of this part's time on a CPU
            contexts=[64, 128],
            compiled_contexts=[64],
            batches=[1, 2],
            compiled_batches=[1],  # each batch size is a graph of its own: dynamo's time, not the test's point
            steps=2,
            compile="eager",
        ),
    ),
}
PAPER = {"sh_slide_max": 2.0, "brect_sh": (6.0, 11.0)}


# -- budgets and partial results ---------------------------------------------------------------------------------------
class Part:
    """A part's results file, rewritten after every measurement, and its time budget."""

    def __init__(self, path: Path, budget_s: float):
        self.path, self.budget_s, self.start = path, budget_s, time.perf_counter()
        self.data = {"rows": [], "skipped": [], "errors": []}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def fits(self, what: str, estimate_s: float) -> bool:
        """Whether ``estimate_s`` fits in what is left; if not, ``what`` is recorded as skipped."""
        if estimate_s <= self.left():
            return True
        self.data["skipped"].append(f"{what}: estimated {estimate_s:.0f} s > {max(self.left(), 0):.0f} s left")
        self.save()
        return False

    def save(self):
        write_json_atomic(self.path, self.data)


def empty_device_cache(device: str):
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# -- parts -------------------------------------------------------------------------------------------------------------
def part_layer_speed(part: Part, plan: dict):
    from benchmarks import layer_speed as ls

    device, cfg = plan["device"], plan["layer_speed"]
    contenders = layer_contenders(device)
    hidden = cfg["hidden"]
    part.data.update(
        results={}, contenders=contenders, setup=dict(hidden=hidden, block_len=ls.W, heads=hidden // ls.HEAD_DIM)
    )
    for dtype in cfg["dtypes"]:
        last = None  # (length, seconds) of the previous length
        for seq_len in cfg["lengths"]:
            estimate = 0.0 if last is None else last[1] * 2.5 * seq_len / last[0]  # FFT and BRecT loop: ~linear
            if not part.fits(f"layer speed {dtype} L={seq_len}", estimate):
                break
            start = time.perf_counter()
            entries = ls.time_length(
                contenders,
                seq_len,
                dtype,
                cfg["rounds"],
                budget_s=max(part.left() / 4, 1.0),
                recurrent_states=512,
                count_flops=dtype == cfg["dtypes"][0] and seq_len == plan["flop_length"],
                device=device,
                hidden=hidden,
            )
            last = (seq_len, time.perf_counter() - start)
            part.data["results"].setdefault(dtype, {})[str(seq_len)] = entries
            part.save()
            print(f"layer {dtype} L={seq_len}: {last[1]:.1f} s", flush=True)


def size_cost(size: str) -> float:
    """Relative cost per token of a train_throughput preset (hidden^2 x layers), for the budget's estimates."""
    from benchmarks import train_throughput as tt

    shape = tt.SIZES[size]
    return shape["hidden"] ** 2 * shape["layers"]


def part_train(part: Part, plan: dict):
    """BST:SH:S4, Slide and HF Llama (sdpa; flash-attention-2 too in eager bf16 where installed) trained in one
    process and mode per row of ``plan["train"]["rows"]`` (size, L, batch, eager or compiled), in that order: tokens/s,
    MFU, and on a GPU kernels per step and GPU busy fraction ([`train_throughput.device_busy`]). Fused AdamW on CUDA.
    A row whose estimated time (from the last row of the same mode: its fixed part, the compiles, plus its timed
    steps scaled by tokens x size) does not fit what is left is skipped and recorded; a contender that fails to
    compile or runs out of memory is an error row."""
    from benchmarks import train_throughput as tt

    device, cfg = plan["device"], plan["train"]
    peaks = {
        "fp32": tt.matmul_peak(torch.float32, size=cfg["peak_size"], device=device),
        "bf16": tt.matmul_peak(torch.bfloat16, size=cfg["peak_size"], device=device),
    }
    part.data.update(peaks=peaks, flash_attn=tt.has_flash(), compile=cfg["compile"])
    history = {}  # mode -> (fixed seconds, timed-step seconds, tokens x cost) of the last row in that mode
    for size, seq_len, batch, mode in cfg["rows"]:
        for dtype in cfg["dtypes"]:
            flash = ["llama-flash"] if dtype == "bf16" and mode == "eager" and tt.has_flash() else []
            kinds = ["llama", "bst", "slide"] + flash
            work = batch * seq_len * size_cost(size)
            if mode in history:
                fixed, variable, work0 = history[mode]
                estimate = fixed + 1.3 * variable * work / work0
            else:
                estimate = cfg["compile_estimate_s"] if mode == "compiled" else 0.0
            what = f"train {size} L={seq_len} batch {batch} {mode} {dtype}"
            if not part.fits(what, estimate):
                continue
            if mode == "compiled":
                torch._dynamo.reset()  # a fresh, static-shape compile for every row
            start = time.perf_counter()
            try:
                rows = tt.measure(
                    kinds,
                    seq_len,
                    dtype,
                    cfg["rounds"],
                    cfg["steps"],
                    peaks,
                    device,
                    size,
                    batch=batch,
                    compile=cfg["compile"] if mode == "compiled" else None,
                    busy_steps=cfg["busy_steps"],
                    errors_as_rows=True,
                )
            except Exception as exc:  # out of memory in a timed step, or any failure: the row's error, not the end
                part.data["errors"].append(f"{what}: {type(exc).__name__}: {str(exc).strip()[:200]}")
                rows = []
            seconds = time.perf_counter() - start
            timed = sum(sum(r.get("step_times_s", [])) for r in rows)
            per_row_steps = cfg["rounds"] * cfg["steps"] + cfg["busy_steps"]
            variable = sum(min(r["step_times_s"]) for r in rows if r.get("step_times_s")) * per_row_steps
            history[mode] = (max(seconds - timed, 0.0), variable, work)
            for row in rows:
                row.update(size=size, seq_len=seq_len)
                row.pop("step_times_s", None)
                if "error" in row:
                    part.data["errors"].append(f"{what} {row['model']}: {row['error']}")
            part.data["rows"] += rows
            part.save()
            empty_device_cache(device)
            print(f"{what}: {seconds:.1f} s", flush=True)
    if plan.get("profile_train"):
        profile_train(part, plan)


def top_ops(prof, device: str, limit: int = 15) -> list[dict]:
    """The ops/kernels with the most self time on the device (the CPU for a CPU run), from a torch.profiler run."""
    cuda = torch.device(device).type == "cuda"
    rows = []
    for e in prof.key_averages():
        self_us = getattr(e, "self_device_time_total", None) if cuda else e.self_cpu_time_total
        if self_us is None:
            self_us = getattr(e, "self_cuda_time_total", 0)
        if self_us > 0:
            rows.append(dict(name=e.key[:120], calls=e.count, self_ms=self_us / 1000))
    rows.sort(key=lambda r: -r["self_ms"])
    total = sum(r["self_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["self_ms"] / total
    return rows[:limit]


def profile_train(part: Part, plan: dict):
    """A few training steps of each of ``plan["profile"]["kinds"]`` under torch.profiler (the sitting before missed
    the MFU target with no profile): the top ops by device self time go into the part's data, the profiler's own
    table to ``train_profile_<kind>.txt`` beside the part's result."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import train_throughput as tt

    device, cfg = plan["device"], plan["profile"]
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    part.data["profile"] = {}
    for kind in cfg["kinds"]:
        what = f"profile train {cfg['size']} L={cfg['seq_len']} {kind}"
        if not part.fits(what, 30.0 if cuda else 5.0):
            continue
        try:
            contender = tt.Contender(kind, cfg["seq_len"], dtype, device, cfg["size"])
            with profile(activities=activities) as prof:
                for _ in range(cfg["steps"]):
                    contender.step()
            sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=40)
            path = part.path.with_name(f"train_profile_{kind}.txt")
            path.write_text(f"{what}, {cfg['steps']} step(s), {device_name(device)}\n{table}\n")
            part.data["profile"][kind] = dict(
                setup=what, steps=cfg["steps"], step_s=min(contender.times), top=top_ops(prof, device), table=path.name
            )
            del contender, prof
        except Exception as exc:  # a profile that fails is a note, not the end of the part
            part.data["errors"].append(f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
        part.save()
        empty_device_cache(device)


def part_decode(part: Part, plan: dict):
    from benchmarks import generation_speed as gs

    device, cfg = plan["device"], plan["decode"]
    batches = cfg.get("batches", [1])
    kinds = ["bst-s4", "bst-unstruct", "llama-dynamic", "llama-static"]
    max_context = max(cfg["contexts"])
    models = {k: gs.build(k, cfg["hidden"], cfg["layers"], max_context).to(device) for k in kinds}
    part.data.update(
        hidden=cfg["hidden"],
        layers=cfg["layers"],
        compile_mode=cfg["compile"],
        compiled_contexts=cfg["compiled_contexts"],
        batches=batches,
        compiled={},
    )
    last = None
    for context in cfg["contexts"]:
        estimate = 0.0 if last is None else last[1] * 1.5 * context / last[0]
        if not part.fits(f"decode eager context {context}", estimate):
            break
        start = time.perf_counter()
        for batch in batches:
            for kind in kinds:
                ms, nbytes = measure_batch(kind, models[kind], context, cfg["steps"], device, batch)
                part.data["rows"].append(decode_row(kind, "eager", context, batch, ms, nbytes))
                part.save()
        last = (context, time.perf_counter() - start)
        print(f"decode eager {context}: {last[1]:.1f} s", flush=True)
        empty_device_cache(device)
    # Compiled steps, after every eager number is in (a compile can be slow): reduce-overhead = CUDA graphs.
    from torch._dynamo.utils import counters

    for kind in ("bst-s4", "llama-static"):
        record = part.data["compiled"].setdefault(kind, {})
        counters.clear()
        try:
            step_model = gs.compile_step(models[kind], cfg["compile"])
            start = time.perf_counter()
            record["max_abs_logit_diff_vs_eager"] = gs.compiled_max_diff(kind, models[kind], step_model, device)
            record["first_check_s"] = time.perf_counter() - start
            part.save()
            for batch in cfg.get("compiled_batches", batches):  # batch 1 first, then batched (a new graph)
                for context in cfg["compiled_contexts"]:
                    what = f"decode compiled {kind} batch {batch} context {context}"
                    if not part.fits(what, 2 * record["first_check_s"]):
                        break
                    ms, nbytes = measure_batch(kind, models[kind], context, cfg["steps"], device, batch, step_model)
                    part.data["rows"].append(decode_row(kind, "compiled", context, batch, ms, nbytes))
                    part.save()
        except Exception as exc:  # a compile failure is a result: recorded, the eager numbers stand
            record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        record["counters"] = gs.compile_counters()
        # CUDA graphs replayed on every step: inductor skipped none (reduce-overhead on a GPU; else not applicable)
        graphs = cfg["compile"] == "reduce-overhead" and torch.device(device).type == "cuda"
        record["cudagraph_skips"] = record["counters"].get("cudagraph_skips", 0)
        record["cudagraphs_ok"] = (record["cudagraph_skips"] == 0 and "error" not in record) if graphs else None
        part.save()
        torch._dynamo.reset()


def decode_row(kind: str, mode: str, context: int, batch: int, ms: float, nbytes: int) -> dict:
    return dict(
        model=kind,
        mode=mode,
        context=context,
        batch=batch,
        ms_per_token=ms,
        tokens_per_s=batch * 1000 / ms,
        cache_bytes=nbytes,
    )


@torch.no_grad()
def measure_batch(kind: str, model, context: int, steps: int, device: str, batch: int = 1, step_model=None):
    """generation_speed's ``measure`` (batch 1: that function itself) for ``batch`` rows: best ms per decode step
    (one token for each of the rows) after a prefill of ``context`` tokens, and the cache's bytes."""
    from benchmarks import generation_speed as gs

    if batch == 1:
        return gs.measure(kind, model, context, steps, device, step_model=step_model)
    step_model = model if step_model is None else step_model
    ids = torch.randint(0, gs.VOCAB, (batch, context), device=device)
    token = torch.randint(0, gs.VOCAB, (batch, 1), device=device)
    if kind == "llama-static":
        cache = gs.StaticCache(config=model.config, max_cache_len=context + steps + 8)
    else:
        cache = gs.DynamicCache(config=model.config) if kind == "llama-dynamic" else None
    out = model(ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
    cache, best = out.past_key_values, float("inf")
    for i in range(steps + 2):
        extra = (
            {"position_ids": torch.full((batch, 1), context + i, device=device)} if kind.startswith("llama") else {}
        )
        start = clock(device)
        out = step_model(token, use_cache=True, **extra, past_key_values=cache)
        cache = out.past_key_values
        if i >= 2:
            best = min(best, clock(device) - start)
    return best * 1000, gs.tensor_bytes(cache)


def run_part(name: str, budget_s: float, result: Path, dry_run: bool, profile: bool = False):
    """Entry point of a part's own process."""
    plan = dict(PLANS["dry" if dry_run else "full"], profile_train=profile)
    torch.manual_seed(0)
    if plan["device"] == "cpu":
        torch.set_num_threads(1)
    part = Part(result, budget_s)
    part.save()
    {"layer_speed": part_layer_speed, "train": part_train, "decode": part_decode}[name](part, plan)
    part.data["complete"] = True
    part.save()


# -- orchestration -----------------------------------------------------------------------------------------------------
def junit_summary(path: Path) -> dict:
    """Counts and failures from pytest's junit XML."""
    if not path.exists():
        return {"error": "no junit report written"}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed, skip_reasons = [], {}
    for case in suite.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failed.append(f"{case.get('name')}: {(node.get('message') or '').splitlines()[0][:200]}")
        node = case.find("skipped")
        if node is not None:
            reason = node.get("message") or ""
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
    return dict(counts, failed=failed, skip_reasons=skip_reasons)


def launch(cmd, timeout_s: float, log: Path) -> tuple[str, float]:
    """Run ``cmd`` with its output in ``log``; ``(status, seconds)`` with status ok / failed (rc N) / timed out."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"timed out after {timeout_s:.0f} s (partial results kept)", time.perf_counter() - start
    return ("ok" if rc == 0 else f"failed (rc {rc})"), time.perf_counter() - start


def log_tail(log: Path, lines: int = 15) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []


def run_suite(outdir: Path, dry_run: bool, budgets: dict, parts, profile: bool = False) -> dict:
    outdir.mkdir(parents=True, exist_ok=True)
    plan = PLANS["dry" if dry_run else "full"]
    if plan["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU")
    meta = dict(
        device=device_name(plan["device"]),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        python=platform.python_version(),
        model_code=subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "unknown",
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command="bash benchmarks/gpu_suite.sh " + " ".join(sys.argv[1:]),
    )
    report = {"schema": SCHEMA, "dry_run": dry_run, "meta": meta, "budget_s": budgets, "parts": {}}
    # Each part's entry goes to OUTDIR/gpu_suite.partial.jsonl as soon as the part ends: a suite killed midway keeps
    # the parts it finished.
    with RowLog(outdir / "gpu_suite.json", meta) as log:
        run_parts(report, outdir, dry_run, budgets, parts, log, profile)
        log.done()
    return report


def run_parts(report: dict, outdir: Path, dry_run: bool, budgets: dict, parts, log: RowLog, profile: bool = False):
    plan = PLANS["dry" if dry_run else "full"]
    suite_start = time.perf_counter()
    for name in PARTS:
        entry = report["parts"][name] = {"budget_s": budgets[name]}
        if name not in parts:
            entry.update(status="skipped (not selected)", seconds=0.0)
            continue
        part_log = outdir / f"{name}.log"
        if name == "tests":
            xml = outdir / "gpu_tests.xml"
            cmd = [sys.executable, "-m", "pytest", *plan["tests"], "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
            status, seconds = launch([*cmd, f"--junitxml={xml}"], budgets[name] + GRACE, part_log)
            data = junit_summary(xml)
            if status == "failed (rc 1)":  # pytest's "some tests failed": the tests ran, their results are data
                status = "ok"
        else:
            result = outdir / f"{name}.json"
            cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--part", name, "--budget", str(budgets[name])]
            cmd += ["--result", str(result)] + (["--dry-run"] if dry_run else [])
            cmd += ["--profile"] if profile and name == "train" else []
            status, seconds = launch(cmd, budgets[name] + GRACE, part_log)
            data = json.loads(result.read_text()) if result.exists() else {}
            result.unlink(missing_ok=True)
        entry.update(status=status, seconds=round(seconds, 1), data=data)
        if status != "ok":
            entry["log_tail"] = log_tail(part_log)
        log.add({"part": name, **entry})
        print(f"[gpu_suite] {name}: {status} in {seconds:.0f} s", flush=True)
    report["seconds"] = round(time.perf_counter() - suite_start, 1)
    report["targets"] = targets(report)
    (outdir / "gpu_suite.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (outdir / "gpu_suite.md").write_text("\n".join(markdown(report)) + "\n")


# -- summary -----------------------------------------------------------------------------------------------------------
def fmt(v, spec="{:.2f}"):
    return spec.format(v) if isinstance(v, (int, float)) else "n/a"


def layer_ratio(results: dict, dtype: str, num: str, den: str, key="min_ms", seq_len: str = "4096"):
    cells = results.get(dtype, {}).get(seq_len, {})
    a, b = cells.get(num, {}).get(key), cells.get(den, {}).get(key)
    return a / b if a is not None and b else None


def targets(report: dict) -> list[dict]:
    """The paper's GPU targets at L = 4096 (the dry run's length when dry), with measured value and FLOP bound."""
    data = report["parts"].get("layer_speed", {}).get("data") or {}
    results = data.get("results", {})
    seq_len = str(PLANS["dry" if report["dry_run"] else "full"]["flop_length"])
    flops = {"f": {seq_len: next((per[seq_len] for per in results.values() if seq_len in per), {})}}
    (lo, hi), sh_max = PAPER["brect_sh"], PAPER["sh_slide_max"]
    checks = [
        (f"BST:SH:S4 / Slide < {sh_max:g}x", "BST:SH:S4", "Slide", lambda r: r < sh_max),
        (f"BRecT / BST:SH:S4 in {lo:g}-{hi:g}x (paper: BRecT slower)", "BRecT", "BST:SH:S4", lambda r: lo <= r <= hi),
    ]
    out = []
    for dtype in results:
        for label, num, den, met in checks:
            measured = layer_ratio(results, dtype, num, den, seq_len=seq_len)
            out.append(
                dict(
                    target=label,
                    dtype=dtype,
                    length=int(seq_len),
                    measured=measured,
                    flop_bound=layer_ratio(flops, "f", num, den, "gflop", seq_len),
                    met=None if measured is None else met(measured),
                )
            )
    return out


def markdown(report: dict) -> list[str]:
    from benchmarks import layer_speed as ls

    meta, parts = report["meta"], report["parts"]
    kind = "DRY RUN (CPU, tiny sizes: the numbers mean nothing)" if report["dry_run"] else "GPU run"
    lines = [
        f"# BST GPU suite: {kind}",
        "",
        "## Machine",
        "",
        f"{meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']}), transformers {meta['transformers']}, Python "
        f"{meta['python']}; model code {meta['model_code']}; started {meta['started']}; {report['seconds']:.0f} s in "
        f"all. Command: `{meta['command']}`.",
        "",
        "| part | status | seconds | budget (s) |",
        "|---|---|---|---|",
        *(f"| {n} | {p['status']} | {fmt(p.get('seconds'), '{:.0f}')} | {p['budget_s']} |" for n, p in parts.items()),
        "",
        "## Paper targets",
        "",
        "Paper (GPU, Fig. 3 setup): BST:SH < 2x Slide at L = 4k; BRecT 6-11x slower than BST:SH. Measured: ratio of "
        "minimum forward times in one run (contenders alternated); bound: ratio of executed matmul + attention FLOPs "
        "(`torch.utils.flop_counter`), the time ratio if both ran at the same FLOP rate.",
        "",
        "| target | dtype | L | measured | FLOP bound | met |",
        "|---|---|---|---|---|---|",
        *(
            f"| {t['target']} | {t['dtype']} | {t['length']} | {fmt(t['measured'], '{:.2f}x')} | "
            f"{fmt(t['flop_bound'], '{:.2f}x')} | {'n/a' if t['met'] is None else ('yes' if t['met'] else 'no')} |"
            for t in report["targets"]
        ),
        "",
        "## gpu tests",
        "",
    ]
    tests = parts["tests"].get("data") or {}
    if "tests" in tests:
        lines.append(
            f"`pytest -m gpu`: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
            f"{tests['skipped']} skipped."
        )
        lines += [f"- FAILED {f}" for f in tests["failed"][:30]]
        lines += [f"- skipped ({n}): {r}" for r, n in tests["skip_reasons"].items()]
    else:
        lines.append(f"No test results: {tests.get('error', parts['tests']['status'])}.")
    layer = parts["layer_speed"].get("data") or {}
    lines += ["", "## Layer speed (paper Fig. 3 left)", ""]
    if layer.get("results"):
        names = layer["contenders"]
        lines += ["Milliseconds per one-layer forward (minimum over rounds), batch 1:", ""]
        lines += ls.table_rows(layer["results"], names)
        lines += ["", "Executed GFLOP per forward:", "", *ls.flop_rows(layer["results"], names)]
    else:
        lines.append("No results.")
    train = parts["train"].get("data") or {}
    lines += ["", "## Training throughput", ""]
    if train.get("rows"):
        lines += [
            f"`batch` sequences of L tokens per step (forward, backward, AdamW; fused AdamW on CUDA), the contenders of "
            f"a row in one process and mode (eager, or compiled = `torch.compile(model)` with "
            f"`{train.get('compile', 'default')}`; its first step, the compile, not timed: `first step s`). MFU = useful "
            f"FLOPs/token x tokens/s / the measured bf16 matmul rate ({train['peaks']['bf16'] / 1e12:.1f} TFLOP/s; "
            f"fp32 {train['peaks']['fp32'] / 1e12:.1f}); GPU busy = the union of the device events' intervals "
            "(kernels, copies) per step in a short torch.profiler run / the best unprofiled step; kernels = device "
            f"events per step; flash-attention-2 installed: {train['flash_attn']}.",
            "",
            "| size | L | model | batch | mode | dtype | params | tokens/s | vs Llama (sdpa) | FLOP ratio Llama/model | "
            "MFU (bf16) | GPU busy | kernels/step | first step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in train["rows"]:
            head = f"| {r['size']} | {r['seq_len']} | {r['model']} | {r.get('batch', 1)} | {r.get('mode', 'eager')} | "
            if "error" in r:
                lines.append(head + f"{r['dtype']} | error: {r['error'][:120].replace('|', '/')} |" + " |" * 7)
                continue
            busy = r.get("gpu_busy")
            lines.append(
                head + f"{r['dtype']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_s']:.0f} | "
                f"{fmt(r['vs_llama'], '{:.2f}x')} | {fmt(r['flop_ratio'], '{:.2f}x')} | {100 * r['mfu_bf16']:.1f}% | "
                f"{fmt(None if busy is None else 100 * busy, '{:.0f}%')} | {fmt(r.get('kernels_per_step'), '{:.0f}')} | "
                f"{fmt(r.get('first_step_s'), '{:.1f}')} |"
            )
        for prof in (train.get("profile") or {}).values():
            lines += [
                "",
                f"Profile: {prof['setup']}, {prof['steps']} step(s) (`{prof['table']}`), top ops by self time:",
            ]
            lines += ["", "| op | calls | self ms | share |", "|---|---|---|---|"]
            lines += [
                f"| `{o['name'].replace('|', '/')}` | {o['calls']} | {o['self_ms']:.2f} | {100 * o['share']:.1f}% |"
                for o in prof["top"]
            ]
    else:
        lines.append("No results.")
    decode = parts["decode"].get("data") or {}
    lines += ["", "## Decode", ""]
    if decode.get("rows"):
        contexts = sorted({r["context"] for r in decode["rows"]})
        lines += [
            f"ms per decode step (one token for each of the batch's rows) after a prefill of N tokens (best of the "
            f"timed steps), hidden {decode['hidden']}, {decode['layers']} layers, fp32; compiled = "
            f'`torch.compile(mode="{decode["compile_mode"]}")` of the model for the steps.',
            "",
            "| model | mode | batch | " + " | ".join(f"N = {c}" for c in contexts) + " |",
            "|---|---|---|" + "---|" * len(contexts),
        ]
        table = {(r["model"], r["mode"], r.get("batch", 1), r["context"]): r["ms_per_token"] for r in decode["rows"]}
        for model, mode, batch in dict.fromkeys((r["model"], r["mode"], r.get("batch", 1)) for r in decode["rows"]):
            cells = [fmt(table.get((model, mode, batch, c)), "{:.2f}") for c in contexts]
            lines.append(f"| {model} | {mode} | {batch} | " + " | ".join(cells) + " |")
        for kind, rec in decode.get("compiled", {}).items():
            state = f"failed, eager numbers stand: {rec['error']}" if "error" in rec else "ran"
            graphs = rec.get("counters", {}).get("unique_graphs", 0)
            if graphs > 2 * len(decode.get("compiled_contexts", [])) + 2:
                state += f" but compiled {graphs} graphs (recompiles on every step: the compiled numbers include them)"
            graphs_ok = rec.get("cudagraphs_ok")
            if graphs_ok is not None:
                state += "; CUDA graphs: " + ("no skips" if graphs_ok else f"{rec.get('cudagraph_skips')} skip(s)")
            lines.append(
                f"- compiled {kind}: {state}; max |logit - eager| "
                f"{fmt(rec.get('max_abs_logit_diff_vs_eager'), '{:.1e}')}; counters {rec.get('counters', {})}"
            )
    else:
        lines.append("No results.")
    lines += ["", "## Skipped and errors", ""]
    notes = []
    for name, p in parts.items():
        data = p.get("data") or {}
        if name != "tests":  # the tests' "skipped" is pytest's count (their reasons are listed above)
            notes += [f"- {name}: skipped {s}" for s in data.get("skipped", [])]
            notes += [f"- {name}: {e}" for e in data.get("errors", [])]
        if p["status"] != "ok":
            notes.append(f"- {name}: {p['status']}" + (f"; log: {' / '.join(p.get('log_tail', [])[-3:])}"))
        for seq_len_entries in (data.get("results") or {}).values():
            for seq_len, entries in seq_len_entries.items():
                notes += [f"- {name} L={seq_len} {n}: {e['error']}" for n, e in entries.items() if "error" in e]
    lines += notes or ["None."]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("outdir", type=Path, nargs="?", help="where gpu_suite.json, gpu_suite.md and the logs go")
    parser.add_argument("--dry-run", action="store_true", help="every part with tiny sizes on the CPU")
    parser.add_argument("--budget", action="append", default=[], help="PART=SECONDS (repeatable); a part: SECONDS")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--part", choices=PARTS[1:], help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the train part's measurements, a few steps of BST and Llama under torch.profiler: the top ops go "
        "into the report, the profiler's tables to OUTDIR/train_profile_<kind>.txt",
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, every one checked before any part starts; ``args.budgets``: every part's budget in seconds."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.part:  # a part's own process: --budget SECONDS --result PATH
        if len(args.budget) != 1 or args.result is None:
            parser.error("--part takes one --budget SECONDS and --result PATH")
        try:
            args.budgets = {args.part: positive_float(args.budget[0])}
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--budget: {exc}")
        return args
    if args.outdir is None:
        parser.error("OUTDIR is required")
    budgets = dict(BUDGETS)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        try:
            if name not in budgets:
                raise argparse.ArgumentTypeError(f"PART {name!r} is not one of {', '.join(PARTS)}")
            budgets[name] = positive_float(seconds)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--budget takes PART=SECONDS with PART one of {', '.join(PARTS)}; got {item!r} ({exc})")
    args.budgets = budgets
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.part:
        run_part(args.part, args.budgets[args.part], args.result, args.dry_run, args.profile)
        return
    report = run_suite(args.outdir, args.dry_run, args.budgets, args.parts, args.profile)
    print(f"[gpu_suite] wrote {args.outdir / 'gpu_suite.json'} and {args.outdir / 'gpu_suite.md'}")
    print("\n".join(markdown(report)[:40]))


if __name__ == "__main__":
    main()
