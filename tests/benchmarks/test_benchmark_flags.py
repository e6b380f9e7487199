"""Issue #35 (4): every benchmark checks its flags when it parses them, naming the valid values, before it builds or
times anything; and the rows a benchmark has measured stay on disk when a later one fails."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_common


ROOT = Path(__file__).resolve().parents[2]


SCRIPTS = ["compile_speed", "eval_memory", "generation_speed", "gpu_suite", "layer_speed", "ssm_scaling"]
SCRIPTS += ["train_throughput", "generate_compile", "train_ops"]


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules, imported once (compile_speed sets an inductor variable for its own runs: undone)."""
    before = os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    modules = {name: importlib.import_module(f"benchmarks.{name}") for name in SCRIPTS}
    if before is None:
        os.environ.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    else:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = before
    return modules


def parse_error(bench, capsys, script: str, argv: list[str]) -> str:
    """stderr of a parse that must fail the way argparse fails (status 2)."""
    with pytest.raises(SystemExit) as exc:
        bench[script].parse_args(argv)
    assert exc.value.code == 2, (script, argv)
    return capsys.readouterr().err


# (script, argv, the bad value, the valid values the message must name)
BAD_NAMES = [
    ("train_throughput", ["--dtypes", "fp32", "float16"], "float16", ["fp32", "bf16"]),
    ("train_throughput", ["--kinds", "llama", "mamba"], "mamba", ["llama", "bst", "slide"]),
    ("train_throughput", ["--size", "1b"], "1b", ["60m", "200m", "tiny"]),
    ("train_ops", ["--kinds", "llama", "mamba"], "mamba", ["bst", "slide", "llama"]),
    ("train_ops", ["--paths", "gpu"], "gpu", ["cpu", "accelerator"]),
    ("compile_speed", ["--modes", "backward"], "backward", ["forward", "train"]),
    ("compile_speed", ["--fft", "cufft"], "cufft", ["disable", "inductor", "op"]),
    ("eval_memory", ["--dtype", "float16"], "float16", ["float32", "bfloat16"]),
    ("eval_memory", ["--preset", "bst-huge"], "bst-huge", ["bst-sh-s4", "slide-12l", "bst-tiny-sh-s4"]),
    ("generation_speed", ["--kinds", "bst-s4", "gpt2"], "gpt2", ["bst-s4", "bst-unstruct", "llama-static", "mamba"]),
    ("generation_speed", ["--compile", "fast"], "fast", ["reduce-overhead", "default", "max-autotune", "eager"]),
    ("generation_speed", ["--stat", "median"], "median", ["best", "mean"]),
    ("gpu_suite", ["out", "--dry-run", "--parts", "tests", "bench"], "bench", ["tests", "layer_speed", "train"]),
    ("gpu_suite", ["out", "--dry-run", "--budget", "trian=30"], "trian", ["tests", "layer_speed", "train", "decode"]),
    ("layer_speed", ["--dtype", "fp16"], "fp16", ["fp32", "bf16", "both"]),
    ("layer_speed", ["--contenders", "Slide", "Mamba"], "Mamba", ["Slide", "BST:SH:S4", "BRecT", "lucidrains"]),
    ("ssm_scaling", ["--parts", "all"], "all", ["layers", "decode"]),
    ("ssm_scaling", ["--layers", "BST:XX:S4"], "BST:XX:S4", ["Slide", "BST:SH:S4", "BST:MH:S4"]),
    ("ssm_scaling", ["--paths", "segmented"], "segmented", ["whole", "unsegmented", "default"]),
    ("generate_compile", ["--variants", "bst-sh-s4", "llama"], "llama", ["bst-sh-s4", "bst-mf-s4", "slide"]),
]


@pytest.mark.parametrize("script,argv,bad,valid", BAD_NAMES, ids=[f"{s}:{a[-1]}" for s, a, _, _ in BAD_NAMES])
def test_a_bad_name_fails_at_parse_time_naming_the_valid_ones(bench, capsys, script, argv, bad, valid):
    err = parse_error(bench, capsys, script, argv)
    assert repr(bad) in err or bad in err.split(), err
    for name in valid:
        assert repr(name) in err or f" {name}," in err or f" {name}\n" in err or f" {name})" in err, (name, err)


