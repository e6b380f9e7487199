"""ListOps generator, vocabulary, evaluator, files, the ``task: listops`` recipes of training.train (end to end, exact
resume, parameter groups and schedule), and padding invariance of the classifier."""

import json
import math
import random
import statistics

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from modeling_bst import BSTForSequenceClassification
from training import train as T
from training.optim import parameter_groups
from training.tasks import listops
from training.tasks.listops import PaddingCollator


TINY_RECIPE = "configs/train/listops-tiny.yaml"


def build_model(overrides: dict, max_length: int, seed: int) -> BSTForSequenceClassification:
    torch.manual_seed(seed)
    return BSTForSequenceClassification(listops.classifier_config(overrides, max_length))


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


def test_recipe_optimizer_groups_and_schedule(tmp_path):
    """The ListOps recipe trains with training.optim.parameter_groups (through BSTTrainer) and the paper's schedule:
    linear warm-up from 1e-7 over the first 10% of the steps, then cosine down to 1e-7."""
    argv = ["--config", TINY_RECIPE, "--output_dir", str(tmp_path), "--max_steps", "100", "--eval_strategy", "no"]
    model_args, data_args, train_args = T.parse_args(argv + ["--model_overrides", json.dumps(_TINY_MODEL)])
    model = build_model(_TINY_MODEL, 64, 0)
    trainer = T.BSTTrainer(model=model, args=train_args, ssm_lr=model_args.ssm_lr)
    trainer.create_optimizer_and_scheduler(num_training_steps=100)
    by_name = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert list(by_name) == ["decay", "no_decay", "ssm"]
    assert by_name["decay"]["initial_lr"] == by_name["no_decay"]["initial_lr"] == 2e-3
    ssm_ids = {id(p) for n, p in model.named_parameters() if n in set(model.ssm_parameter_names())}
    assert ssm_ids and {id(p) for p in by_name["ssm"]["params"]} == ssm_ids
    assert by_name["ssm"]["weight_decay"] == 0.0 and by_name["ssm"]["initial_lr"] == 1e-3
    assert by_name["decay"]["weight_decay"] == 0.05 and all(p.ndim >= 2 for p in by_name["decay"]["params"])
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(model.parameters()))
    # S4 head layers contribute SSM parameters too.
    assert any(n.startswith("s4_layers.") for n in model.ssm_parameter_names())
    lambdas = trainer.lr_scheduler.lr_lambdas[0]
    lr = [2e-3 * lambdas(step) for step in range(100)]
    assert lr[0] == pytest.approx(1e-7) and lr[9] == pytest.approx(2e-3) and lr[-1] == pytest.approx(1e-7)
    assert all(a < b for a, b in zip(lr[:9], lr[1:10])) and all(a >= b for a, b in zip(lr[10:], lr[11:]))
    # No ssm_lr anywhere (config.ssm_lr's default is None): the SSM parameters train at the main learning rate.
    groups = {g["name"]: g for g in parameter_groups(model, 2e-3, 0.05, None)}
    assert groups["ssm"]["lr"] == 2e-3 and groups["ssm"]["weight_decay"] == 0.0


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


def tiny_argv(out, *extra) -> list[str]:
    """The tiny ListOps recipe, shrunk to a few seconds: 32 generated training examples of 4-48 tokens."""
    return [
        "--config",
        TINY_RECIPE,
        "--output_dir",
        str(out),
        "--model_overrides",
        json.dumps(_TINY_MODEL),
        "--listops_train",
        "32",
        "--listops_val",
        "16",
        "--listops_test",
        "16",
        "--listops_min_length",
        "4",
        "--listops_max_length",
        "48",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "16",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def test_listops_recipe_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    summary = T.main(tiny_argv(out, "--max_steps", "3", "--eval_steps", "2", "--save_steps", "2"))
    saved = json.loads((out / "train_summary.json").read_text())
    assert saved["task"] == "listops" and saved["steps"] == 3 == summary["steps"]
    metrics = saved["metrics"]
    for key in ("val_accuracy", "test_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0
    assert all(math.isfinite(metrics[k]) for k in ("train_loss", "val_loss", "test_loss"))
    assert saved["data"]["train"]["n"] == 32 and saved["data"]["test"]["n"] == 16
    assert saved["baselines"]["chance_accuracy"] == 0.1 and saved["parameters"] > 0
    assert 0.0 <= saved["baselines"]["test_accuracy_of_train_majority_class"]
    assert saved["baselines"]["test_accuracy_of_train_majority_class"] <= saved["baselines"]["test_majority_accuracy"]
    log = json.loads((out / "log_history.json").read_text())
    assert any("loss" in r for r in log) and any("eval_accuracy" in r for r in log)  # evaluated at step 2
    assert [p.rsplit("/", 1)[-1] for p in T.complete_checkpoints(str(out))] == ["checkpoint-2", "checkpoint-3"]
    # The final model is a sequence classifier that loads with the Auto class and predicts one of 10 classes.
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(out / "final")).eval()
    assert isinstance(model, BSTForSequenceClassification) and model.config.num_labels == listops.NUM_CLASSES
    batch = PaddingCollator()([{"input_ids": listops.encode("[MAX 1 [MIN 2 3 ] ]")}])
    with torch.no_grad():
        assert model(**batch).logits.shape == (1, listops.NUM_CLASSES)


def test_listops_resume_from_checkpoint_is_exact(tmp_path):
    common = ["--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no"]
    a, b = tmp_path / "a", tmp_path / "b"
    full = T.main(tiny_argv(a, *common))
    resumed = T.main(tiny_argv(b, *common, "--resume_from_checkpoint", str(a / "checkpoint-2")))
    assert len(full["losses"]) == 4 and resumed["losses"][-2:] == full["losses"][-2:]
    wa = load_file(str(a / "final" / "model.safetensors"))
    wb = load_file(str(b / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_listops_recipe_reads_data_dir(tmp_path):
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
    summary = T.main(
        tiny_argv(tmp_path / "run", "--dataset_path", str(data), "--max_steps", "1", "--eval_strategy", "no")
    )
    assert summary["steps"] == 1 and summary["data"]["val"]["n"] == 8
    assert summary["data_source"] == str(data)


def test_listops_recipe_rejects_a_bad_override(tmp_path):
    argv = tiny_argv(tmp_path, "--model_overrides", '{"blok_len": 8}')
    model_args, data_args, _ = T.parse_args(argv)
    with pytest.raises(ValueError, match=r"'blok_len' \(did you mean 'block_len'\?\)"):
        T.build_task_config(model_args, data_args)
    model_args, data_args, _ = T.parse_args(tiny_argv(tmp_path, "--task", "lra-image"))
    with pytest.raises(ValueError, match="unknown task 'lra-image'"):
        T.build_task_config(model_args, data_args)


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
