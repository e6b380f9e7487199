"""The `evaluate` metric module metrics/bits_per_byte: loaded offline with evaluate.load from the repository root, it
gives exactly training.evaluate's numbers (one code path) for a saved folder and for a loaded model."""

import json
import math

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTForCausalLM
from training import data as D
from training import evaluate as E


evaluate = pytest.importorskip("evaluate")

TEXT = (
    "The block-state transformer reads long documents. State space layers carry context from block to block, "
    "and attention looks inside each block. Ünïcödé bytes count as bytes: ½ ≠ 2.\n"
)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny BST with its own small tokenizer, saved as a folder (model + tokenizer) and written as a pg19-style
    corpus folder for the CLI."""
    root = tmp_path_factory.mktemp("bpb")
    tok = D.train_bpe_tokenizer([TEXT * 20], vocab_size=300)
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=256)).eval()
    folder = root / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    texts = [TEXT * 3, TEXT[:70], TEXT * 2 + "the end"]
    (root / "corpus" / "validation").mkdir(parents=True)
    for i, text in enumerate(texts):
        (root / "corpus" / "validation" / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return folder, texts, root


def _load_metric(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    monkeypatch.chdir(E.Path(__file__).resolve().parents[2])  # the repository root
    return evaluate.load("metrics/bits_per_byte")


def test_metric_equals_training_evaluate(saved_model, monkeypatch, tmp_path):
    folder, texts, root = saved_model
    metric = _load_metric(monkeypatch)
    lengths = [16, 40]
    out = metric.compute(predictions=texts, model=str(folder), lengths=lengths)

    report = E.main(
        ["--model", str(folder), "--lengths", *map(str, lengths), "--dataset", "pg19"]
        + ["--dataset_path", str(root / "corpus"), "--split", "validation", "--output", str(tmp_path / "e.json")]
    )
    cli_texts = D.texts_of(D.load_documents("pg19", "validation", path=str(root / "corpus")))
    assert sorted(cli_texts) == sorted(texts)
    cli = json.loads((tmp_path / "e.json").read_text())["models"][0]["results"]
    assert report["models"][0]["results"] == cli
    assert out["lengths"] == lengths
    for i, row in enumerate(cli):
        mine = out["results"][i]
        # Document order changes only the float summation order of the NLL.
        assert math.isclose(mine["nll_sum"], row["nll_sum"], rel_tol=1e-12)
        for key in ("tokens", "bytes", "words", "windows", "documents"):
            assert mine[key] == row[key]
        assert math.isclose(out["bits_per_byte"][i], row["bits_per_byte"], rel_tol=1e-12)
        assert math.isclose(out["ppl_token"][i], row["ppl_token"], rel_tol=1e-12)
        assert row["bytes"] == sum(len(t.encode("utf-8")) for t in texts) > sum(len(t) for t in texts)
        assert 0 < row["bits_per_byte"] and row["ppl_token"] > 1


def test_metric_with_loaded_model_is_the_library_result(saved_model, monkeypatch):
    folder, texts, _ = saved_model
    model, tok = E.load_model(str(folder))
    metric = _load_metric(monkeypatch)
    out = metric.compute(predictions=texts, model=model, tokenizer=tok, lengths=24, max_tokens_per_doc=30)
    rows = E.evaluate_model(model, tok, texts, [24], max_tokens_per_doc=30)
    for key in ("nll_sum", "tokens", "bytes", "words", "windows"):
        assert out["results"][0][key] == rows[0][key]
    assert out["bits_per_byte"] == [rows[0]["bits_per_byte"]] and out["lengths"] == [24]
    with pytest.raises(ValueError, match="tokenizer"):
        metric.compute(predictions=texts, model=model, lengths=24)
