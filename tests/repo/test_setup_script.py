"""``scripts/setup.sh`` (run by the README's test command, scripts/test_oldest.sh and CI): pip runs on the first call
and again only when setup.cfg, pyproject.toml, the script, the extra requirements or the checkout's path change, or
when BST_SETUP_FORCE=1; a failed install leaves no stamp. Checked on a copy of the files it reads, with a stand-in
.venv whose pip records its calls."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "scripts/setup.sh"):
        shutil.copy(REPO / name, root / name)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (bin_dir / "python").write_text("#!/bin/sh\nexit 0\n")  # "torch 2.13.0 is installed"
    (bin_dir / "pip").write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/pip.calls"\nexit ${PIP_RC:-0}\n')
    for name in ("python", "pip"):
        (bin_dir / name).chmod(0o755)
    return root


def setup(root: Path, *args: str, **env) -> tuple[int, list[str]]:
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh"), *args], env={**os.environ, **env}, capture_output=True, text=True
    )
    calls = root / ".venv" / "bin" / "pip.calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return proc.returncode, lines


def test_pip_runs_once_then_only_when_the_install_inputs_change(checkout):
    assert setup(checkout) == (0, ["install -q -e .[test,train]"])
    assert setup(checkout) == (0, [])  # nothing changed: no pip
    assert setup(checkout, BST_SETUP_FORCE="1") == (0, ["install -q -e .[test,train]"])
    with (checkout / "setup.cfg").open("a") as f:
        f.write("\n# a new dependency\n")
    assert setup(checkout) == (0, ["install -q -e .[test,train]"])
    assert setup(checkout) == (0, [])
    moved = checkout.parent / "moved"
    checkout.rename(moved)  # another path: the editable install points at the old one
    (moved / ".venv" / "bin" / "activate").write_text(f'export PATH="{moved / ".venv" / "bin"}:$PATH"\n')
    assert setup(moved) == (0, ["install -q -e .[test,train]"])


def test_a_failed_install_leaves_no_stamp(checkout):
    rc, calls = setup(checkout, PIP_RC="1")
    assert rc == 1 and calls == ["install -q -e .[test,train]"]
    assert not (checkout / ".venv" / ".bst-setup-stamp").exists()
    assert setup(checkout) == (0, ["install -q -e .[test,train]"])  # tried again


def test_another_venv_with_a_pinned_requirement_has_its_own_stamp(checkout):
    """scripts/test_oldest.sh: ``setup.sh .venv-oldest transformers==5.23.0``; a different pin reinstalls."""
    other = checkout / ".venv-oldest" / "bin"
    shutil.copytree(checkout / ".venv" / "bin", other)
    (other / "activate").write_text(f'export PATH="{other}:$PATH"\n')
    pinned = ["install -q -e .[test,train] transformers==5.23.0"]
    assert setup(checkout, ".venv-oldest", "transformers==5.23.0") == (0, [])  # the calls land in .venv-oldest
    assert (other / "pip.calls").read_text().splitlines() == pinned
    (other / "pip.calls").unlink()
    assert setup(checkout, ".venv-oldest", "transformers==5.23.0") == (0, [])
    assert not (other / "pip.calls").exists()  # stamped: no pip
    setup(checkout, ".venv-oldest", "transformers==5.24.0")
    assert (other / "pip.calls").read_text().splitlines() == ["install -q -e .[test,train] transformers==5.24.0"]
    assert not (checkout / ".venv" / ".bst-setup-stamp").exists()  # .venv untouched
