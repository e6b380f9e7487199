"""ListOps generator, vocabulary, evaluator, files, the LRA training script, and padding invariance of the classifier."""

import json
import math
import random
import statistics

import numpy as np
import pytest
import torch

from training import listops
from training.train_lra import TRAIN_DEFAULTS, PaddingCollator, build_model, build_optimizer, warmup_cosine


# An evaluator independent of listops.evaluate: translate the expression into a Python call tree and eval() it.
_PY_OPS = {
    "[MAX": lambda *a: max(a),
    "[MIN": lambda *a: min(a),
    "[MED": lambda *a: int(statistics.median(a)),  # LRA: int(np.median(args))
    "[SM": lambda *a: sum(a) % 10,
}
_PY_NAMES = {"[MAX": "f_max", "[MIN": "f_min", "[MED": "f_med", "[SM": "f_sm"}


def reference_value(source: str) -> int:
    parts = []
    for tok in source.split():
        if tok in _PY_NAMES:
            parts.append(_PY_NAMES[tok] + "(")
        elif tok == "]":
            parts.append("),")
        else:
            assert tok.isdigit() and len(tok) == 1, tok
            parts.append(tok + ",")
    code = "".join(parts).rstrip(",")
    env = {name: _PY_OPS[op] for op, name in _PY_NAMES.items()}
    return eval(code, {"__builtins__": {}}, env)


def check_structure(source: str, max_depth: int, max_args: int):
    """Balanced brackets, 2..max_args arguments per operator, depth <= max_depth (root = 1, digits count)."""
    stack = []
    for tok in source.split():
        if tok in listops.OPERATORS:
            if stack:
                stack[-1] += 1
            stack.append(0)
            assert len(stack) < max_depth, source  # operators at depth < max_depth only
        elif tok == "]":
            n = stack.pop()
            assert 2 <= n <= max_args, (n, source)
        else:
            assert tok in listops.DIGITS
            assert stack, source
            stack[-1] += 1
    assert not stack
    assert listops.depth(source) <= max_depth


def test_vocabulary_round_trip():
    assert listops.VOCAB_SIZE == 16 and listops.PAD_ID == 0 and listops.VOCAB[0] == listops.PAD_TOKEN
    assert set(listops.VOCAB[1:]) == {"[MAX", "[MIN", "[MED", "[SM", "]", *map(str, range(10))}
    src = "[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] [SM 9 9 ] ]"
    ids = listops.encode(src)
    assert all(1 <= i < 16 for i in ids) and len(ids) == len(src.split())
    assert listops.decode(ids) == src
    assert listops.decode([0, 0, *ids, 0]) == src  # padding dropped
    assert listops.decode(list(range(16)), skip_pad=False).split() == list(listops.VOCAB)
    assert listops.encode("( ( [MAX 1 ) 2 ) ]") == listops.encode("[MAX 1 2 ]")  # LRA parentheses dropped
    with pytest.raises(ValueError):
        listops.encode("[MAX 1 12 ]")
    with pytest.raises(ValueError):
        listops.decode([16])


def test_evaluator_semantics():
    ev = listops.evaluate
    assert ev("[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]") == 5
    assert ev("[SM 9 9 7 ]") == 5
    assert ev("[MIN 9 [MAX 1 2 ] ]") == 2
    # Median as LRA's int(np.median(.)): odd -> middle value; even -> mean of the middle two, truncated.
    assert ev("[MED 1 2 ]") == 1 and ev("[MED 3 6 ]") == 4 and ev("[MED 9 0 4 1 ]") == 2 and ev("[MED 7 7 ]") == 7
    rng = random.Random(0)
    for _ in range(2000):
        args = [rng.randrange(10) for _ in range(rng.randint(1, 10))]
        assert listops.apply_operator(listops.MED, args) == int(np.median(args))
    assert ev("7") == 7
    for bad in ["", "[MAX 1 2", "[MAX 1 2 ] ]", "1 2", "[MAX 1 2 ] 3", "[FOO 1 ]", "[MAX ]", "]"]:
        with pytest.raises(ValueError):
            ev(bad)


def test_generated_expressions_are_valid_and_values_match_reference():
    examples = listops.generate_examples(400, seed=3, min_length=4, max_length=300)
    examples += listops.generate_examples(20, seed=4, min_length=500, max_length=2000)  # LRA lengths
    depths = set()
    for ex in examples:
        check_structure(ex["source"], listops.DEFAULT_MAX_DEPTH, listops.DEFAULT_MAX_ARGS)
        assert ex["length"] == len(ex["source"].split())
        assert ex["target"] == listops.evaluate(ex["source"]) == reference_value(ex["source"])
        depths.add(listops.depth(ex["source"]))
    assert max(depths) >= 5  # genuinely nested
    labels = {ex["target"] for ex in examples}
    assert labels == set(range(10))
    # Tighter shape limits are honoured too.
    for ex in listops.generate_examples(200, seed=5, min_length=4, max_length=200, max_depth=4, max_args=3, p_op=0.5):
        check_structure(ex["source"], 4, 3)
        assert ex["target"] == reference_value(ex["source"])