BAD_NUMBERS = [
    ("train_throughput", ["--seq-len", "0"]),
    ("train_throughput", ["--rounds", "-1"]),
    ("train_throughput", ["--steps", "two"]),
    ("train_throughput", ["--threads", "0"]),
    ("compile_speed", ["--lengths", "512", "0"]),
    ("compile_speed", ["--repeats", "0"]),
    ("eval_memory", ["--tokens", "4096", "-5"]),
    ("eval_memory", ["--chunk", "0"]),
    ("eval_memory", ["--budget_gib", "0"]),
    ("generation_speed", ["--contexts", "1024", "0"]),
    ("generation_speed", ["--steps", "0"]),
    ("generation_speed", ["--llama-max", "-1"]),
    ("layer_speed", ["--rounds", "0"]),
    ("layer_speed", ["--budget", "-1"]),
    ("layer_speed", ["--lengths", "1024", "nan"]),
    ("ssm_scaling", ["--steps", "0"]),
    ("ssm_scaling", ["--lengths", "-4096"]),
    ("gpu_suite", ["out", "--dry-run", "--budget", "train=-5"]),
    ("gpu_suite", ["out", "--dry-run", "--budget", "train=soon"]),
    ("generate_compile", ["--batches", "1", "0"]),
    ("generate_compile", ["--new-tokens", "-3"]),
]


@pytest.mark.parametrize("script,argv", BAD_NUMBERS, ids=[f"{s}:{' '.join(a)}" for s, a in BAD_NUMBERS])
def test_a_number_that_must_be_positive_fails_at_parse_time(bench, capsys, script, argv):
    err = parse_error(bench, capsys, script, argv)
    bad = argv[-1].split("=")[-1]
    assert repr(bad) in err and ("positive" in err or "non-negative" in err), err


def test_missing_files_and_devices_fail_at_parse_time(bench, capsys):
    err = parse_error(bench, capsys, "compile_speed", ["--configs", "training/presets/no-such-model.json"])
    assert "no such file" in err and "no-such-model.json" in err
    err = parse_error(bench, capsys, "layer_speed", ["--render", "no-such-run.json"])
    assert "no such file" in err
    err = parse_error(bench, capsys, "train_throughput", ["--device", "tpu"])
    assert "'tpu'" in err and "cpu, cuda" in err
    if not bench["train_throughput"].torch.cuda.is_available():
        err = parse_error(bench, capsys, "generation_speed", ["--device", "cuda"])
        assert "no CUDA device" in err
        err = parse_error(bench, capsys, "gpu_suite", ["out"])  # the full suite needs a GPU; the dry run does not
        assert "no CUDA device" in err and "--dry-run" in err


def test_aliases_and_defaults_parse(bench):
    assert bench["train_throughput"].parse_args(["--dtypes", "float32", "BF16"]).dtypes == ["fp32", "bf16"]
    assert bench["train_throughput"].parse_args([]).dtypes == ["fp32", "bf16"]
    assert bench["layer_speed"].parse_args(["--dtype", "bfloat16"]).dtype == "bf16"
    assert bench["eval_memory"].parse_args(["--dtype", "fp32"]).dtype == "float32"
    assert bench["eval_memory"].parse_args([]).dtype == "bfloat16"
    config = str(ROOT / "training" / "presets" / "bst-tiny-sh-s4.json")
    assert bench["compile_speed"].parse_args(["--configs", config]).lengths == [512]
    assert bench["generation_speed"].parse_args(["--llama-max", "0"]).llama_max == 0
    assert bench["ssm_scaling"].parse_args(["--lengths", "256"]).lengths == [256]
    args = bench["gpu_suite"].parse_args(["out", "--dry-run", "--budget", "train=30"])
    assert args.budgets["train"] == 30.0 and args.budgets["decode"] == bench["gpu_suite"].BUDGETS["decode"]


