"""research/token_losses.py: per-token losses that add up to training.evaluate's numbers, and a comparison whose
token classes split the whole difference between two models."""

import json
import math

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import save_file

from modeling_bst import BSTForCausalLM
from research import lm_long
from research import token_losses as TL
from training import data as D
from training import evaluate as E


TEXT = (
    "Holmes looked at Watson across the room.\nThe fire was low, and the rain beat on the windows of Baker Street.\n"
    "Watson said nothing for a while; Holmes filled his pipe.\n"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    tok = D.train_bpe_tokenizer([TEXT * 20], vocab_size=300)
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=256)).eval()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model", tok, model


def test_token_losses_add_up_to_the_evaluation(saved, monkeypatch, tmp_path):
    folder, tok, model = saved
    books = [("test", "A Book", TEXT * 4), ("validation", "Other", TEXT[:90])]
    monkeypatch.setattr(lm_long, "_scored_books", lambda corpus: iter(books))
    # two window lengths from one model load: one file each
    metas = TL.dump(folder, "toy", [24, 16], 60, str(tmp_path / "a-L{length}.safetensors"))
    for meta, length in zip(metas, (24, 16)):
        meta2, tensors = TL.load(tmp_path / f"a-L{length}.safetensors")
        assert meta == meta2 and meta["block_len"] == model.config.block_len and meta["length"] == length
        for book, (_, _, text) in zip(meta["books"], books):
            row = E.evaluate_model(model, tok, [text], [length], max_tokens_per_doc=60)[0]
            nll = tensors[f"{book['key']}.nll"].double()
            assert nll.numel() == row["tokens"] and math.isclose(float(nll.sum()), row["nll_sum"], rel_tol=1e-5)
            assert book["bytes"] == row["bytes"]
            assert math.isclose(book["bits_per_byte"], row["bits_per_byte"], rel_tol=1e-5)
    with pytest.raises(ValueError, match="must hold '{length}'"):
        TL.dump(folder, "toy", [24, 16], 60, str(tmp_path / "a.safetensors"))


def _dump(path, ids, nll, length=12, block_len=2, eval_tokens=100):
    meta = {"format": TL.FORMAT, "corpus": "toy", "length": length, "eval_tokens": eval_tokens,
            "block_len": block_len, "books": [{"title": "Book", "key": "book", "split": "test", "bytes": 50,
                                               "bits_per_byte": float(sum(nll)) / (50 * math.log(2))}]}  # fmt: skip
    tensors = {"book.ids": torch.tensor(ids, dtype=torch.int32), "book.nll": torch.tensor(nll, dtype=torch.float32)}
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})


def test_token_classes_and_the_comparison_split_the_whole_difference(tmp_path):
    # windows of 12 inputs, W = 2, far = 4: the trigram (5, 6, 7) ends at input 3 and again at input 11, 8 back;
    # (8, 8, 8) ends at input 6 and again at 7, 1 back; 8 is a line break
    ids = [1, 9, 5, 6, 7, 8, 8, 8, 8, 8, 5, 6, 7, 6, 7, 3]
    pieces = {i: ("\n" if i == 8 else f"t{i}") for i in range(10)}
    classes = TL.token_classes(torch.tensor(ids), pieces, length=12, block_len=2, far=4)
    assert len(classes["reach"]) == len(ids) - 1 and classes["reach"][0] == "new in its window"
    assert classes["reach"][3] == "new in its window" and classes["reach"][11] == "repeats from >= 4 back only"
    assert classes["reach"][7] == "repeats within 4"
    assert classes["place"][:9] == ["positions 0-1"] * 2 + ["positions 2-3"] * 2 + ["positions 4-15"] * 5
    assert classes["place"][12] == "positions 0-1"  # a new window starts at input 12
    assert [TL._place(p, 64) for p in (63, 64, 128, 511, 512, 2047, 2048, 8191)] == [
        "positions 0-63", "positions 64-127", "positions 128-511", "positions 128-511", "positions 512-2047",
        "positions 512-2047", "positions 2048-8191", "positions 2048-8191"]  # fmt: skip
    assert classes["layout"][4] == "holds a line break" and classes["layout"][9] == "first of a line"
    torch.manual_seed(0)
    a = torch.rand(len(ids) - 1).tolist()
    b = torch.rand(len(ids) - 1).tolist()
    _dump(tmp_path / "a.safetensors", ids, a)
    _dump(tmp_path / "b.safetensors", ids, b)

    class Tok:
        def __len__(self):
            return 10

        def decode(self, x):
            return pieces[x[0]]

    result = TL.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors", far=4, tokenizer=Tok())
    (row,) = result["books"]
    assert math.isclose(row["difference_nats"], sum(b) - sum(a), rel_tol=1e-6)
    for split, groups in row["splits"].items():
        assert sum(g["tokens"] for g in groups.values()) == len(ids) - 1, split
        assert math.isclose(sum(g["share"] for g in groups.values()), 1.0, rel_tol=1e-9), split
    assert "| reach | repeats from >= 4 back only |" in TL.table(result)
    assert list(row["splits"]["place"]) == ["positions 0-1", "positions 2-3", "positions 4-15"]
    spans = ["positions 128-511", "positions 1024-4095", "positions 0-63", "positions 64-127"]
    assert sorted(spans, key=TL._label_order) == [  # by where they start, not as strings
        "positions 0-63", "positions 64-127", "positions 128-511", "positions 1024-4095"]  # fmt: skip
    _dump(tmp_path / "c.safetensors", ids, a, length=24)
    with pytest.raises(ValueError, match="the dumps differ in length: 12 .* vs 24"):
        TL.compare(tmp_path / "a.safetensors", tmp_path / "c.safetensors")