@pytest.mark.parametrize("min_length,max_length", [(4, 16), (32, 64), (100, 256)])
def test_lengths_respect_limits(min_length, max_length):
    examples = listops.generate_examples(100, seed=1, min_length=min_length, max_length=max_length)
    lengths = [ex["length"] for ex in examples]
    assert min(lengths) >= min_length and max(lengths) <= max_length
    assert len({ex["source"] for ex in examples}) == 100
    with pytest.raises(ValueError):
        listops.generate_examples(1, min_length=10, max_length=5)
    with pytest.raises(RuntimeError):
        listops.generate_examples(1, seed=0, min_length=60, max_length=60, max_depth=2, max_args=3, max_draws=200)


def test_generation_is_deterministic_and_splits_are_disjoint():
    kw = {"min_length": 8, "max_length": 128}
    a = listops.generate_splits({"train": 200, "val": 50, "test": 50}, seed=7, **kw)
    b = listops.generate_splits({"train": 200, "val": 50, "test": 50}, seed=7, **kw)
    c = listops.generate_splits({"train": 200, "val": 50, "test": 50}, seed=8, **kw)
    assert a == b
    assert a["train"] != c["train"]
    sources = [set(ex["source"] for ex in a[s]) for s in ("train", "val", "test")]
    assert sum(map(len, sources)) == 300 and len(set.union(*sources)) == 300
    assert listops.generate_examples(30, seed=11, **kw) == listops.generate_examples(30, seed=11, **kw)


@pytest.mark.parametrize("ext", ["jsonl", "tsv"])
def test_write_read_split(tmp_path, ext):
    examples = listops.generate_examples(50, seed=2, min_length=4, max_length=100)
    path = str(tmp_path / f"train.{ext}")
    listops.write_split(path, examples)
    assert listops.read_split(path) == examples
    assert listops.find_split_file(str(tmp_path), "train") == path


def test_reads_lra_style_tsv_with_parentheses(tmp_path):
    path = tmp_path / "basic_test.tsv"
    path.write_text("Source\tTarget\n( ( ( [MAX 2 ) 9 ) ] )\t9\n( ( ( [SM 5 ) ( ( [MIN 3 ) 4 ) ] ) ) ] )\t8\n")
    examples = listops.load_splits(str(tmp_path), ["test"])["test"]
    assert [ex["source"] for ex in examples] == ["[MAX 2 9 ]", "[SM 5 [MIN 3 4 ] ]"]
    assert [ex["target"] for ex in examples] == [9, 8]
    assert all(listops.evaluate(ex["source"]) == ex["target"] for ex in examples)


def test_cli_generate(tmp_path):
    out = tmp_path / "data"
    argv = ["generate", "--out", str(out), "--train", "30", "--val", "10", "--test", "10"]
    assert listops.main(argv + ["--min-length", "8", "--max-length", "64", "--seed", "3"]) == 0
    splits = listops.load_splits(str(out))
    assert {k: len(v) for k, v in splits.items()} == {"train": 30, "val": 10, "test": 10}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["max_length"] == 64 and meta["splits"]["train"]["n"] == 30
    assert all(8 <= ex["length"] <= 64 for v in splits.values() for ex in v)


