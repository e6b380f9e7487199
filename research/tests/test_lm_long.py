"""research/lm_long.py: every model of the long-run comparison (CPU and accelerator protocols) gets the same tokens
from the shared recipe with valid settings, and the report computes means and seed spreads from the run records
(fabricated here; the real runs take hours)."""

import dataclasses
import json
import os

import pytest

from research import common
from research import lm_long as L
from training import train as T


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


def _parse(cmd):
    argv = cmd[cmd.index("training.train") + 1 :]
    model_args, data_args, train_args = T.parse_args(argv)
    config = T.build_config(model_args)
    T.check_run(data_args, config)  # e.g. Transformer-XL: segments of its window
    return model_args, data_args, train_args, config


@pytest.mark.parametrize("proto", [L.CPU, L.GPU], ids=lambda p: p.name)
@pytest.mark.parametrize("model", L.LONG_MODELS)
def test_every_model_gets_the_same_tokens_and_a_valid_config(proto, model, tmp_path):
    proto = dataclasses.replace(proto, out=tmp_path)
    cmd = L.train_command(model, seed=1, steps=proto.steps, bf16=True, proto=proto)
    model_args, data_args, train_args, config = _parse(cmd)
    assert train_args.per_device_train_batch_size * data_args.seq_len == proto.tokens_per_step
    assert train_args.max_steps == proto.steps and train_args.seed == 1 and train_args.bf16
    assert train_args.save_steps == proto.save_every and str(train_args.output_dir).startswith(str(tmp_path))
    if model == "trsf-xl":  # its window is its segment
        assert data_args.seq_len == config.block_len == proto.xl_window and data_args.stream_segments
    else:  # L / W = 8 as in the paper
        assert data_args.seq_len == proto.seq_len == 8 * config.block_len
    assert data_args.stream_segments == (model in ("trsf-xl", "brect-fixed-skip"))
    assert max(proto.lengths) == 16 * proto.seq_len and min(proto.lengths) * 8 == proto.seq_len
    if proto.name == "gpu":
        assert config.hidden_size == 512 and config.num_hidden_layers == 8
        preset = json.loads((L.ROOT / "training" / "presets" / f"{L.LM.MODELS[model][0]}.json").read_text())
        for key in L.LAYER_INDEX_FIELDS:  # the tiny layouts, spread over twice the layers
            assert list(getattr(config, key, None) or []) == [2 * i for i in preset.get(key) or []]
    else:
        assert config.hidden_size == 128 and config.num_hidden_layers == 4
    # a variant's own override survives the protocol's size overrides
    assert config.mf_independent_filters == (model == "bst-mf-s4-indep")


def _record(model, seed, bpb, proto=L.CPU):
    rows = [{"length": n, "bits_per_byte": bpb + 0.01 * i, "ppl_token": 2**bpb} for i, n in enumerate(proto.lengths)]
    curve = [{"step": s, "tokens": s * 2048, "bits_per_byte": bpb + 1.0 / s} for s in (500, 1000, 1500)]
    return {
        "corpus": L.CORPUS, "model": model, "label": L.LM.LABELS[model], "seed": seed, "steps": 1500,
        "tokens": 1500 * 2048, "parameters": 1_300_000, "final_train_loss": 4.5 + seed, "learning_curve": curve,
        "results": rows, "dataset": {"documents": 2, "max_tokens_per_doc": 65536},
    }  # fmt: skip


