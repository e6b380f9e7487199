"""MQAR (experiments/mqar.py): the generator's format, that the queries really lie beyond a Slide stack's reach, and
the whole pipeline (runs -> JSON records -> report section) at toy size."""

import json

import pytest
import torch

from experiments import mqar


@pytest.mark.parametrize("length,pairs,gap", [(64, 4, 16), (256, 16, 128), (512, 64, 128), (40, 8, 8)])
def test_generator_format(length, pairs, gap):
    ids, labels, query_pos = mqar.make_batch(32, length, pairs, gap, torch.Generator().manual_seed(1))
    keys, values = range(1, 65), range(65, 129)
    assert ids.shape == labels.shape == (32, length) and query_pos.shape == (32, pairs)
    for b in range(32):
        row = ids[b].tolist()
        pair_keys, pair_values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert len(set(pair_keys)) == pairs and all(k in keys for k in pair_keys)
        assert all(v in values for v in pair_values)
        table = dict(zip(pair_keys, pair_values))
        q = sorted(query_pos[b].tolist())
        assert q[0] >= 2 * pairs + gap and q[-1] + 1 < length
        assert all(b2 - a >= 2 for a, b2 in zip(q, q[1:]))  # slots do not overlap
        assert sorted(row[p] for p in q) == sorted(pair_keys)  # every key queried exactly once
        for p in q:
            assert row[p + 1] == table[row[p]] == labels[b, p + 1].item()
        scored = (labels[b] != -100).nonzero().flatten().tolist()
        assert scored == [p + 1 for p in q]  # only the values of the queries are scored
        others = set(range(2 * pairs, length)) - set(q) - {p + 1 for p in q}
        assert all(row[i] == mqar.FILLER for i in others)


def test_generator_rejects_impossible_layouts():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="too short"):
        mqar.make_batch(2, 256, 64, 128, g)
    with pytest.raises(ValueError, match="keys"):
        mqar.make_batch(2, 512, 65, 0, g)


def _embedding_grad(model_name: str, layers: int = 2, block_len: int = 8, length: int = 96, pairs: int = 8):
    """|d (scored logits) / d (embeddings)| `(B, L)` at every position, for a small model with the default gap
    (layers * W); also the number of pairs and the query positions."""
    torch.manual_seed(0)
    gap = layers * block_len
    config = mqar.build_config(model_name, 32, layers, block_len, length, mqar.vocab_size(64, 64))
    model = mqar.build_model(config, model_name)
    ids, labels, query_pos = mqar.make_batch(2, length, pairs, gap, torch.Generator().manual_seed(0))
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["emb"] = output

    model.get_input_embeddings().register_forward_hook(keep)
    logits = model(ids).logits
    rows = torch.arange(2)[:, None]
    logits[rows, query_pos].sum().backward()
    return captured["emb"].grad.abs().sum(-1), pairs, query_pos


def test_queries_lie_beyond_the_slide_receptive_field():
    # Slide (2 layers, W = 8): the scored logits do not depend on the key-value pairs at all, so Slide is at chance
    # by construction; a BST layer's SSM (and Mamba's scan) reaches them.
    grad, pairs, query_pos = _embedding_grad("slide")
    assert torch.all(grad[:, : 2 * pairs] == 0)
    assert torch.all(grad.gather(1, query_pos) > 0)  # sanity: the gradient does reach the queried keys
    for name in ("bst-sh-s4", "mamba"):
        grad, pairs, _ = _embedding_grad(name)
        assert torch.all(grad[:, : 2 * pairs].sum(-1) > 0), name


def test_layer_layouts_of_the_presets_scale_with_depth():
    assert mqar.build_config("bst-sh-s4", 64, 4, 32, 256, 129)["bst_layer_indices"] == [0, 2]
    assert mqar.build_config("gss-hybrid", 64, 4, 32, 256, 129)["gss_layer_indices"] == [0, 2, 3]
    assert mqar.build_config("brect", 64, 2, 32, 256, 129)["recurrent_layer_indices"] == [1]
    cfg = mqar.build_config("bst-mf-s4", 96, 3, 16, 512, 129)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["block_len"], cfg["head_dim"]) == (96, 3, 16, 24)


def test_pipeline_at_toy_size(tmp_path):
    out = tmp_path / "runs"
    argv = ["--models", "slide", "bst-sh-s4", "--lengths", "64", "--pairs-at-lengths", "4", "--pairs", "2", "4"]
    argv += ["--length-for-pairs", "64", "--steps", "3", "--batch-size", "2", "--layers", "2", "--block-len", "8"]
    argv += ["--output", str(out), "--no-report"]
    mqar.main(argv)
    files = sorted(p.name for p in out.glob("*.json"))
    assert files == [f"{m}-L64-N{n}-3x2-s0.json" for m in ("bst-sh-s4", "slide") for n in (2, 4)]
    record = json.loads((out / "slide-L64-N4-3x2-s0.json").read_text())
    assert record["command"].startswith("python -m experiments.mqar --models slide bst-sh-s4")
    assert 0.0 <= record["accuracy"] <= 1.0 and record["settings"]["gap"] == 16
    assert record["settings"]["examples"] == 6 and len(record["train_losses"]) == 1
    # Resumable: a second invocation finds every run done and trains nothing.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    mqar.main(argv)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before
    docs = tmp_path / "results.md"
    docs.write_text("# Results\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    text = mqar.report(out, docs, length_for_pairs=64, pairs_at_lengths=4)
    written = docs.read_text()
    assert "<!-- mqar:start -->" in written and "kept" in written and (tmp_path / "results" / "mqar.png").exists()
    slide_row = next(line for line in text.splitlines() if line.startswith("| Slide |"))
    assert f"{100 * record['accuracy']:.1f}" in slide_row and "L=64 N=2" in text
