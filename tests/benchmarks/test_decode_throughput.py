"""`python -m benchmarks.decode_throughput` (issue #35, item 1): the smoke mode end to end (JSON, PNG, the docs
section, every cell measured or skipped with a reason), flags refused at parse time, and the measured path (a
batch-1 prefill replicated to B rows, then generate) giving the tokens plain batched generate gives."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import decode_throughput as dt
from benchmarks.bench_common import partial_path


ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_writes_json_png_and_section(tmp_path):
    out, md = tmp_path / "dt.json", tmp_path / "bench.md"
    md.write_text("# Benchmarks\n\n<!-- decode_throughput:start -->\nSTALE-ROWS\n<!-- decode_throughput:end -->\n")
    argv = ["--quick", "--contexts", "64", "--batches", "1", "3", "--output", str(out), "--docs", str(md)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode_throughput", *argv, "--memory-budget-gib", "1000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["schema"] == dt.SCHEMA and not partial_path(out).exists()
    cells = {(r["context"], r["batch"], r["model"]) for r in report["rows"]}
    assert cells == {(64, b, m) for b in (1, 3) for m in dt.MODELS}
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["flops_per_token"] > 0, row
    assert {r["reference"] for r in report["ratios"]} == {"Llama (static)", "Llama (dynamic)"}
    assert all(r["bound"] > 0 and r["ratio"] > 0 for r in report["ratios"])
    assert out.with_suffix(".png").stat().st_size > 0
    text = md.read_text()
    assert "STALE-ROWS" not in text and "| 64 | 3 | Llama (static) |" in text and "fraction of bound" in text


def test_memory_budget_skips_with_the_reason(tmp_path):
    args = dt.parse_args(["--quick", "--contexts", "64", "--batches", "2", "--memory-budget-gib", "0.001"])
    log = dt.RowLog(tmp_path / "x.json")
    rows = dt.run(args, log)
    assert len(rows) == 4 and all(r["skipped"].startswith("memory: estimated") for r in rows)
    assert all(r["ratio"] is None for r in dt.ratios(rows, "Llama (static)"))
    dt.plot(rows, tmp_path / "skipped.png")  # a plot of skipped cells only: empty panels, no error
    report = dict(meta=dict(machine="m", torch="t", transformers="x", date="d", argv="", args=vars(args)), rows=rows)
    report["goals"] = dt.goals(rows, args)
    assert "skipped: memory: estimated" in "\n".join(dt.markdown(report))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "0"], "not a positive integer"),
        (["--models", "Mamba"], "invalid choice"),
        (["--new-tokens", "1"], "at least 2"),
        (["--memory-budget-gib", "inf"], "not a positive number"),
        (["--hidden", "100"], "multiple of 64"),
    ],
)
def test_flags_fail_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        dt.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", dt.MODELS)
def test_replicated_prefill_generates_what_batched_generate_does(name):
    args = dt.parse_args(["--quick"])
    context, batch = 40, 3
    model = dt.build(name, args, context)
    ids = torch.randint(0, args.vocab, (1, context), generator=torch.Generator().manual_seed(1))
    cache1, _ = dt.prefill(name, model, ids[:, :-1])
    cache = dt.replicate(name, model, cache1, batch, context + 6)
    with torch.no_grad():
        ours = model.generate(ids.expand(batch, -1), max_new_tokens=5, do_sample=False, past_key_values=cache)
        kw = {"cache_implementation": "static"} if name == "Llama (static)" else {}
        plain = model.generate(ids.expand(batch, -1), max_new_tokens=5, do_sample=False, **kw)
    assert torch.equal(ours, plain)
    # and a try leaves the batch-1 cache as it was (every try starts from the same state)
    again = dt.decode_once(name, model, cache1, ids, batch, 4)
    assert again["step_s"] > 0 and again["tokens"] == batch * 3
