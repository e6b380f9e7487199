"""The README's ```python blocks run as written: extracted in order and executed in one fresh Python process, as if
pasted into a session outside the clone (a temporary directory: nothing of the repository is there, so the presets,
tokenizer and books come from the package by name, ``training.preset`` / ``training.HOME``, as after a ``pip install``
from a git URL; the packages are imported from the checkout). The block that loads the main job's
``outputs/tiny/final`` runs against a stand-in folder written like the main job's: the tiny preset saved with
``save_pretrained`` and a tokenizer. The package build ships what those names need, and the parameter counts the README
states are the presets'."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import training


REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

# Executes each block with README.md's line numbers (tracebacks point into the README).
RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for line, source in blocks:
    print(f"--- README.md block at line {line}", flush=True)
    exec(compile("\\n" * (line - 1) + source, "README.md", "exec"), namespace)
print("README blocks OK", flush=True)
"""


def python_blocks() -> list[tuple[int, str]]:
    """``[(first line of the code in README.md, code)]`` of every ```python block, in order."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_readme_python_blocks_are_found():
    blocks = python_blocks()
    assert len(blocks) >= 4
    code = "\n".join(source for _, source in blocks)
    for needle in (
        "outputs/tiny/final",
        'preset("bst-tiny-sh-s4")',
        "AutoModelForSequenceClassification",
        "generate(",
    ):
        assert needle in code, needle
    # Every ```python fence of the README was extracted (none skipped by a formatting variant).
    assert len(blocks) == README.read_text().count("```python")


def write_main_job_stand_in(folder: Path):
    """What ``outputs/tiny/final`` holds after the main job: a BST saved with ``save_pretrained`` and its tokenizer."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(training.preset("bst-tiny-sh-s4"))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "training" / "tokenizers" / "mistral-v1-32k").save_pretrained(folder)


def test_readme_python_blocks_run(tmp_path):
    root = tmp_path / "elsewhere"
    root.mkdir()
    write_main_job_stand_in(root / "outputs" / "tiny" / "final")
    blocks_file = tmp_path / "blocks.json"
    blocks_file.write_text(json.dumps(python_blocks()))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env["PYTHONPATH"] = str(REPO)  # the checkout's packages, not its files: cwd is outside it
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(blocks_file)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "README blocks OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    # What the blocks wrote stays in the temporary directory, under outputs/ (which git ignores).
    assert (root / "outputs" / "my-bst" / "config.json").is_file()


def test_readme_blocks_write_only_under_outputs():
    """A user who runs the README at the repository root leaves nothing the tests or git see: every path the blocks
    write (save_pretrained, Trainer output folders) is under outputs/, which .gitignore lists and the test above does
    not link into its scratch copy."""
    code = "\n".join(source for _, source in python_blocks())
    written = re.findall(r'(?:save_pretrained|TrainingArguments)\(\s*"([^"]+)"', code)
    assert written and all(path.startswith("outputs/") for path in written), written
    assert "outputs/" in (REPO / ".gitignore").read_text().splitlines()


def test_readme_relative_links_resolve():
    """Every relative link of the README (outside code blocks) names a file or folder of the repository."""
    text = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M).replace("\n", " ")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", t)]
    assert targets
    missing = [t for t in targets if not (REPO / t.partition("#")[0]).exists()]
    assert not missing, missing


def test_readme_parameter_counts_are_the_presets():
    """The Quickstart's "N.NNM parameters" is its preset's count; the presets table's tiny range spans the tiny
    presets (issue #45: the Quickstart said 4.6M for a 5.04M model)."""
    import modeling_bst  # noqa: F401

    def count(name):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(training.preset(name)))
        return sum(p.numel() for p in model.parameters()) / 1e6

    text = README.read_text()
    stated = re.findall(r'training\.preset\("([\w-]+)"\)\)\s*#\s*([\d.]+)M parameters', text)
    assert stated, "the Quickstart states its preset's parameter count"
    for name, millions in stated:
        assert f"{count(name):.{len(millions.split('.')[1])}f}" == millions, (name, millions, count(name))
    low, high = re.search(r"\| (\d+\.\d)–(\d+\.\d)M \|", text).groups()
    tiny = [count(p.stem) for p in (training.HOME / "presets").glob("*tiny*.json")]
    assert (f"{min(tiny):.1f}", f"{max(tiny):.1f}") == (low, high)


def test_package_ships_the_presets_tokenizer_and_books(tmp_path):
    """setuptools' ``build_py`` (the step that decides what a wheel or an install from a git URL holds), run on the
    checkout's package files, copies every preset, the 32k tokenizer and the books, and from that build, outside the
    clone, ``training.preset`` finds a preset by name (issue #45: after installing from a git URL the Quickstart failed
    outside the clone)."""
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("modeling_bst", "training"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib", str(site)]
    proc = subprocess.run(build, cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    shipped = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    want = {f"training/presets/{p.name}" for p in (REPO / "training" / "presets").glob("*.json")}
    want |= {f"training/tokenizers/mistral-v1-32k/{f}" for f in ("tokenizer.json", "tokenizer_config.json")}
    want |= {f"training/data/{p.name}" for p in (REPO / "training" / "data").glob("*.xz")}
    assert len(want) > 20 and want <= shipped, sorted(want - shipped)
    code = "import training; print(training.preset('bst-tiny-sh-s4'))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(site / "training" / "presets" / "bst-tiny-sh-s4.json")


def test_unknown_preset_names_the_presets():
    with pytest.raises(FileNotFoundError, match=r"no model preset 'bst-nano'; the presets are: .*bst-tiny-sh-s4"):
        training.preset("bst-nano")