def test_optimizer_groups_and_schedule():
    model = build_model(_TINY_MODEL, 64, 0)
    tcfg = dict(TRAIN_DEFAULTS, learning_rate=2e-3, ssm_lr=1e-3, weight_decay=0.05)
    optimizer, _ = build_optimizer(model, tcfg, 100)  # groups from training.optim.parameter_groups
    groups = optimizer.param_groups
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == ["decay", "no_decay", "ssm"]
    assert by_name["decay"]["initial_lr"] == by_name["no_decay"]["initial_lr"] == 2e-3
    ssm_ids = {id(p) for n, p in model.named_parameters() if n in set(model.ssm_parameter_names())}
    assert ssm_ids and {id(p) for p in by_name["ssm"]["params"]} == ssm_ids
    assert by_name["ssm"]["weight_decay"] == 0.0 and by_name["ssm"]["initial_lr"] == 1e-3
    assert by_name["decay"]["weight_decay"] == 0.05 and all(p.ndim >= 2 for p in by_name["decay"]["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # S4 head layers contribute SSM parameters too.
    assert any(n.startswith("s4_layers.") for n in model.ssm_parameter_names())
    fn = warmup_cosine(100, 10, 1e-4, 1e-4)
    assert fn(0) == pytest.approx(1e-4) and fn(10) == pytest.approx(1.0) and fn(100) == pytest.approx(1e-4)
    assert fn(5) == pytest.approx(1e-4 + (1 - 1e-4) * 0.5)
    assert all(fn(s) >= fn(s + 1) for s in range(10, 100))
    # no ssm_lr anywhere (config.ssm_lr's default is None): the SSM parameters train at the main learning rate
    model.config.ssm_lr = None
    optimizer, _ = build_optimizer(model, dict(tcfg, ssm_lr=None), 100)
    assert {g["name"]: g["initial_lr"] for g in optimizer.param_groups}["ssm"] == 2e-3


_TINY_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "block_len": 8,
    "ssm_state_size": 8,
    "num_context_states": 4,
    "dropout": 0.0,
    "attention_dropout": 0.0,
}


def test_classifier_is_padding_invariant():
    torch.manual_seed(0)
    model = build_model(_TINY_MODEL, 64, 0).eval()
    assert model.config.bidirectional and model.config.num_s4_head_layers == 2
    assert model.config.bst_layer_indices == [0, 1]
    examples = listops.generate_examples(4, seed=9, min_length=5, max_length=40)
    examples.append({"source": "[MAX 1 2 ]", "target": 2, "length": 4})
    features = [{"input_ids": listops.encode(ex["source"])} for ex in examples]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([f["input_ids"]])).logits for f in features])
        for side in ("right", "left"):
            batch = PaddingCollator(side=side)(features)
            assert (batch["attention_mask"].sum(1) == torch.tensor([len(f["input_ids"]) for f in features])).all()
            padded = model(**batch).logits
            torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)


def test_train_lra_tiny_run_end_to_end(tmp_path):
    from training.train_lra import main

    out = tmp_path / "run"
    overrides = [f"model.{k}={v}" for k, v in _TINY_MODEL.items()]
    overrides += [
        "data.val=16",
        "data.test=16",
        "data.min_length=4",
        "data.max_length=48",
        "training.batch_size=8",
        "training.eval_batch_size=16",
        "training.logging_steps=1",
        "training.eval_steps=2",
        "training.num_threads=null",
    ]
    argv = ["--task", "listops", "--generate", "32", "--config", "configs/lra/listops-tiny.yaml"]
    argv += ["--max_steps", "3", "--output_dir", str(out)]
    for o in overrides:
        argv += ["--set", o]
    results = main(argv)
    saved = json.loads((out / "results.json").read_text())
    assert saved["steps"] == 3 == results["steps"]
    for key in ("val_accuracy", "test_accuracy"):
        assert 0.0 <= saved[key] <= 1.0
    assert (
        math.isfinite(saved["train_loss"]) and math.isfinite(saved["val_loss"]) and math.isfinite(saved["test_loss"])
    )
    assert saved["data"]["train"]["n"] == 32 and saved["data"]["test"]["n"] == 16
    assert saved["chance_accuracy"] == 0.1 and saved["model_parameters"] > 0
    assert 0.0 <= saved["test_accuracy_of_train_majority_class"] <= saved["test_majority_accuracy"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in log) and any("eval_accuracy" in r for r in log)


def test_train_lra_reads_data_dir(tmp_path):
    from training.train_lra import main

    data = tmp_path / "data"
    listops.main(
        [
            "generate",
            "--out",
            str(data),
            "--train",
            "16",
            "--val",
            "8",
            "--test",
            "8",
            "--min-length",
            "4",
            "--max-length",
            "64",
        ]
    )
    argv = ["--task", "listops", "--data", str(data), "--max_steps", "1", "--output_dir", str(tmp_path / "run")]
    for k, v in _TINY_MODEL.items():
        argv += ["--set", f"model.{k}={v}"]
    argv += ["--set", "data.max_length=64", "--set", "training.batch_size=8", "--set", "training.logging_steps=1"]
    results = main(argv)
    assert results["steps"] == 1 and results["data"]["val"]["n"] == 8


@pytest.mark.slow
def test_lra_length_generation_and_full_length_forward():
    examples = listops.generate_examples(200, seed=0)  # LRA: 500 <= length <= 2000
    assert all(500 <= ex["length"] <= 2000 for ex in examples)
    assert all(ex["target"] == reference_value(ex["source"]) for ex in examples)
    model = build_model({**_TINY_MODEL, "block_len": 512}, 2000, 0).eval()
    longest = max(examples, key=lambda ex: ex["length"])
    short = min(examples, key=lambda ex: ex["length"])
    features = [{"input_ids": listops.encode(ex["source"])} for ex in (longest, short)]
    with torch.no_grad():
        batched = model(**PaddingCollator()(features)).logits
        alone = model(input_ids=torch.tensor([features[1]["input_ids"]])).logits
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=1e-4)
