"""Shared by the benchmark scripts: flag checks at parse time, and measured rows kept on disk as they come (issue #35).

Flags: every script checks its flags when it parses them, before it builds or times a model: names against
``choices`` (argparse's message names the valid values; ``alias_choice`` maps cheap aliases such as ``float32`` to
``fp32`` first), numbers with ``positive_int`` / ``non_negative_int`` / ``positive_float``, devices with
``device_arg``, input files with ``existing_file``.

Rows: ``RowLog(output)`` appends every measured row to ``<output stem>.partial.jsonl`` next to the script's JSON
output, one JSON object per line, flushed and synced at once. The first line is ``{"meta": ..., "started": ...}``,
then one ``{"row": ...}`` per row; ``read_partial`` reads them back (a line cut short by a kill is ignored). Once the
script has written its final output as before it calls ``done()``, which removes the file. A run that raises keeps
the file, says how many rows it holds and exits with status 1; a run that is killed keeps it as well. A new run moves
an earlier run's leftover file to ``<output stem>.partial.prev.jsonl`` rather than overwrite it.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


# -- flags -------------------------------------------------------------------------------------------------------------
# Canonical dtype names of the scripts that take fp32 / bf16, and the aliases they also accept.
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16"}
# eval_memory.py names dtypes as torch does (float32 / bfloat16).
TORCH_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}


def alias_choice(aliases: dict):
    """An argparse ``type=`` that maps an alias to its canonical name (case-insensitive); used together with
    ``choices=`` (the canonical names), so that an unknown name fails at parse time with the valid names listed."""

    def choice(text: str) -> str:
        key = text.strip().lower()
        return aliases.get(key, key)

    return choice


def _number(kind, text: str, ok, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v > 0, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "a non-negative integer")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0 and v != float("inf"), "a positive number")


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def device_arg(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; a CUDA device must exist here."""
    import torch

    valid = "valid: cpu, cuda, cuda:N"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ({valid})") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: device type {device.type!r} is not supported ({valid})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return text


# -- rows ----------------------------------------------------------------------------------------------------------------
def partial_path(output) -> Path:
    """``docs/benchmarks/x.json`` -> ``docs/benchmarks/x.partial.jsonl``."""
    output = Path(output)
    return output.with_name(output.stem + ".partial.jsonl")


def _jsonable(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class RowLog:
    """Measured rows appended to ``partial_path(output)`` one JSON line at a time (see the module's docstring).

    Use as a context manager around the measurements: an exception inside is printed with its traceback, then a
    line that says where the rows measured so far are, and the script exits with status 1."""

    def __init__(self, output, meta: dict | None = None):
        self.path = partial_path(output)
        self.rows = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # an earlier run's rows: keep them
            self.path.replace(self.path.with_name(self.path.name.replace(".partial.jsonl", ".partial.prev.jsonl")))
        self._append({"meta": meta or {}, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})

    def _append(self, record: dict):
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, row):
        """Keep one measured row (on disk before this returns); returns it."""
        self.rows.append(row)
        self._append({"row": row})
        return row

    def done(self):
        """The final output is written: the partial file is no longer needed."""
        self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return False
        kept = f"{len(self.rows)} measured row(s) kept in {self.path}"
        if not issubclass(exc_type, Exception):  # KeyboardInterrupt, SystemExit: say where the rows are, go on
            print(f"\n[{exc_type.__name__}] {kept}", file=sys.stderr, flush=True)
            return False
        traceback.print_exception(exc_type, exc, tb)
        print(f"\nbenchmark failed ({exc_type.__name__}: {exc}); {kept}", file=sys.stderr, flush=True)
        raise SystemExit(1) from exc


def read_partial(path) -> tuple[dict, list]:
    """``(meta, rows)`` of a partial file; a last line cut short by a kill is skipped."""
    meta, rows = {}, []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "row" in record:
            rows.append(record["row"])
        elif "meta" in record:
            meta = record["meta"]
    return meta, rows


def write_json_atomic(path, data, indent=1):
    """Rewrite ``path`` whole via a temporary file: a kill leaves the previous version, never half of one."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=_jsonable))
    tmp.replace(path)
