"""Checkpoints written by every layout of the model load with identical logits: the current layout directly, earlier
ones after ``python -m training.convert_checkpoint`` (the model's code knows only the current names).

``tests/fixtures/checkpoints/layout<k>/<variant>/`` holds tiny checkpoints (``config.json`` + ``model.safetensors``)
saved by layout k of the parameter names (see ``training/convert_checkpoint.py``), with the float64 logits that code
gave for fixed input ids (``expected.safetensors``). This test fails if a rename or a numerical change breaks a
checkpoint. Write the fixtures of the current layout only deliberately:
``python tests/models/bst/test_checkpoint_compat.py --write`` (it overwrites ``layout3/`` with the current code's output).
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling_bst  # noqa: F401
from modeling_bst import BSTConfig, BSTForCausalLM
from training.convert_checkpoint import convert, current_name
from training.convert_checkpoint import main as convert_main


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints"
CURRENT = "layout3"
LAYOUTS = ("layout1", "layout2", CURRENT)

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
EARLIER = [(layout, name) for layout in LAYOUTS[:-1] for name in CHECKPOINTS]


def input_ids() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1234))


def write_fixtures():
    for name, overrides in CHECKPOINTS.items():
        torch.manual_seed(0)
        model = BSTForCausalLM(BSTConfig(**{**TINY, **overrides})).eval()
        folder = FIXTURES / CURRENT / name
        model.save_pretrained(folder)
        for extra in folder.glob("*.py"):
            extra.unlink()  # the code under test is the current package, not a copy
        ids = input_ids()
        with torch.no_grad():
            logits = model.double()(ids).logits
        save_file({"input_ids": ids, "logits": logits.contiguous()}, str(folder / "expected.safetensors"))


def assert_expected_logits(model, folder):
    expected = load_file(str(folder / "expected.safetensors"))
    with torch.no_grad():
        logits = model.eval().double()(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_current_checkpoint_loads_with_identical_logits(name):
    assert_expected_logits(BSTForCausalLM.from_pretrained(FIXTURES / CURRENT / name), FIXTURES / CURRENT / name)


@pytest.mark.parametrize("layout,name", EARLIER)
def test_earlier_checkpoint_converts_with_identical_logits(layout, name, tmp_path):
    folder = FIXTURES / layout / name
    out = convert(folder, tmp_path / "converted")
    current = set(load_file(str(FIXTURES / CURRENT / name / "model.safetensors")))
    assert set(load_file(str(out / "model.safetensors"))) == current
    assert {p.name for p in Path(modeling_bst.__file__).parent.glob("*_bst.py")} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (folder / "generation_config.json").read_text()
    )
    assert_expected_logits(BSTForCausalLM.from_pretrained(out), folder)


@pytest.mark.parametrize("layout,name", EARLIER)
def test_a_direct_load_of_an_earlier_layout_leaves_exactly_the_converted_names_unplaced(layout, name):
    """The model knows only the current names: loaded directly, an earlier checkpoint's renamed parameters are
    transformers' unexpected keys (their layers keep fresh weights, which the load report names), and those are
    exactly the names the converter changes, into exactly the missing ones."""
    folder = FIXTURES / layout / name
    _, info = BSTForCausalLM.from_pretrained(folder, output_loading_info=True)
    config = BSTConfig.from_pretrained(folder)
    types = [config.layer_kind(i) for i in range(config.num_hidden_layers)]
    renamed = {k for k in load_file(str(folder / "model.safetensors")) if current_name(k, types) != k}
    assert set(info["unexpected_keys"]) == renamed
    assert set(info["missing_keys"]) == {current_name(k, types) for k in renamed}
    assert bool(renamed) == ((layout, name) != ("layout2", "gss"))


def test_second_layout_gss_checkpoint_loads_directly():
    """GSS layers kept their names, and the second layout named attention layers as now: nothing to convert."""
    folder = FIXTURES / "layout2" / "gss"
    assert_expected_logits(BSTForCausalLM.from_pretrained(folder), folder)


def test_conversion_is_idempotent_and_refuses_to_overwrite(tmp_path, capsys):
    src = FIXTURES / CURRENT / "sh-s4"
    convert_main([str(src), str(tmp_path / "again")])
    assert "converted checkpoint written to" in capsys.readouterr().out
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(FileExistsError, match="never overwrites"):
        convert(src, tmp_path / "again")


def test_conversion_keeps_dtypes(tmp_path):
    model = BSTForCausalLM.from_pretrained(FIXTURES / CURRENT / "sh-s4", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    converted = load_file(str(convert(tmp_path / "bf16", tmp_path / "out") / "model.safetensors"))
    assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in converted.items()}
    assert {v.dtype for v in converted.values()} == {torch.bfloat16, torch.float32}  # the SSM stays float32


def test_conversion_refuses_pickled_weights(tmp_path):
    (tmp_path / "old").mkdir()
    BSTConfig(**TINY).save_pretrained(tmp_path / "old")
    (tmp_path / "old" / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="unpickling runs code"):
        convert(tmp_path / "old", tmp_path / "new")


def test_names_map_per_layer_type():
    types = ["bst", "recurrent", "gss"]
    assert current_name("model.layers.0.context.ssm.B", types) == "model.layers.0.ssm.B"  # first layout
    assert current_name("model.layers.0.cross_attn.context.ssm.B", types) == "model.layers.0.ssm.B"  # second
    assert current_name("model.layers.0.cross_attn.context.up_proj", types) == "model.layers.0.context.up_proj"
    assert current_name("model.layers.0.q2_proj.weight", types) == "model.layers.0.cross_attn.q_proj.weight"
    assert current_name("model.layers.1.recurrent.gate_bias", types) == "model.layers.1.recurrent.gate_bias"
    assert current_name("model.layers.1.v_proj.weight", types) == "model.layers.1.self_attn.v_proj.weight"
    assert current_name("model.layers.2.v_proj.weight", types) == "model.layers.2.v_proj.weight"  # GSS gate
    assert current_name("model.embed_tokens.weight", types) == "model.embed_tokens.weight"


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit(
            "usage: python tests/models/bst/test_checkpoint_compat.py --write  (overwrites the current layout's fixtures)"
        )
    write_fixtures()
