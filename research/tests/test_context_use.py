"""research/context_use.py: the context-state ablation swaps or zeroes exactly the BST layers' context states, and
leaves the model as it was afterwards."""

import json

import pytest
import torch
from conftest import make_model

from research import context_use as C


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("variant", ["sh-s4", "mh-s4", "mf-s4", "sh-unstruct"])
def test_shuffled_and_zeroed_context(variant):
    model = make_model(variant)
    w = model.config.block_len
    torch.manual_seed(1)
    a, b = torch.randint(0, 97, (2, 16)).unbind(0)
    pair, same = torch.stack([a, b]), torch.stack([a, a])
    normal = _logits(model, pair)
    with C.ablate_context(model, "shuffled") as n:
        assert n == 2  # bst_layer_indices [0, 2]
        shuffled = _logits(model, pair)
        # identical windows: rolling their states over the batch changes nothing
        torch.testing.assert_close(_logits(model, same), _logits(make_model(variant), same), rtol=0, atol=0)
    assert (shuffled[:, w:] - normal[:, w:]).abs().amax() > 1e-4
    # window a reads window b's states: changing b's tokens changes a's shuffled logits, never its normal ones
    b2 = b.clone()
    b2[: 2 * w] = (b2[: 2 * w] + 1) % 97
    pair2 = torch.stack([a, b2])
    torch.testing.assert_close(_logits(model, pair2)[0], normal[0], rtol=0, atol=0)
    with C.ablate_context(model, "shuffled"):
        assert (_logits(model, pair2)[0] - shuffled[0]).abs().amax() > 1e-4
    with C.ablate_context(model, "zeroed"):
        zeroed = _logits(model, pair)
    assert (zeroed[:, w:] - normal[:, w:]).abs().amax() > 1e-4
    # the patches are gone afterwards
    torch.testing.assert_close(_logits(model, pair), normal, rtol=0, atol=0)


def test_models_without_bst_layers_and_bad_modes():
    model = make_model("slide")
    with C.ablate_context(model, "shuffled") as n:
        assert n == 0
    with pytest.raises(ValueError, match="mode must be one of"):
        with C.ablate_context(model, "reversed"):
            pass
    bst = make_model("sh-s4")
    with pytest.raises(ValueError, match="at least 2 windows"):
        with C.ablate_context(bst, "shuffled"):
            _logits(bst, torch.zeros(1, 16, dtype=torch.long))


def test_other_book_batches_pair_every_window_with_another_book():
    win = lambda i: (torch.full((3,), i), torch.full((3,), i + 1))  # noqa: E731
    windows = {"A": (10, [win(0), win(1)]), "B": (12, [win(5), win(6)])}
    other = C.batches_for("other_book", windows, 4)
    assert [[g[0] for g in b] for b in other] == [["A", "B", "A", "B"]]
    rolled = [other[0][(i - 1) % 4][0] for i in range(4)]  # whose states each window gets after roll(1)
    assert all(r != own[0] for r, own in zip(rolled, other[0]))
    same = C.batches_for("shuffled", windows, 2)
    assert [[g[0] for g in b] for b in same] == [["A", "A"], ["B", "B"]]


def test_report_rows(tmp_path):
    row = {"run": "bst-sh-s4-s0", "context_mode": "sh", "bst_layers": 1}
    row.update(
        {m: {"bits_per_byte": v, "books": {"A": v, "B": v + 0.1}} for m, v in zip(C.MODES, (1.80, 1.89, 1.90, 1.98))}
    )
    record = {"corpus": "books", "length": 2048, "batch": 4, "eval_tokens": 65536, "out": "x.json", "rows": [row]}
    docs = tmp_path / "results.md"
    text = C.report(json.loads(json.dumps(record)), docs)
    assert "| bst-sh-s4-s0 | sh | 1 | 1.8000 | +0.0900 (+5.0%) | +0.1000 (+5.6%) | +0.1800 (+10.0%) | " in text
    assert "| 1.8000, 1.8900, 1.9000, 1.9800 | 1.9000, 1.9900, 2.0000, 2.0800 |" in text  # books A and B
    assert "<!-- context_use:start -->" in docs.read_text()


def test_append_replaces_reruns_and_refuses_other_settings():
    base = {"corpus": "books", "length": 2048, "batch": 4, "eval_tokens": 65536, "out": "x.json"}
    old = {**base, "command": "c1", "commit": "a", "rows": [{"run": "r0", "v": 1}, {"run": "r1", "v": 1}]}
    new = {**base, "command": "c2", "commit": "b", "rows": [{"run": "r1", "v": 2}, {"run": "r2", "v": 2}]}
    merged = C.merge_records(old, new)
    assert [(r["run"], r["v"]) for r in merged["rows"]] == [("r0", 1), ("r1", 2), ("r2", 2)]
    assert merged["commands"] == [{"command": "c1", "commit": "a"}, {"command": "c2", "commit": "b"}]
    with pytest.raises(ValueError, match="settings differ in \\['length'\\]"):
        C.merge_records(old, {**new, "length": 512})


def test_a_second_run_joins_the_record_by_default(tmp_path, monkeypatch):
    """The command adds its runs to an existing record (it replaced the whole record before, which lost 15 rows once);
    other settings stop it with a message naming --replace, and --replace starts a new record."""

    def fake_measure(d, corpus, length, batch, eval_tokens):
        return {"run": d.name, "context_mode": "sh", "bst_layers": 1} | {
            m: {"bits_per_byte": 1.8, "books": {"A": 1.8}} for m in C.MODES
        }

    monkeypatch.setattr(C, "measure", fake_measure)
    runs = []
    for name in ("run-a", "run-b"):
        (tmp_path / name / "final").mkdir(parents=True)
        runs.append(str(tmp_path / name))
    out, docs = tmp_path / "record.json", tmp_path / "results.md"
    common = ["--out", str(out), "--docs", str(docs)]
    C.main([runs[0], *common])
    C.main([runs[1], *common])
    assert [r["run"] for r in json.loads(out.read_text())["rows"]] == ["run-a", "run-b"]
    with pytest.raises(SystemExit, match="--replace"):
        C.main([runs[1], *common, "--length", "512"])
    C.main([runs[1], *common, "--length", "512", "--replace"])
    record = json.loads(out.read_text())
    assert record["length"] == 512 and [r["run"] for r in record["rows"]] == ["run-b"]
