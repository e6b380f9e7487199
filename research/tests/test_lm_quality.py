"""research/lm_quality.py: every model of the comparison trains from the shared recipe, and the report computes
its table from the run JSONs (fabricated here; the real runs take about an hour)."""

import json
import os

import pytest

from research import lm_quality as Q
from training import train as T


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


@pytest.mark.parametrize("name", list(Q.MODELS))
def test_every_model_parses_with_the_shared_recipe(name, tmp_path):
    preset, extra = Q.MODELS[name]
    argv = ["--config", str(Q.RECIPE), "--model_config", preset, "--output_dir", str(tmp_path), *extra]
    model_args, data_args, train_args = T.parse_args(argv)
    config = T.build_config(model_args)
    T.check_run(data_args, config)  # e.g. Transformer-XL: segments of its window
    if name == "bst-sh-unstruct-smooth":  # the MQAR fix: slow sines, a weak envelope; the preset's layout otherwise
        assert (config.unstruct_sin_freq, config.unstruct_decay_target) == (1, 0.5)
        assert config.bst_layer_indices == T.build_config(T.parse_args(argv[:6])[0]).bst_layer_indices
    assert model_args.model_config == preset
    assert data_args.stream_segments == ("--stream_segments" in extra)
    # The same tokens a step for every model: 4 x 512 (Transformer-XL: 8 x 256, its window).
    assert train_args.max_steps > 0 and train_args.per_device_train_batch_size * data_args.seq_len == 4 * 512
    assert data_args.seq_len == (256 if name == "trsf-xl" else 512)
    if "unstruct" in name:  # filters must exist at 16x the training length to be evaluated there
        assert json.loads(model_args.model_overrides)["max_position_embeddings"] >= max(Q.LENGTHS)
    assert max(Q.LENGTHS) == 16 * 512 and min(Q.LENGTHS) * 8 == 512


def test_cap_train_keeps_whole_documents_up_to_the_budget():
    rows = [{"text": "x" * n} for n in (40, 30, 50, 10)]
    assert [len(r["text"]) for r in Q._cap_train(rows, 75)] == [40, 30]
    assert [len(r["text"]) for r in Q._cap_train(rows, 10)] == [40]  # never empty


def _fake(corpus, model, bpb):
    rows = [{"length": n, "bits_per_byte": bpb + 0.01 * i, "ppl_token": 10 * bpb} for i, n in enumerate(Q.LENGTHS)]
    return {
        "corpus": corpus,
        "model": model,
        "label": Q.LABELS[model],
        "seed": 0,
        "parameters": 1_500_000,
        "train": {"steps": 700, "seconds_per_step": 0.5},
        "results": rows,
    }


def test_report_table_relative_to_slide(tmp_path):
    res = tmp_path / "runs"
    res.mkdir()
    for model, bpb in (("slide", 2.0), ("bst-sh-s4", 1.8)):
        (res / f"books-{model}.json").write_text(json.dumps(_fake("books", model, bpb)))
    # The 1x column is L=512, the second evaluation length: 2.01 (Slide) vs 1.81 (BST) -> -10.0%.
    docs = tmp_path / "results.md"
    docs.write_text("# Results\n")
    text = Q.report(res, docs)
    row = next(line for line in text.splitlines() if line.startswith("| BST:SH:S4 | 1.50M"))
    assert "1.8100 (-10.0%)" in row and "18.00" in row and row.count("–") == 4  # latex and code not run
    assert "| Slide:4L | 1.50M | 2.0100 |" in text
    assert (tmp_path / "results" / "lm_quality.png").stat().st_size > 0
    assert "<!-- lm_quality:start -->" in docs.read_text() and "# Results" in docs.read_text()
    gen = next(line for line in text.splitlines() if line.startswith("| BST:SH:S4 | books |"))
    assert gen.split("|")[3:7] == [" 1.8000 ", " 1.8100 ", " 1.8200 ", " 1.8300 "]


def test_report_ablation_table(tmp_path):
    res = tmp_path / "runs"
    res.mkdir()
    for model, bpb in (("bst-sh-s4", 1.8), ("bst-sh-s4-n8", 1.9)):
        (res / f"books-{model}.json").write_text(json.dumps(_fake("books", model, bpb)))
    text = Q.report(res, None)
    assert "| ssm_state_size | books | BST:SH:S4 N=8 | 1.9100 | 1.9300 | 0.50 |" in text
    assert "N=8 | 1.50M" not in text  # ablations stay out of the main table