def test_report_means_spreads_and_relative_change(tmp_path):
    results = tmp_path / "records"
    results.mkdir()
    for model, seed, bpb in [("slide", 0, 2.0), ("slide", 1, 2.2), ("bst-sh-s4", 0, 1.9), ("bst-sh-s4", 1, 1.9)]:
        (results / f"{model}-s{seed}.json").write_text(json.dumps(_record(model, seed, bpb)))
    summary = L.summarise(L.load_records(results))
    assert summary["slide"]["seeds"] == [0, 1]
    assert summary["slide"]["lengths"][512]["bpb_mean"] == pytest.approx(2.11)
    assert summary["slide"]["lengths"][512]["bpb_spread"] == pytest.approx(0.2)
    assert summary["bst-sh-s4"]["lengths"][64]["bpb_spread"] == pytest.approx(0.0)
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()
    text = L.report(results, docs)
    # BST at L=512: 1.91 vs Slide's mean 2.11 -> -9.5%; half the seed spread shown as ±.
    assert "| BST:SH:S4 | 1.30M | 0,1 | " in text and "1.9100 ±0.0000 (-9.5%)" in text
    assert "2.1100 ±0.1000 |" in text
    assert "<!-- lm_long:start -->" in docs.read_text()
    assert (docs.parent / "results" / "lm_long.png").stat().st_size > 0


def test_report_adds_the_validation_selected_table(tmp_path):
    """Records with a checkpoint selection get a second table (test bits per byte at the selected checkpoint, each
    seed's step) and a third plot panel; records without one stay out of that table."""
    results = tmp_path / "records"
    results.mkdir()
    for model, seed, bpb, picked, step in [
        ("slide", 0, 2.0, 1.9, 1000), ("slide", 1, 2.2, 2.1, 1500), ("bst-sh-s4", 0, 1.9, 1.8, 500),
        ("gss-hybrid", 0, 2.5, None, None),
    ]:  # fmt: skip
        record = _record(model, seed, bpb)
        if picked is not None:
            record["selected_results"] = _record(model, seed, picked)["results"]
            record["selected_step"] = step
            record["validation_curve"] = [{"step": s, "bits_per_byte": 2.0 + abs(s - step) / 1e4} for s in (500, 1000, 1500)]  # fmt: skip
        (results / f"{model}-s{seed}.json").write_text(json.dumps(record))
    chosen = L.summarise(L.load_records(results), key="selected_results")
    assert set(chosen) == {"slide", "bst-sh-s4"} and chosen["slide"]["selected_steps"] == [1000, 1500]
    assert chosen["slide"]["lengths"][512]["bpb_mean"] == pytest.approx(2.01)
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()
    text = L.report(results, docs)
    final, selected = text.split("lowest validation bits per byte")
    assert "| GSS-Hybrid |" in final and "| GSS-Hybrid |" not in selected
    # BST at L=512: 1.81 vs Slide's selected mean 2.01 -> -10.0%
    assert "| Slide:4L | 1.30M | 0,1 | 1000,1500 | 2.0000 ±0.1000 | 2.0100 ±0.1000 |" in selected
    assert "| BST:SH:S4 | 1.30M | 0 | 500 | 1.8000 (-10.0%) | 1.8100 (-10.0%) |" in selected
    assert (docs.parent / "results" / "lm_long.png").stat().st_size > 0


