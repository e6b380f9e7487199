"""scripts/check_newest_transformers.sh's decision, without installing anything: which release it checks, and that
with ``--if-newer`` (CI) it checks one only when the index lists a stable release beyond setup.cfg's upper pin."""

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_newest_transformers.sh"
spec = importlib.util.spec_from_file_location("newest_transformers", REPO / "scripts" / "newest_transformers.py")
nt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nt)

PIP_OUTPUT = """transformers (5.24.0)
Available versions: 5.24.0, 5.23.0, 5.22.2, 4.57.6
"""


def listing(*versions):
    return f"transformers ({versions[0]})\nAvailable versions: {', '.join(versions)}\n"


def test_versions_from_pip_index_output():
    assert nt.listed_versions(PIP_OUTPUT) == ["5.24.0", "5.23.0", "5.22.2", "4.57.6"]
    assert nt.listed_versions(listing("5.25.0rc1", "5.25.0.dev0", "5.24.0")) == ["5.24.0"]
    with pytest.raises(ValueError, match="Available versions"):
        nt.listed_versions("ERROR: No matching distribution found for transformers")


def test_upper_pin_and_requirements_are_setup_cfgs(capsys):
    pin = nt.upper_pin()
    assert re.search(rf"transformers>=[\d.]+,<{re.escape(pin)}\b", (REPO / "setup.cfg").read_text())
    # The throw-away environment gets every other requirement (the package and its test extra), transformers unpinned.
    assert nt.main(["requirements"]) == 0
    lines = capsys.readouterr().out.split()
    assert "torch>=2.4" in lines and "pytest>=8" in lines and not [r for r in lines if r.startswith("transformers")]


@pytest.mark.parametrize(
    "versions, newer",
    [
        (["5.24.0", "5.23.0"], None),  # inside the pin
        (["5.24.1", "5.24.0"], None),  # a patch release inside it
        (["5.25.0", "5.24.0"], "5.25.0"),
        (["5.24.0", "5.40.0", "5.3.0"], "5.40.0"),  # by release order, not text
        (["6.0.0"], "6.0.0"),
        ([], None),
    ],
)
def test_newer_release_is_beyond_the_pin(versions, newer):
    assert nt.newer_release(versions, "5.25") == newer


def run_script(*args, versions):
    env = {**os.environ, "BST_INDEX_VERSIONS": listing(*versions), "BST_CHECK_DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_script_checks_only_a_newer_release_with_if_newer():
    pin = nt.release(nt.upper_pin())
    inside = ".".join(map(str, (*pin[:-1], pin[-1] - 1, 0)))
    beyond = ".".join(map(str, (*pin, 0)))
    assert "nothing to check" in run_script("--if-newer", versions=[inside])
    assert f"checking transformers {beyond}" in run_script("--if-newer", versions=[beyond, inside])
    # Run by hand (no --if-newer): the newest release, pinned or not.
    assert f"checking transformers {inside}" in run_script(versions=[inside])
