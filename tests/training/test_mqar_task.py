"""training.tasks.mqar: MQAR as an evaluation task of the package (``python -m training.evaluate --task mqar``), the
generator and scorer that research/mqar.py trains and reports with."""

import json

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTForCausalLM
from training import evaluate as E
from training.tasks import mqar as MQ


def _saved(tmp_path, vocab=17):  # MQ.vocab_size(8, 8)
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(vocab_size=vocab, max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def test_task_mqar_scores_held_out_cells_and_the_lm_task_stays_the_default(tmp_path):
    model, path = _saved(tmp_path)
    out = tmp_path / "mqar.json"
    argv = ["--task", "mqar", "--model", str(path), "--lengths", "48", "64", "--num_pairs", "2", "4"]
    argv += ["--num_keys", "8", "--num_values", "8", "--examples", "12", "--device", "cpu", "--output", str(out)]
    report = E.main(argv)
    assert json.loads(out.read_text()) == report and report["task"] == "mqar"
    rows = report["models"][0]["results"]
    assert [(r["length"], r["num_pairs"]) for r in rows] == [(48, 2), (48, 4), (64, 2), (64, 4)]
    gap = MQ.default_gap(model.config)
    assert gap == model.config.num_hidden_layers * model.config.block_len and all(r["gap"] == gap for r in rows)
    # the numbers are the scorer's on the held-out stream of seed 0
    ids, labels, _ = MQ.make_batch(12, 64, 4, gap, MQ.held_out_generator(0), num_keys=8, num_values=8)
    assert (rows[-1]["accuracy"], rows[-1]["loss"]) == pytest.approx(MQ.score(model, ids, labels))
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["chance"] == 1 / 8 for r in rows)
    # a cell that does not fit, and a vocabulary too small for the keys and values, are rows with an error
    bad = E.main([*argv[:-2], "--lengths", "16", "--output", str(tmp_path / "bad.json")])["models"][0]["results"]
    assert all("too short" in r["error"] for r in bad)
    big = E.main([*argv[:-2], "--num_keys", "40", "--output", str(tmp_path / "big.json")])["models"][0]["results"]
    assert all("tokens; the model has" in r["error"] for r in big)


def test_without_task_the_lm_evaluation_runs(monkeypatch, tmp_path):
    def documents(*args, **kwargs):
        raise RuntimeError("the lm task loads documents")

    monkeypatch.setattr(E.D, "load_documents", documents)
    with pytest.raises(RuntimeError, match="the lm task"):
        E.main(["--model", "m", "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        E.main(["--task", "listops", "--model", "m", "--output", str(tmp_path / "x.json")])


def test_research_mqar_trains_and_reports_with_the_task():
    from research import mqar

    assert mqar.make_batch is MQ.make_batch and mqar.evaluate is MQ.score and mqar.FILLER == MQ.FILLER