def test_report_books_one_by_one_and_final_selection_note(tmp_path):
    """When early stopping keeps every final checkpoint the report says so instead of repeating the table; each
    held-out book gets its own column, paired with the Slide run of the same seed."""
    results = tmp_path / "records"
    results.mkdir()
    for model, seed, bpb in [("slide", 0, 2.0), ("slide", 1, 2.2), ("bst-sh-s4", 0, 1.9), ("bst-sh-s4", 1, 2.31)]:
        record = _record(model, seed, bpb)
        record.update(selected_results=record["results"], selected_step=1500, validation_curve=[{"step": 1500, "bits_per_byte": 1.0}])  # fmt: skip
        record["per_book"] = [
            {"title": t, "split": sp, "results": [{"length": n, "bits_per_byte": bpb + k + n / 1e5} for n in (512, 8192)]}
            for k, (t, sp) in enumerate([("Persuasion", "test"), ("Northanger Abbey", "validation")])
        ]  # fmt: skip
        (results / f"{model}-s{seed}.json").write_text(json.dumps(record))
    # a later record also scores an unseen book: its columns appear, earlier records show a dash there
    record = json.loads((results / "bst-sh-s4-s1.json").read_text())
    record["per_book"].append({"title": "Psalms", "split": "unseen", "results": [{"length": n, "bits_per_byte": 3.5} for n in (512, 8192)]})  # fmt: skip
    (results / "bst-sh-s4-s1.json").write_text(json.dumps(record))
    text = L.report(results, None)
    assert "lowest validation bits per byte" not in text and "selects the final checkpoint of every run" in text
    assert "| run | Persuasion (test) L=512 | Persuasion (test) L=8192 | Northanger Abbey (validation) L=512 |" in text
    assert "Northanger Abbey (validation) L=8192 | Psalms (unseen) L=512 | Psalms (unseen) L=8192 |" in text
    assert "| Slide:4L s0 | 2.0051 | 2.0819 | 3.0051 | 3.0819 | – | – |" in text
    # BST seed 1 against Slide seed 1: 2.31512 / 2.20512 - 1 = +5.0%
    assert "| BST:SH:S4 s1 | 2.3151 (+5.0%) |" in text and "| 3.5000 | 3.5000 |" in text


