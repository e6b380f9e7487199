"""What the benchmarks (``benchmarks/``) and the experiments (``research/``) both need to report a run: the name of
the machine it ran on and the marked section of a Markdown page that a report rewrites. Beside the product (the wheel
does not ship it, nothing in ``modeling_bst/`` or ``training/`` imports it); run from the repository root."""

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """The accelerator's name for ``cuda`` (e.g. ``NVIDIA H100 80GB HBM3``), the CPU's otherwise."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else cpu_name()


def write_section(name: str, lines: list[str], path: Path | str, heading: str = ""):
    """Write ``lines`` between ``<!-- name:start -->`` and ``<!-- name:end -->`` of the page ``path``, leaving other
    sections alone; a page that does not exist yet starts with ``heading``."""
    path, start, end = Path(path), f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = "\n".join([start, *lines, end])
    text = path.read_text() if path.exists() else heading
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
