"""`bash benchmarks/gpu_suite.sh OUTDIR --dry-run`: the GPU suite end to end on the CPU with tiny sizes (under a
minute on one core), checked for the JSON schema and the markdown sections the GPU run writes. The dry run here runs
the three measuring parts; its first part, the `gpu` tests, is the one part of the dry run of `scripts/gpu_sitting.sh`
in tests/benchmarks/test_gpu_sitting.py, which checks that part's report (run once, not twice)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_suite


ROOT = Path(__file__).resolve().parents[2]
MEASURED = ["layer_speed", "train", "decode"]  # every part but "tests"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), str(out), "--dry-run", "--parts", *MEASURED],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "gpu_suite.json").read_text()), (out / "gpu_suite.md").read_text()


def test_dry_run_json_schema(dry_run):
    _, report, _ = dry_run
    assert report["schema"] == gpu_suite.SCHEMA and report["dry_run"] is True
    assert set(report["meta"]) >= {"device", "torch", "transformers", "model_code", "command"}
    assert list(report["parts"]) == list(gpu_suite.PARTS) == ["tests", *MEASURED]
    assert report["parts"]["tests"] == {"budget_s": gpu_suite.BUDGETS["tests"], "status": "skipped (not selected)",
        "seconds": 0.0}  # fmt: skip
    for name in MEASURED:
        part = report["parts"][name]
        assert part["status"] == "ok", (name, part)
        assert 0 < part["seconds"] <= part["budget_s"] + gpu_suite.GRACE
    assert sum(report["budget_s"].values()) + 4 * 15 <= 600  # budgets + process start-up: within 10 minutes

    layer = report["parts"]["layer_speed"]["data"]
    assert layer["complete"] and set(layer["results"]) == {"fp32", "bf16"}
    for per_len in layer["results"].values():
        for entries in per_len.values():
            assert set(entries) == set(gpu_suite.LAYER_CONTENDERS)
            assert all(e["min_ms"] > 0 for e in entries.values()), entries
    assert all("gflop" in e for e in layer["results"]["fp32"]["128"].values())

    train = report["parts"]["train"]["data"]
    assert train["peaks"]["bf16"] > 0 and {r["model"] for r in train["rows"]} >= {"HF Llama (sdpa)", "BST:SH:S4"}
    # the plan's rows in order, each with the three contenders in one mode: eager, compiled (dynamo's eager backend in
    # the dry run), a larger batch; no errors
    assert [(r["mode"], r["batch"]) for r in train["rows"][::3]] == [
        ("eager", 1),
        ("compiled (eager)", 1),
        ("eager", 2),
    ]
    assert train["errors"] == [] and train["skipped"] == [] and train["compile"] == "eager"
    for row in train["rows"]:
        assert row["tokens_per_s"] > 0 and row["mfu_bf16"] > 0 and row["size"] == "tiny" and row["first_step_s"] > 0
        assert row["fused_adamw"] is False and "gpu_busy" not in row  # on a CPU: foreach AdamW, no device events
        if gpu_suite.torch.cuda.is_available():
            # On a CPU without native bf16 matmuls the bf16 "peak" is an emulated path slower than an fp32 model.
            assert row["mfu_bf16"] < 1

    decode = report["parts"]["decode"]["data"]
    modes = {(r["model"], r["mode"]) for r in decode["rows"]}
    assert modes >= {
        ("bst-s4", "eager"),
        ("llama-static", "eager"),
        ("bst-s4", "compiled"),
        ("llama-static", "compiled"),
    }
    for kind, record in decode["compiled"].items():
        assert "error" not in record and record["max_abs_logit_diff_vs_eager"] <= 1e-4, (kind, record)

    targets = report["targets"]
    assert len(targets) == 4 and all(t["measured"] > 0 and t["flop_bound"] > 1 for t in targets)


def test_dry_run_markdown_sections(dry_run):
    out, report, md = dry_run
    sections = [line for line in md.splitlines() if line.startswith("#")]
    assert sections == [
        "# BST GPU suite: DRY RUN (CPU, tiny sizes: the numbers mean nothing)",
        "## Machine",
        "## Paper targets",
        "## gpu tests",
        "## Layer speed (paper Fig. 3 left)",
        "## Training throughput",
        "## Decode",
        "## Skipped and errors",
    ]
    assert "BST:SH < 2x Slide at L = 4k; BRecT 6-11x slower than BST:SH" in md
    assert md.count("| BST:SH:S4 / Slide < 2x |") == 2 and "| tiny | 128 | BST:SH:S4 | 1 | eager | fp32 |" in md
    assert "| tiny | 128 | Slide | 1 | compiled (eager) | fp32 |" in md
    assert "| tests | skipped (not selected) | 0 |" in md and not (out / "gpu_tests.xml").exists()
    assert all((out / f"{name}.log").exists() for name in MEASURED)


def test_budget_skips_and_failures_are_recorded(tmp_path):
    part = gpu_suite.Part(tmp_path / "p.json", budget_s=5)
    assert part.fits("small", 1.0) and not part.fits("layer speed bf16 L=65536", 60.0)
    assert json.loads((tmp_path / "p.json").read_text())["skipped"] == [
        "layer speed bf16 L=65536: estimated 60 s > 5 s left"
    ]
    report = {
        "dry_run": False,
        "seconds": 600.0,
        "meta": dict(device="GPU", torch="t", cuda="c", transformers="x", python="p", model_code="m", started="s"),
        "parts": {
            "tests": {"status": "ok", "seconds": 1, "budget_s": 120, "data": {"error": "no junit report written"}},
            "layer_speed": {"status": "ok", "seconds": 1, "budget_s": 150, "data": {**part.data, "results": {}}},
            "train": {"status": "timed out after 170 s (partial results kept)", "seconds": 170, "budget_s": 150},
            "decode": {"status": "failed (rc 1)", "seconds": 3, "budget_s": 120, "log_tail": ["RuntimeError: boom"]},
        },
    }
    report["meta"]["command"] = "bash benchmarks/gpu_suite.sh out"
    report["targets"] = gpu_suite.targets(report)
    md = "\n".join(gpu_suite.markdown(report))
    assert report["targets"] == [] and "# BST GPU suite: GPU run" in md
    assert "- layer_speed: skipped layer speed bf16 L=65536: estimated 60 s > 5 s left" in md
    assert "- train: timed out after 170 s" in md and "RuntimeError: boom" in md


def test_train_profile_names_the_top_ops(tmp_path):
    """--profile: a training step of BST and Llama under torch.profiler; the top ops by self time go into the part's
    data (and the markdown), the profiler's tables beside the part's result (the sitting brings them back)."""
    part = gpu_suite.Part(tmp_path / "train.json", budget_s=300)
    gpu_suite.profile_train(part, gpu_suite.PLANS["dry"])
    profile = part.data["profile"]
    assert set(profile) == {"bst", "llama"} and part.data["errors"] == []
    for kind, prof in profile.items():
        assert prof["top"] and all(o["self_ms"] > 0 and 0 < o["share"] <= 1 for o in prof["top"])
        assert (tmp_path / prof["table"]).read_text().startswith(f"profile train tiny L=128 {kind}")
    report = {
        "dry_run": True,
        "seconds": 1.0,
        "meta": dict(device="cpu", torch="t", cuda=None, transformers="x", python="p", model_code="m", started="s"),
        "parts": {"train": {"status": "ok", "seconds": 1, "budget_s": 1, "data": {**part.data, "rows": []}}},
    }
    report["meta"]["command"] = "c"
    report["parts"].update({n: {"status": "ok", "seconds": 0, "budget_s": 0, "data": {}} for n in gpu_suite.PARTS})
    report["parts"]["train"]["data"] = dict(part.data, rows=[dict(size="tiny", seq_len=128, model="m", dtype="fp32",
        params=1e6, tokens_per_s=1.0, vs_llama=1.0, flop_ratio=1.0, mfu_bf16=0.1)], peaks={"bf16": 1e12, "fp32": 1e12},
        flash_attn=False)  # fmt: skip
    report["targets"] = []
    md = "\n".join(gpu_suite.markdown(report))
    assert "Profile: profile train tiny L=128 bst, 1 step(s)" in md and "| op | calls | self ms | share |" in md


def test_train_rows_in_plan_order_skip_what_does_not_fit_and_record_failed_compiles(tmp_path, monkeypatch):
    """The train part measures its plan's rows in order; a compiled row estimated beyond the time left is skipped and
    recorded, a later eager row that fits still runs; a contender whose compile fails is an error row beside the
    others' measured rows (not the end of the part)."""
    from benchmarks import train_throughput as tt

    real = tt.compiled

    def failing_for_bst(model, mode):
        if isinstance(model, tt.BSTForCausalLM) and model.config.bst_layer_indices:
            raise RuntimeError("inductor: complex codegen\nmore lines")
        return real(model, mode)

    monkeypatch.setattr(tt, "compiled", failing_for_bst)
    train = dict(gpu_suite.PLANS["dry"]["train"], compile_estimate_s=1e6, rows=[("tiny", 64, 1, "compiled"),
        ("tiny", 64, 1, "eager")])  # fmt: skip
    part = gpu_suite.Part(tmp_path / "train.json", budget_s=300)
    gpu_suite.part_train(part, dict(gpu_suite.PLANS["dry"], train=train))
    (skipped,) = part.data["skipped"]
    assert re.match(r"train tiny L=64 batch 1 compiled fp32: estimated 1000000 s > \d+ s left", skipped), skipped
    assert [r["mode"] for r in part.data["rows"]] == ["eager"] * 3

    train["compile_estimate_s"] = 1
    part = gpu_suite.Part(tmp_path / "train.json", budget_s=300)
    gpu_suite.part_train(part, dict(gpu_suite.PLANS["dry"], train=dict(train, rows=train["rows"][:1])))
    rows = {r["model"]: r for r in part.data["rows"]}
    assert rows["BST:SH:S4"]["error"] == "RuntimeError: inductor: complex codegen"
    assert rows["Slide"]["tokens_per_s"] > 0 and rows["HF Llama (sdpa)"]["vs_llama"] == 1
    assert part.data["errors"] == ["train tiny L=64 batch 1 compiled fp32 BST:SH:S4: RuntimeError: inductor: complex "
        "codegen"]  # fmt: skip
    report = {
        "dry_run": True,
        "seconds": 1.0,
        "targets": [],
        "meta": dict(device="cpu", torch="t", cuda=None, transformers="x", python="p", model_code="m", started="s"),
        "parts": {n: {"status": "ok", "seconds": 0, "budget_s": 0, "data": {}} for n in gpu_suite.PARTS},
    }
    report["meta"]["command"] = "c"
    report["parts"]["train"]["data"] = part.data
    md = "\n".join(gpu_suite.markdown(report))
    assert "| tiny | 64 | BST:SH:S4 | 1 | compiled (eager) | fp32 | error: RuntimeError: inductor" in md