def _held_out_fixture(tmp_path, monkeypatch):
    """A prepared `books` corpus (2 test books, 1 validation book) and `allbooks` training split holding the unseen
    book, under a temporary work folder; model loading and evaluation replaced by a recorder of what gets scored."""
    data = tmp_path / "work" / "data"
    for name, split, titles in [("books", "test", ["Persuasion", "sherlock-holmes"]),
                                ("books", "validation", ["Northanger Abbey"]),
                                ("allbooks", "train", ["Emma", "treasury-of-david"])]:  # fmt: skip
        (data / name).mkdir(parents=True, exist_ok=True)
        rows = [json.dumps({"title": t, "text": f"text of {t}"}) for t in titles]
        (data / name / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(L.LM, "WORK", tmp_path / "work")
    scored = []

    class _Model:
        def to(self, device):
            return self

    def fake_eval(model, tokenizer, texts, lengths, max_tokens_per_doc):
        scored.append(texts[0])
        return [{"length": n, "bits_per_byte": len(texts[0]) / 10, "tokens": max_tokens_per_doc} for n in lengths]

    import modeling_bst
    import training.data
    import training.evaluate

    monkeypatch.setattr(modeling_bst.BSTForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: _Model()))
    monkeypatch.setattr(training.data, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(training.evaluate, "evaluate_model", fake_eval)
    return scored


def test_held_out_books_adds_the_unseen_book_and_scores_only_what_is_missing(tmp_path, monkeypatch):
    scored = _held_out_fixture(tmp_path, monkeypatch)
    out = tmp_path / "per_book.json"
    books = L.held_out_books(tmp_path / "ckpt", "books", [512, 8192], 100, output=out)
    assert [(b["title"], b["split"]) for b in books] == [
        ("Persuasion", "test"), ("sherlock-holmes", "test"), ("Northanger Abbey", "validation"),
        ("treasury-of-david", "unseen"),
    ]  # fmt: skip
    assert scored == ["text of Persuasion", "text of sherlock-holmes", "text of Northanger Abbey", "text of treasury-of-david"]  # fmt: skip
    assert json.loads(out.read_text())["eval_tokens"] == 100
    # an older file without the unseen book: only that book is scored, the others are kept as they were
    saved = json.loads(out.read_text())
    saved["books"] = saved["books"][:3]
    out.write_text(json.dumps(saved))
    scored.clear()
    assert L.held_out_books(tmp_path / "ckpt", "books", [512, 8192], 100, output=out) == books
    assert scored == ["text of treasury-of-david"]
    # the same call again scores nothing; other tokens, lengths or another checkpoint score everything again
    scored.clear()
    L.held_out_books(tmp_path / "ckpt", "books", [512, 8192], 100, output=out)
    assert scored == []
    for kwargs in ({"eval_tokens": 200}, {"lengths": [512]}, {"model_dir": tmp_path / "other"}):
        args = {"model_dir": tmp_path / "ckpt", "lengths": [512, 8192], "eval_tokens": 100, **kwargs}
        scored.clear()
        L.held_out_books(args["model_dir"], "books", args["lengths"], args["eval_tokens"], output=out)
        assert len(scored) == 4, kwargs
    # a corpus without unseen books scores its own three
    scored.clear()
    (tmp_path / "work" / "data" / "allbooks" / "test.jsonl").write_text((tmp_path / "work" / "data" / "books" / "test.jsonl").read_text())  # fmt: skip
    (tmp_path / "work" / "data" / "allbooks" / "validation.jsonl").write_text((tmp_path / "work" / "data" / "books" / "validation.jsonl").read_text())  # fmt: skip
    assert [b["split"] for b in L.held_out_books(tmp_path / "ckpt", "allbooks", [512], 100)] == ["test", "test", "validation"]  # fmt: skip


def test_held_out_books_names_the_missing_corpus(tmp_path, monkeypatch):
    _held_out_fixture(tmp_path, monkeypatch)
    import shutil

    shutil.rmtree(tmp_path / "work" / "data" / "allbooks")
    with pytest.raises(FileNotFoundError, match="prepare --corpora allbooks"):
        L.held_out_books(tmp_path / "ckpt", "books", [512], 100)


def test_best_checkpoint_is_the_lowest_validation_score_latest_on_ties():
    curve = [{"step": 500, "bits_per_byte": 2.0}, {"step": 1000, "bits_per_byte": 1.8}, {"step": 1500, "bits_per_byte": 1.8}]  # fmt: skip
    assert L.best_checkpoint(curve)["step"] == 1500
    assert L.best_checkpoint(curve[:2])["step"] == 1000
    with pytest.raises(ValueError, match="no complete checkpoint"):
        L.best_checkpoint([])


def test_protocol_folders_stay_apart(tmp_path):
    gpu = dataclasses.replace(L.GPU, out=tmp_path)
    assert L.CPU.results.name == "lm_long" and L.GPU.results.name == "lm_long_gpu"
    assert gpu.results.is_relative_to(tmp_path) and gpu.work.is_relative_to(tmp_path)
    assert gpu.docs == tmp_path / "docs" / "results.md" and L.GPU.section == "lm_long_gpu"


@pytest.mark.slow
def test_gpu_protocol_dry_run_on_cpu():
    """`bash research/gpu_quality.sh --dry-run`: the accelerator protocol end to end on the CPU at 2 steps (one model
    here; the script's default dry run also covers Transformer-XL): training, learning curve, evaluation, record, report."""
    import subprocess

    out = subprocess.run(
        ["bash", str(L.ROOT / "research" / "gpu_quality.sh"), "--dry-run", "--models", "bst-sh-s4"],
        capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    folder = out.stdout.strip().splitlines()[-1].split("dry run complete: ")[1]
    record = json.loads((L.Path(folder) / "research" / "results" / "lm_long_gpu" / "bst-sh-s4-s0.json").read_text())
    assert record["protocol"] == "gpu" and record["steps"] == 2 and record["parameters"] > 20e6
    assert [r["length"] for r in record["results"]] == list(L.GPU.lengths)
    assert record["learning_curve"][-1]["step"] == 2


def test_labels_name_the_protocols_depth():
    """The tiny presets' Slide:4L has 8 layers under the accelerator protocol, and its tables say so."""
    assert L.label("slide", L.CPU) == "Slide:4L"
    assert L.label("slide", L.GPU) == "Slide:8L"
    assert L.label("bst-sh-s4", L.GPU) == "BST:SH:S4"


def test_a_stated_source_commit_names_the_records_commit(monkeypatch):
    """A tree copied to an accelerator machine may carry stale git metadata (the device tool's copy reported the
    session's first commit): BST_SOURCE_COMMIT, where set, is what the records name."""
    monkeypatch.setenv("BST_SOURCE_COMMIT", "0123abc")
    assert common.source_commit() == "0123abc"
    monkeypatch.delenv("BST_SOURCE_COMMIT")
    assert common.source_commit() != "0123abc"


def test_the_selected_final_checkpoint_reuses_the_final_evaluation(tmp_path):
    """When the last checkpoint is selected it is the final model (checkpoints carry use_cache=False, final True):
    its test scores are copied from eval.json instead of scored again; a changed weight, another span, lengths or
    device score it anew."""
    import torch
    from conftest import make_model

    run, lengths = tmp_path / "run", [64, 512]
    model = make_model("sh-s4")
    model.config.use_cache = False
    model.save_pretrained(run / "checkpoint-8")
    model.config.use_cache = True
    model.save_pretrained(run / "final")
    report = {
        "dataset": {"split": "test", "max_tokens_per_doc": 256},
        "settings": {"lengths": lengths, "device": "cpu"},
        "models": [{"path": str(run / "final"), "results": [{"length": n, "bits_per_byte": 2.0} for n in lengths]}],
    }
    (run / "eval.json").write_text(json.dumps(report))
    out, ckpt = run / "eval_selected.json", run / "checkpoint-8"
    for other in ((128, lengths, "cpu"), (256, [64], "cpu"), (256, lengths, "cuda")):
        assert not L.reuse_final_evaluation(run, ckpt, out, *other) and not out.exists(), other
    assert L.reuse_final_evaluation(run, ckpt, out, 256, lengths, "cpu")
    copied = json.loads(out.read_text())
    assert (
        copied["models"][0]["path"] == str(ckpt) and copied["models"][0]["results"] == report["models"][0]["results"]
    )
    out.unlink()
    with torch.no_grad():
        next(model.parameters()).add_(1e-6)
    model.config.use_cache = False
    model.save_pretrained(ckpt)
    assert not L.same_model(ckpt, run / "final")
    assert not L.reuse_final_evaluation(run, ckpt, out, 256, lengths, "cpu") and not out.exists()


@pytest.mark.slow
def test_gpu_sitting_dry_run_packs_its_results_and_kills_only_its_own_runs(tmp_path):
    """`bash scripts/gpu_sitting.sh --dry-run`: an LM run stopped at its deadline, the tests part and the packed
    archive; a process elsewhere on the machine whose command line looks like an LM run survives (an earlier version
    ended the sitting with a pkill that also stopped this machine's own background trainings)."""
    import subprocess
    import tarfile

    bystander = subprocess.Popen(["bash", "-c", "exec -a 'python -m research.lm_quality bystander' sleep 600"])
    try:
        out = subprocess.run(
            ["bash", str(L.ROOT / "scripts" / "gpu_sitting.sh"), "--dry-run", "--parts", "tests quality",
             "--models", "bst-sh-s4", "--deadline", "25", "--total", "300", "--state", str(tmp_path / "state.txt")],
            capture_output=True, text=True, timeout=900, env={**os.environ, "OUT": str(tmp_path)},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert bystander.poll() is None, "the sitting killed a process it did not start"
    finally:
        bystander.kill()
    assert "quality rc 124" in (tmp_path / "quality-bst-sh-s4.log").read_text()  # stopped at its 25 s deadline
    assert "quality:bst-sh-s4-s0" not in (tmp_path / "gpu_sitting_state.txt").read_text()  # not finished: not done
    assert "tests: ok" in (tmp_path / "tests.log").read_text()
    with tarfile.open(tmp_path / "results.tgz") as tar:
        assert any(n.endswith("gpu_suite.json") for n in tar.getnames())
