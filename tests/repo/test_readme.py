"""The README's ```python blocks run as written: extracted in order and executed in one fresh Python process, as if
pasted into a session at the repository root (a temporary directory holding links to the repository's top-level
entries, so that relative paths such as ``configs/models/...`` work and what the blocks write stays out of the
checkout). The block that loads the main job's ``outputs/tiny/final`` runs against a stand-in folder written like
the main job's: the tiny preset saved with ``save_pretrained`` and a tokenizer."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


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
    for needle in ("outputs/tiny/final", "bst-tiny-sh-s4.json", "AutoModelForSequenceClassification", "generate("):
        assert needle in code, needle
    # Every ```python fence of the README was extracted (none skipped by a formatting variant).
    assert len(blocks) == README.read_text().count("```python")


def write_main_job_stand_in(folder: Path):
    """What ``outputs/tiny/final`` holds after the main job: a BST saved with ``save_pretrained`` and its tokenizer."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(REPO / "configs" / "models" / "bst-tiny-sh-s4.json")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "training" / "tokenizers" / "mistral-v1-32k").save_pretrained(folder)


def test_readme_python_blocks_run(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if not entry.name.startswith(".") and entry.name != "outputs":
            (root / entry.name).symlink_to(entry)
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
    env.pop("PYTHONPATH", None)
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
    # (the scratch copy's outputs/ is its own folder, not a link: a user's own outputs/ is neither read nor written)
    assert (root / "outputs" / "my-bst" / "config.json").is_file() and not (root / "outputs").is_symlink()


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
