"""BSTConfig.layer_types: one type per layer, kept in step with the older index fields (issue #12)."""

import json

import pytest
import torch
from conftest import tiny_config
from transformers import PreTrainedConfig

from modeling_bst import BSTConfig, BSTForCausalLM
from modeling_bst.context_bst import MFContextStates
from modeling_bst.modeling_bst import BSTGSSLayer


def test_layer_types_and_index_fields_are_two_views_of_one_assignment():
    config = tiny_config(num_hidden_layers=4, bst_layer_indices=[0, 2], recurrent_layer_indices=[3])
    assert config.layer_types == ["bst", "block", "bst", "recurrent"]
    config.layer_types = ["gss", "bst", "block", "block"]
    assert (config.bst_layer_indices, config.recurrent_layer_indices, config.gss_layer_indices) == ([1], [], [0])
    config.recurrent_layer_indices = [3]
    assert config.layer_types == ["gss", "bst", "block", "recurrent"]
    config.num_hidden_layers = 2
    config.gss_layer_indices, config.recurrent_layer_indices = [], []
    assert config.layer_types == ["block", "bst"]
    config.validate_bst()


def test_a_model_built_from_layer_types_equals_one_built_from_index_fields():
    by_indices = tiny_config(context_mode="mf", bst_layer_indices=[0], gss_layer_indices=[2])
    by_types = tiny_config(context_mode="mf", layer_types=["bst", "block", "gss"], bst_layer_indices=None)
    assert by_types.layer_types == by_indices.layer_types
    torch.manual_seed(0)
    a = BSTForCausalLM(by_indices)
    torch.manual_seed(0)
    b = BSTForCausalLM(by_types)
    assert isinstance(b.model.layers[0].context, MFContextStates) and isinstance(b.model.layers[2], BSTGSSLayer)
    for (name_a, p_a), (name_b, p_b) in zip(a.state_dict().items(), b.state_dict().items()):
        assert name_a == name_b and torch.equal(p_a, p_b)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(layer_types=["bst", "attention", "block"]), "layer_types entries must be in"),
        (dict(layer_types=["bst", "block"]), "layer_types must have num_hidden_layers=3 entries"),
        (dict(layer_types=["bst", "block", "block"], bst_layer_indices=[1]), "disagrees with layer_types"),
        (dict(bst_layer_indices=[0], recurrent_layer_indices=[0]), "in both bst_layer_indices and recurrent"),
    ],
    ids=["unknown-type", "length", "disagreement", "overlap"],
)
def test_bad_layer_types_raise_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)


def test_config_json_stores_the_index_fields_and_any_reader_accepts_it(tmp_path):
    config = tiny_config(layer_types=["bst", "recurrent", "gss"], bst_layer_indices=None)
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" not in data
    assert (data["bst_layer_indices"], data["recurrent_layer_indices"], data["gss_layer_indices"]) == ([0], [1], [2])
    assert BSTConfig.from_pretrained(tmp_path).layer_types == ["bst", "recurrent", "gss"]
    PreTrainedConfig.from_pretrained(tmp_path)  # transformers' generic loader (tokenizers, Trainer) accepts it
