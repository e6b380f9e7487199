"""Command-line validation of the training CLIs (issue #14 item 3, issue #13): a bad model override, a near-miss flag
or an inconsistent Transformer-XL segment length fails before anything is built, with an error naming the field."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training import train as T


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "train" / "tiny.yaml")


def _config(*argv):
    model_args, _, _ = T.parse_args(["--config", TINY, *argv])
    return T.build_config(model_args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_len": 0}, "field 'block_len':\n    ValueError: must be a positive integer, got 0"),
        ({"context_mode": "xx"}, "Field 'context_mode' expected one of ('sh', 'mh', 'mf'), got xx"),
        ({"blok_len": 64}, "unknown BSTConfig field(s) 'blok_len' (did you mean 'block_len'?)"),
        ({"dropout": "x"}, "BSTConfig.dropout must be float or int, got 'x'"),
        ({"qk_norm": 1}, "BSTConfig.qk_norm must be bool, got 1"),
        ({"block_len": 32.0}, "BSTConfig.block_len must be int, got 32.0"),
        ({"bst_layer_indices": [9]}, "BSTConfig.bst_layer_indices entries must be in [0, num_hidden_layers=4)"),
        ({"model_type": "llama"}, "'model_type' cannot be overridden"),
    ],
    ids=[
        "block_len-0",
        "context_mode-xx",
        "misspelt",
        "float-as-str",
        "bool-as-int",
        "int-as-float",
        "range",
        "fixed",
    ],
)
def test_bad_model_override_names_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        _config("--model_overrides", json.dumps(overrides))
    assert str(err.value).startswith("--model_overrides: ") and message in str(err.value)


def test_model_overrides_that_are_valid_are_applied_and_the_preset_is_untouched():
    config = _config("--model_overrides", json.dumps({"block_len": 32, "ssm_lr": 1, "attn_scale_init": None}))
    assert (config.block_len, config.ssm_lr, config.attn_scale_init) == (32, 1, None)
    assert _config().block_len == 64  # the preset itself


@pytest.mark.parametrize("text", ["[1, 2]", "{bad json", '"block_len"'])
def test_model_overrides_must_be_a_json_object(text):
    with pytest.raises(ValueError, match="--model_overrides must be a JSON object"):
        _config("--model_overrides", text)


def test_near_miss_flag_is_rejected_not_taken_as_an_abbreviation():
    with pytest.raises(ValueError, match="--learning_rat"):
        T.parse_args(["--config", TINY, "--learning_rat", "0.5"])
    assert T.parse_args(["--config", TINY, "--learning_rate", "0.5"])[2].learning_rate == 0.5


def test_bad_override_fails_from_the_command_line_before_anything_is_built(tmp_path):
    out = tmp_path / "run"
    argv = ["--config", TINY, "--output_dir", str(out), "--model_overrides", '{"blok_len": 64}']
    proc = subprocess.run(
        [sys.executable, "-m", "training.train", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "unknown BSTConfig field(s) 'blok_len' (did you mean 'block_len'?)" in proc.stderr
    assert not (out / "tokenizer").exists()  # failed before the BPE tokenizer was trained


@pytest.mark.parametrize(
    "module", ["training.evaluate", "training.export", "training.corpora", "training.tasks.listops"]
)
def test_other_clis_reject_abbreviated_flags(module):
    from importlib import import_module

    mod = import_module(module)
    with pytest.raises(SystemExit) as err:
        mod.main(["--hel"])  # a prefix of --help: rejected as unknown, not taken as --help
    assert err.value.code == 2


def test_transformer_xl_streaming_needs_segments_of_its_window():
    argv = ["--model_config", "trsf-xl-tiny", "--stream_segments", "true"]
    model_args, data_args, _ = T.parse_args(["--config", TINY, *argv, "--seq_len", "512"])
    with pytest.raises(ValueError, match=r"seq_len \(512\) must equal the model's block_len \(256\)"):
        T.check_run(data_args, T.build_config(model_args))
    model_args, data_args, _ = T.parse_args(["--config", TINY, *argv, "--seq_len", "256"])
    T.check_run(data_args, T.build_config(model_args))
    # Not streamed, or a model with state layers (BRecT): no constraint.
    model_args, data_args, _ = T.parse_args(["--config", TINY, "--model_config", "trsf-xl-tiny", "--seq_len", "512"])
    T.check_run(data_args, T.build_config(model_args))
    model_args, data_args, _ = T.parse_args(
        ["--config", TINY, "--model_config", "brect-tiny", "--stream_segments", "true"]
    )
    T.check_run(data_args, T.build_config(model_args))


def test_resuming_a_finished_run_trains_nothing_and_does_not_warn(tmp_path):
    """``--resume_from_checkpoint true`` when the last checkpoint is at max_steps: no extra step, no warning about
    the tied ``lm_head.weight`` (never saved, so never in a checkpoint), the same final weights (issue #14 item 7)."""
    import logging

    import test_training
    import torch
    from safetensors.torch import load_file

    corpus = tmp_path / "corpus"
    (corpus / "train").mkdir(parents=True)
    (corpus / "validation").mkdir()
    books = test_training.D.embedded_books()
    for i in range(3):
        (corpus / "train" / f"doc{i}.txt").write_text(books[i]["text"][20_000:26_000])
    (corpus / "validation" / "val.txt").write_text(books[6]["text"][30_000:33_000])
    out = tmp_path / "run"
    argv = test_training.tiny_argv(corpus, out, "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "3")
    first = T.main(argv)
    assert len(first["losses"]) == 3
    before = load_file(str(out / "final" / "model.safetensors"))

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addHandler(handler)
    try:
        again = T.main([*argv, "--tokenizer", str(out / "tokenizer"), "--resume_from_checkpoint", "true"])
    finally:
        trainer_logger.removeHandler(handler)
    assert again["losses"] == first["losses"]  # the history of the checkpoint, no 4th step
    assert not [r for r in records if "missing keys" in r.getMessage()]
    after = load_file(str(out / "final" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_torch_compile_auto_compiles_on_cuda_only(where, tmp_path, monkeypatch):
    """``torch_compile: auto`` (the GPU recipes) resolves to a compiled model on a CUDA GPU and to eager elsewhere,
    from a recipe or from ``--torch_compile auto``; an explicit value wins."""
    import yaml

    recipe = yaml.safe_load(Path(TINY).read_text())
    argv = []
    if where == "recipe":
        recipe["training"]["torch_compile"] = "auto"
    else:
        argv = ["--torch_compile", "auto"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert T.parse_args(["--config", str(path), *argv])[2].torch_compile is False  # no CUDA here
    # what auto resolves to on a CUDA machine (TrainingArguments itself cannot be built for CUDA without one)
    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: True)
    assert T._resolve_auto({"torch_compile": "auto"}) == {"torch_compile": True}
    monkeypatch.undo()
    assert T.parse_args(["--config", str(path), "--torch_compile", "false"])[2].torch_compile is False


def test_gpu_recipes_compile_on_cuda():
    """The recipes meant for GPUs (fused AdamW) compile there."""
    for path in sorted(Path(TINY).parent.glob("*.yaml")):
        recipe = yaml_load(path)
        if recipe["training"].get("optim") == "adamw_torch_fused":
            assert recipe["training"].get("torch_compile") == "auto", path.name


def yaml_load(path):
    import yaml

    return yaml.safe_load(Path(path).read_text())
