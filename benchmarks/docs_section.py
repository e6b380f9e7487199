"""Shared by the benchmark scripts: the machine's CPU name, allocator tuning, device timing, and replacing one marked
section of docs/benchmarks.md."""

import platform
import time
from pathlib import Path

import torch


BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """The accelerator's name for ``cuda`` (e.g. ``NVIDIA H100 80GB HBM3``), the CPU's otherwise."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else cpu_name()


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
    """Write ``lines`` between ``<!-- name:start -->`` and ``<!-- name:end -->``, leaving other sections alone."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = "\n".join([start, *lines, end])
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
