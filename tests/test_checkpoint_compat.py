"""Checkpoints written by earlier layouts of the model still load with identical logits.

``tests/fixtures/checkpoints/<variant>/`` holds tiny checkpoints (``config.json`` + ``model.safetensors``) saved by the
layout of the model before the "core v2" refactor (issue #12), with the float64 logits that layout gave for fixed
input ids (``expected.safetensors``). Renamed parameters are mapped by the model's load hook; this test fails if a
rename or a numerical change breaks old checkpoints. Regenerate only deliberately:
``python tests/test_checkpoint_compat.py --write`` (it overwrites the fixtures with the current code's output).
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling_bst  # noqa: F401
from modeling_bst import BSTConfig, BSTForCausalLM


FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"

# Frozen on purpose (not conftest.TINY_DEFAULTS): the fixtures must keep the config they were written with.
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=8,
    intermediate_size=48,
    max_position_embeddings=64,
    block_len=4,
    bst_layer_indices=[0, 2],
    ssm_state_size=4,
    num_context_states=3,
    num_recurrent_states=3,
    dropout=0.0,
    attention_dropout=0.0,
)
CHECKPOINTS = {
    "sh-s4": dict(context_mode="sh", ssm_kind="s4"),
    "mh-s4": dict(context_mode="mh", ssm_kind="s4"),
    "mf-s4": dict(context_mode="mf", ssm_kind="s4"),
    "sh-unstruct": dict(context_mode="sh", ssm_kind="unstruct"),
    "brect": dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
    "gss": dict(bst_layer_indices=[], gss_layer_indices=[0, 2]),
}


def input_ids() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1234))


def write_fixtures():
    for name, overrides in CHECKPOINTS.items():
        torch.manual_seed(0)
        model = BSTForCausalLM(BSTConfig(**{**TINY, **overrides})).eval()
        folder = FIXTURES / name
        model.save_pretrained(folder)
        for extra in folder.glob("*.py"):
            extra.unlink()  # the code under test is the current package, not a copy
        ids = input_ids()
        with torch.no_grad():
            logits = model.double()(ids).logits
        save_file({"input_ids": ids, "logits": logits.contiguous()}, str(folder / "expected.safetensors"))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_old_checkpoint_loads_with_identical_logits(name):
    folder = FIXTURES / name
    model = BSTForCausalLM.from_pretrained(folder).eval()
    expected = load_file(str(folder / "expected.safetensors"))
    with torch.no_grad():
        logits = model.double()(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["sh-s4", "brect", "gss"])
def test_old_checkpoint_resaves_with_current_names(name, tmp_path):
    """``save_pretrained`` of a model loaded from an old checkpoint writes the current names (not the old layout),
    and the resaved folder loads with the same logits."""
    folder = FIXTURES / name
    model = BSTForCausalLM.from_pretrained(folder).eval()
    model.save_pretrained(tmp_path)
    saved = set(load_file(str(tmp_path / "model.safetensors")))
    current = set(model.state_dict()) - {"lm_head.weight"}  # tied to the embeddings
    assert saved == current
    old = set(load_file(str(folder / "model.safetensors")))
    assert name == "gss" or saved != old  # the attention layers' names did change
    expected = load_file(str(folder / "expected.safetensors"))
    with torch.no_grad():
        logits = BSTForCausalLM.from_pretrained(tmp_path).eval().double()(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["mf-s4", "brect", "gss"])
def test_old_state_dict_loads_with_load_state_dict(name):
    """``load_state_dict`` (a training resume) of an old-layout state dict: the decoder layers' load hook renames."""
    folder = FIXTURES / name
    model = BSTForCausalLM(BSTConfig.from_pretrained(folder)).eval()
    state = load_file(str(folder / "model.safetensors"))
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    expected = load_file(str(folder / "expected.safetensors"))
    with torch.no_grad():
        logits = model.double()(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-12, rtol=1e-12)


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/test_checkpoint_compat.py --write  (overwrites the fixtures)")
    write_fixtures()