def test_the_issue_command_fails_before_measuring():
    """The command of issue #35 with a dtype that does not exist: status 2 at once, nothing timed."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_throughput", "--seq-len", "4096", "--dtypes", "fp16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,  # a regression would start measuring: stopped long before it writes anything
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert "invalid choice: 'fp16'" in proc.stderr and "'fp32'" in proc.stderr and "'bf16'" in proc.stderr


def test_row_log_keeps_rows_written_before_a_failure(tmp_path, capsys):
    output = tmp_path / "bench.json"
    partial = tmp_path / "bench.partial.jsonl"
    (tmp_path / "bench.partial.jsonl").write_text('{"row": {"earlier": 1}}\n')  # a crashed earlier run's file
    with pytest.raises(SystemExit) as exc:
        with bench_common.RowLog(output, {"command": "x"}) as log:
            for i in range(5):
                if i == 3:
                    raise RuntimeError("out of memory at row 3")
                log.add({"i": i, "ms": 1.5 * i})
                assert bench_common.read_partial(partial)[1][-1] == {"i": i, "ms": 1.5 * i}  # on disk already
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "out of memory at row 3" in err and f"3 measured row(s) kept in {partial}" in err
    meta, rows = bench_common.read_partial(partial)
    assert meta == {"command": "x"} and rows == [{"i": 0, "ms": 0.0}, {"i": 1, "ms": 1.5}, {"i": 2, "ms": 3.0}]
    assert not output.exists()
    assert bench_common.read_partial(tmp_path / "bench.partial.prev.jsonl")[1] == [{"earlier": 1}]
    # A kill mid-line leaves a cut line: the rows before it still read.
    with partial.open("a") as f:
        f.write('{"row": {"i": 3, "m')
    assert len(bench_common.read_partial(partial)[1]) == 3
    # A run that finishes removes its partial file once the final output is written.
    with bench_common.RowLog(output) as log:
        log.add({"i": 0})
        output.write_text(json.dumps(log.rows))
        log.done()
    assert not partial.exists() and json.loads(output.read_text()) == [{"i": 0}]


def test_a_benchmark_that_fails_midway_keeps_its_rows(bench, tmp_path, monkeypatch, capsys):
    """compile_speed.main with its measurement replaced: two rows, then an error; both rows are on disk, the error is
    reported and the run exits with status 1 (the final JSON, which needs every row, is not written)."""
    cs = bench["compile_speed"]
    calls = []

    def fake_run(config, length, mode, fft, repeats):
        calls.append((length, mode))
        if len(calls) == 3:
            raise RuntimeError("compile failed")
        row = dict(config="c", length=length, mode=mode, fft=fft, first_call_s=1.0, eager_s=0.1, compiled_s=0.05)
        return dict(row, speedup=2.0, max_abs_diff=0.0, repeats=repeats)

    monkeypatch.setattr(cs, "run", fake_run)
    monkeypatch.setattr(cs, "tune_malloc", lambda: False)
    monkeypatch.setattr(cs.torch, "set_num_threads", lambda n: None)
    output = tmp_path / "compile.json"
    config = str(ROOT / "training" / "presets" / "bst-tiny-sh-s4.json")
    argv = [
        "--configs",
        config,
        "--lengths",
        "64",
        "128",
        "256",
        "--modes",
        "forward",
        "--fft",
        "op",
        "--output",
        str(output),
    ]
    with pytest.raises(SystemExit) as exc:
        cs.main(argv)
    assert exc.value.code == 1 and len(calls) == 3
    assert "compile failed" in capsys.readouterr().err
    _, rows = bench_common.read_partial(tmp_path / "compile.partial.jsonl")
    assert [(r["length"], r["mode"]) for r in rows] == [(64, "forward"), (128, "forward")]
    assert not output.exists()


def test_generate_compile_needs_two_new_tokens_and_whole_heads(bench, capsys):
    err = parse_error(bench, capsys, "generate_compile", ["--new-tokens", "1"])
    assert "--new-tokens" in err and "at least 2" in err
    err = parse_error(bench, capsys, "generate_compile", ["--hidden", "100"])
    assert "--hidden" in err and "multiple of 64" in err
    assert bench["generate_compile"].parse_args(["--quick"]).new_tokens == 8
