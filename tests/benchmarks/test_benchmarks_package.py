"""``benchmarks/`` is a package (issue #34, item 5): every benchmark runs from the repository root as
``python -m benchmarks.<name>``, no file in it edits ``sys.path``, and nothing runs a benchmark by its path."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
MODULES = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
# The modules with a command line (the others are the shared helpers).
SCRIPTS = [m for m in MODULES if "__main__" in (BENCHMARKS / f"{m}.py").read_text()]


def test_benchmarks_is_a_package_of_scripts():
    assert (BENCHMARKS / "__init__.py").is_file()
    assert {"bench_common", "docs_section"} <= set(MODULES)
    assert {"layer_speed", "train_throughput", "generation_speed", "gpu_suite"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", MODULES)
def test_no_benchmark_edits_sys_path(name):
    """No ``sys.path`` edits and no imports of a sibling by its bare name (which only works when run by path)."""
    source = (BENCHMARKS / f"{name}.py").read_text()
    assert "sys.path" not in source
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module.split(".")[0]]
        assert not set(names) & set(MODULES), f"{name}.py line {node.lineno}: import benchmarks.<module> instead"


# Runs each benchmark as ``python -m benchmarks.<name> --help`` would (``runpy.run_module`` as __main__, the
# repository root first on sys.path), all in one interpreter so torch and transformers are imported once.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [f"benchmarks.{name}", "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = f"{type(exc).__name__}: {exc}"
    results[name] = dict(code=code, stdout=out.getvalue(), stderr=err.getvalue())
print(json.dumps(results))
"""


def test_every_benchmark_prints_help_as_a_module():
    """``python -m benchmarks.<name> --help`` from the repository root: imports and exits 0 with its usage."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-c", HELP_RUNNER, *SCRIPTS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert list(results) == SCRIPTS
    for name, result in results.items():
        assert result["code"] in (0, None), f"{name}: exit {result['code']}: {result['stderr'][-2000:]}"
        assert result["stdout"].startswith("usage:") and "--help" in result["stdout"], name


def test_nothing_runs_a_benchmark_by_its_path():
    """Docs, scripts, tests and the benchmarks themselves say ``python -m benchmarks.<name>``."""
    by_path = re.compile(r"python3?\s+(?:\S*/)?benchmarks/\w+\.py")
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("scripts/*.sh"), *BENCHMARKS.glob("*.sh")]
    files += [
        *BENCHMARKS.glob("*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("research/**/*.py"),
        *ROOT.glob("training/*.py"),
    ]
    offenders = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in files
        if path.name != Path(__file__).name
        for match in by_path.finditer(path.read_text())
    ]
    assert not offenders, offenders
