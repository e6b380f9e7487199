"""Process settings for training on the CPU: large tensors served from the allocator's heap, not fresh pages.

glibc's ``malloc`` gives every allocation above its mmap threshold (at most 32 MiB while it adapts by itself) fresh
pages from the kernel and returns them on ``free``, so a tensor of that size costs a page fault per 4 KiB page each
time it is written, every step. A BST layer's sliding-window attention scores are such tensors at long contexts
(L = 4096, W = 512, 4 heads: 42 MiB per layer in one call): with the default the CPU training step ran 1.2x slower
than with these settings (docs/performance.md, "Allocator"). Raising the threshold (and the trim threshold with it)
keeps freed blocks in the heap, where the next step's tensors of the same size reuse them, which is what PyTorch's
CPU tuning guide gets from jemalloc or tcmalloc through ``LD_PRELOAD``; memory held stays the step's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys


logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_THRESHOLD = -3
MAX_THRESHOLD = 2**31 - 1  # mallopt takes an int


def keep_large_allocations(threshold_mib: int = 1024, device_type: str = "cpu") -> bool:
    """Serve allocations below ``threshold_mib`` MiB from glibc's heap and keep freed memory for reuse, for a run on
    ``device_type`` "cpu" (Linux with glibc; otherwise, or with ``threshold_mib`` 0, nothing changes). Returns whether
    the settings were applied."""
    if not isinstance(threshold_mib, int) or threshold_mib < 0:
        raise ValueError(
            f"cpu_allocation_threshold_mib must be an int >= 0 (0: leave malloc as it is), got {threshold_mib!r}"
        )
    if threshold_mib == 0 or device_type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = min(threshold_mib * 2**20, MAX_THRESHOLD)
    applied = bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, min(2 * threshold, MAX_THRESHOLD))
    )
    if applied:
        logger.info("malloc: allocations below %d MiB come from the heap and freed memory is kept", threshold_mib)
    return applied
