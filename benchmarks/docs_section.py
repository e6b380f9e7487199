"""Shared by the benchmark scripts: allocator tuning, device timing, and replacing one marked section of
docs/benchmarks.md (the machine's name and the section writer itself are ``reporting``'s, shared with research/)."""

import time
from pathlib import Path

import torch

import reporting


BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def clock(device: str) -> float:
    """``time.perf_counter()`` once the device's queued work has finished (CUDA runs asynchronously): the difference
    of two calls around some work is its wall time on the device, launch overhead included."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def tune_malloc() -> bool:
    """glibc: no mmap for large blocks and no trimming (= MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11).

    Without it every large temporary is mmap'ed and page-faulted afresh (~1M page faults per L = 4096 training step;
    BST:MH forwards 2-3x slower). Applied to every contender of a run alike. Returns whether mallopt was applied.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 100_000_000_000))
    except (OSError, AttributeError):
        return False


def write_section(name: str, lines: list[str], path: Path = BENCHMARKS_MD):
    """[`reporting.write_section`] into docs/benchmarks.md unless ``path`` names another page."""
    reporting.write_section(name, lines, Path(path), heading="# Benchmarks\n")
