"""training/host.py: the malloc settings a CPU training run applies."""

import subprocess
import sys

import pytest

from training import train as T
from training.host import keep_large_allocations


# A child process, so that the settings do not change the test process's malloc. Twenty "steps" each write and free
# two 64 MiB tensors; it prints the page faults of the last five: with glibc's default every such tensor gets fresh
# pages (one fault per 4 KiB page written), with the settings the heap reuses the freed blocks once it holds them
# (after about five steps; how soon depends on what else the process allocated).
FAULTS = r"""
import resource, sys, torch
from training.host import keep_large_allocations
applied = keep_large_allocations(int(sys.argv[1]))
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = torch.ones(16 * 2**20), torch.ones(16 * 2**20)
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults[-5:])
"""


def faults(threshold_mib: int) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(threshold_mib)], capture_output=True, text=True, check=True
    )
    applied, *counts = out.stdout.split()
    return applied, [int(c) for c in counts]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_tensors_reuse_freed_memory_instead_of_faulting_in_new_pages():
    applied, tuned = faults(1024)
    default_applied, default = faults(0)
    assert (applied, default_applied) == ("True", "False")
    assert min(default) > 2 * 16_000, default  # every step: 2 x 64 MiB of fresh 4 KiB pages
    assert sum(tuned) < sum(default) / 4 and min(tuned) < 1_000, (tuned, default)


def test_bad_threshold_names_the_field_and_other_devices_are_left_alone():
    with pytest.raises(ValueError, match="cpu_allocation_threshold_mib"):
        keep_large_allocations(-1)
    with pytest.raises(ValueError, match="cpu_allocation_threshold_mib"):
        keep_large_allocations(1.5)
    assert keep_large_allocations(1024, device_type="cuda") is False
    assert keep_large_allocations(0) is False


def test_the_training_cli_takes_the_threshold():
    model_args, _, _ = T.parse_args(["--model_config", "bst-tiny-sh-s4", "--output_dir", "/tmp/x"])
    assert model_args.cpu_allocation_threshold_mib == 1024
    model_args, _, _ = T.parse_args(
        ["--model_config", "bst-tiny-sh-s4", "--output_dir", "/tmp/x", "--cpu_allocation_threshold_mib", "0"]
    )
    assert model_args.cpu_allocation_threshold_mib == 0
