"""`bash scripts/gpu_sitting.sh` (issue #35, item 3): the plan (order, budgets, what the committed state file says is
done, what waits for the next sitting), flags refused before anything runs, and the dry run on the CPU writing its
results and the updated state under $OUT as the parts finish."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_suite


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "gpu_sitting.sh")
UNITS = ["train", "tests", "decode", "quality:bst-mf-s4-indep-s0", "quality:brect-fixed-skip-s0"]
UNITS += ["quality:trsf-xl-s0", "quality:gss-hybrid-s0", "layer_speed"]


def sitting(*args, out=None, timeout=60):
    env = {**os.environ, **({"OUT": str(out)} if out else {})}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def plan_units(stdout: str) -> list[tuple[str, str]]:
    lines = [line.strip() for line in stdout.splitlines() if line.startswith("  ") and ": " in line]
    return [tuple(line.split(": ", 1)) for line in lines if not line.startswith("expected")]


def test_plan_order_and_budgets_without_gpu_or_writes(tmp_path):
    proc = sitting("--plan", "--state", str(tmp_path / "none.txt"))
    assert proc.returncode == 0, proc.stderr
    units = plan_units(proc.stdout)
    assert [u for u, _ in units] == UNITS  # (a) train (b) tests (c) decode (d) quality pairs (e) layer speed
    assert all(what.startswith("to run") for _, what in units)
    # whole budgets: a, b, c fit the default 660 s; the pairs (480 s each) and the layer speed wait
    assert "expected this sitting (every part using its whole budget): train tests decode\n" in proc.stdout
    assert not (ROOT / "gpu_sitting").exists() or not any((ROOT / "gpu_sitting").iterdir())


def test_plan_skips_what_the_state_file_lists_and_redo_reruns_it(tmp_path):
    state = tmp_path / "state.txt"
    state.write_text(
        "# part\tutc\tcommit\tdevice\tnote\n"
        "tests\t2026-11-27T00:10Z\tabc1234\tNVIDIA H200\t\n"
        "decode\t2026-11-27T00:14Z\tabc1234\tNVIDIA H200\t0 skipped\n"
        "train\t2026-11-27T00:18Z\tabc1234\tNVIDIA H200\t0 skipped\n"
    )
    proc = sitting("--plan", "--state", str(state))
    units = dict(plan_units(proc.stdout))
    assert units["decode"].startswith("done already (2026-11-27T00:14Z abc1234)")
    assert units["quality:bst-mf-s4-indep-s0"].startswith("to run")
    # a, b, c done: the next sitting starts with the first pair, then the layer speed in what is left
    assert "expected this sitting (every part using its whole budget): quality:bst-mf-s4-indep-s0 " in proc.stdout
    assert "quality:brect-fixed-skip-s0 layer_speed\n" in proc.stdout
    redo = dict(plan_units(sitting("--plan", "--state", str(state), "--redo", "decode").stdout))
    assert redo["decode"].startswith("to run") and redo["tests"].startswith("done already")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parts", "tests bogus"], "'bogus' is not one of"),
        (["--total", "10m"], "whole seconds"),
        (["--mqar", "0.5"], "--mqar takes whole minutes"),
        (["--frobnicate"], "unknown argument"),
    ],
)
def test_bad_flags_exit_2_before_anything_runs(args, message, tmp_path):
    proc = sitting(*args, out=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "env.txt").exists()


def test_dry_run_writes_the_plan_results_and_state_under_out(tmp_path):
    """The dry run of the tests part on the CPU: plan.txt, the part's suite report, and the state with the part
    added in $OUT; the repository's state file is read, not written."""
    state = tmp_path / "state.txt"
    state.write_text("# part\tutc\tcommit\tdevice\tnote\n")
    out = tmp_path / "out"
    proc = sitting("--dry-run", "--parts", "tests", "--state", str(state), out=out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "plan.txt").read_text().startswith("gpu_sitting plan: 660 s in all")
    assert (out / "results.tgz").exists()
    # the part's own report: the GPU suite's first part, `pytest -m gpu` (tests/benchmarks/test_gpu_suite.py runs the
    # suite's other parts): the tests collected, none failed; without CUDA every one skipped, saying why
    report = json.loads((out / "tests" / "gpu_suite.json").read_text())
    assert report["dry_run"] is True and report["parts"]["tests"]["status"] == "ok"
    assert all(report["parts"][name]["status"] == "skipped (not selected)" for name in gpu_suite.PARTS[1:])
    tests = report["parts"]["tests"]["data"]
    assert tests["tests"] > 0 and tests["failures"] == tests["errors"] == 0
    if not gpu_suite.torch.cuda.is_available():
        assert tests["skipped"] == tests["tests"] and all("no CUDA" in r for r in tests["skip_reasons"])
    md = (out / "tests" / "gpu_suite.md").read_text()
    assert f"`pytest -m gpu`: {tests['passed']} passed, 0 failed, 0 errors, {tests['skipped']} skipped." in md
    assert (out / "tests" / "tests.log").exists() and (out / "tests" / "gpu_tests.xml").exists()
    lines = (out / "gpu_sitting_state.txt").read_text().splitlines()
    assert lines[-1].split("\t")[0] == "tests" and "cpu (dry run)" in lines[-1]
    assert state.read_text() == "# part\tutc\tcommit\tdevice\tnote\n"
    # the same $OUT again: the sitting starts from the state it wrote, so the finished part is skipped
    again = sitting("--plan", "--parts", "tests", "--state", str(out / "gpu_sitting_state.txt"))
    assert dict(plan_units(again.stdout))["tests"].startswith("done already")


@pytest.mark.slow
def test_dry_run_of_every_part_stops_what_does_not_fit(tmp_path):
    """Every part's own dry run in the sitting's order; with --total 455 and --deadline 240 the first quality pair runs
    after a, b and c (it needs 240 + 30 + 15 s left: true while a, b and c take under 170 s; ~90-120 s here) and the
    second waits for the next sitting (true once the first pair and a, b, c took over 170 s together; the pair's dry
    run alone takes ~200 s here). The sitting decides on the time left, so --total sits between those two."""
    state = tmp_path / "state.txt"
    state.write_text("# part\tutc\tcommit\tdevice\tnote\n")
    out = tmp_path / "out"
    proc = sitting(
        "--dry-run", "--state", str(state), "--total", "455", "--deadline", "240",
        "--models", "bst-sh-s4 trsf-xl slide gss-hybrid", out=out, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (out / "sitting.log").read_text()
    done = [line.split("\t")[0] for line in (out / "gpu_sitting_state.txt").read_text().splitlines()[1:]]
    assert done[:3] == ["train", "tests", "decode"], log
    assert "quality:slide-s0 quality:gss-hybrid-s0: wait for the next sitting" in log, log
