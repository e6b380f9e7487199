"""BSTConfig.layer_types: the one record of the layer types (issue #12; issue #33 item 5; issue #46 point 2).

The index fields (``bst_layer_indices``, ``recurrent_layer_indices``, ``gss_layer_indices``) are keyword arguments and
config.json keys converted to ``layer_types`` once, at construction, and read-only properties read from it afterwards
(assigning one raises, naming ``layer_types``); ``from_pretrained``'s keyword overrides of the layer fields go into
the construction. config.json stores the index fields instead of ``layer_types`` (docs/architecture.md says why)."""

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import TINY_DEFAULTS, tiny_config
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file
from transformers import AutoConfig, PreTrainedConfig

from modeling_bst import BSTConfig, BSTForCausalLM
from modeling_bst.configuration_bst import LAYER_INDEX_FIELDS, LAYER_TYPE_NAMES, BSTConfigError
from modeling_bst.context_bst import MFContextStates
from modeling_bst.modeling_bst import BSTGSSLayer
from training import train as T


ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints"
INDEX_FIELDS = tuple(LAYER_INDEX_FIELDS.values())


def _indices(config) -> tuple:
    return tuple(getattr(config, field) for field in INDEX_FIELDS)


def test_index_fields_are_read_only_views_of_layer_types():
    config = tiny_config(num_hidden_layers=4, bst_layer_indices=[0, 2], recurrent_layer_indices=[3])
    assert config.layer_types == ["bst_context", "bst_block", "bst_context", "bst_recurrent"]
    # one record: no stored copy of the index fields
    assert not set(INDEX_FIELDS) & set(config.__dict__)
    config.layer_types = ["bst_gss", "bst_context", "bst_block", "bst_block"]
    assert _indices(config) == ([1], [], [0])
    # a view is a new list: changing it changes nothing
    config.bst_layer_indices.append(2)
    assert config.layer_types == ["bst_gss", "bst_context", "bst_block", "bst_block"]
    # assigning an index field is refused, naming layer_types; the config is unchanged
    for field in INDEX_FIELDS:
        with pytest.raises(BSTConfigError, match=f"BSTConfig.{field} is read from layer_types: assign config.layer_"):
            setattr(config, field, [3])
    assert config.layer_types == ["bst_gss", "bst_context", "bst_block", "bst_block"]
    # num_hidden_layers and layer_types are two fields, assigned one by one: validate() (and a model reading the
    # layer types) checks that they agree
    config.num_hidden_layers = 5
    with pytest.raises(StrictDataclassError, match="layer_types must have num_hidden_layers=5 entries"):
        config.validate()
    config.layer_types = ["bst_block", "bst_block", "bst_context", "bst_block", "bst_block"]
    assert config.layer_kind(2) == "bst" and config.layer_kind(4) == "block"
    config.validate()


def test_a_model_built_from_layer_types_equals_one_built_from_index_fields():
    by_indices = tiny_config(context_mode="mf", bst_layer_indices=[0], gss_layer_indices=[2])
    by_types = tiny_config(
        context_mode="mf", layer_types=["bst_context", "bst_block", "bst_gss"], bst_layer_indices=None
    )
    assert by_types.layer_types == by_indices.layer_types
    assert by_types == by_indices  # the same record: equal configs
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
        (
            dict(layer_types=["bst_context", "attention", "bst_block"]),
            "field 'layer_types':\n    ValueError: must be a",
        ),
        (dict(layer_types=["bst_context", "bst_block"]), "layer_types must have num_hidden_layers=3 entries"),
        (
            dict(layer_types=["bst_context", "bst_block", "bst_block"], bst_layer_indices=[1]),
            r"bst_layer_indices=\[1\] disagrees with layer_types=\['bst_context', 'bst_block', 'bst_block'\]",
        ),
        (
            dict(layer_types=["bst_context", "bst_block", "bst_gss"], bst_layer_indices=None, gss_layer_indices=[]),
            r"gss_layer_indices=\[\] disagrees with layer_types",
        ),
        (dict(bst_layer_indices=[0], recurrent_layer_indices=[0]), "in both bst_layer_indices and recurrent"),
        (dict(bst_layer_indices=[], gss_layer_indices=[1, 3]), r"gss_layer_indices entries must be in \[0, num"),
        (dict(bst_layer_indices="0"), "bst_layer_indices must be a list of layer indices"),
    ],
    ids=["unknown-type", "length", "disagreement", "disagreement-empty", "overlap", "range", "type"],
)
def test_bad_layer_types_raise_naming_the_field(fields, message, tmp_path):
    with pytest.raises(StrictDataclassError, match=message):
        tiny_config(**fields)
    # the same fields in a config.json
    data = {**tiny_config().to_dict(), **fields}
    if "layer_types" in fields:  # a config.json with layer_types and only the index fields of the case
        for field in set(INDEX_FIELDS) - set(fields):
            del data[field]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(StrictDataclassError, match=message):
        BSTConfig.from_pretrained(tmp_path)


def test_index_fields_agreeing_with_layer_types_are_accepted():
    config = tiny_config(
        layer_types=["bst_context", "bst_recurrent", "bst_gss"], bst_layer_indices=[0], recurrent_layer_indices=(1,)
    )
    assert config.layer_types == ["bst_context", "bst_recurrent", "bst_gss"] and _indices(config) == ([0], [1], [2])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bst_layer_indices=[1]), r"layers \[1\] are in both bst_layer_indices and recurrent_layer_indices"),
        (dict(gss_layer_indices=[3]), r"gss_layer_indices entries must be in \[0, num_hidden_layers=3\)"),
        (
            dict(num_hidden_layers=2),
            r"bst_layer_indices entries must be in \[0, num_hidden_layers=2\), got out-of-range \[2\]",
        ),
        (dict(layer_types=["bst_context"]), "layer_types must have num_hidden_layers=3 entries"),
        (dict(num_hidden_layers=0), "field 'num_hidden_layers':\n    ValueError: must be a positive integer"),
    ],
    ids=["overlap", "range", "cut", "types-length", "layers-zero"],
)
def test_layer_overrides_that_would_break_the_record_raise_naming_the_field(change, message, tmp_path):
    """``from_pretrained``'s keyword overrides of the layer fields make the config with them, as construction does
    (the saved index fields of the other kinds kept), and ``--model_overrides`` the same."""
    config = tiny_config(bst_layer_indices=[0, 2], recurrent_layer_indices=[1])
    config.save_pretrained(tmp_path)
    with pytest.raises(StrictDataclassError, match=message):
        BSTConfig.from_pretrained(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        T.apply_model_overrides(config, change)


def test_layer_overrides_apply_several_fields_as_one_change_in_any_order(tmp_path):
    config = BSTConfig.from_pretrained(ROOT / "training" / "presets" / "bst-sh-s4.json")  # 12 layers, BST [0, 7, 9]
    config.save_pretrained(tmp_path)
    for fields in (
        dict(num_hidden_layers=4, gss_layer_indices=[0], bst_layer_indices=[2]),
        dict(bst_layer_indices=[2], gss_layer_indices=[0], num_hidden_layers=4),
        dict(num_hidden_layers=4, layer_types=["bst_gss", "bst_block", "bst_context", "bst_block"]),
        dict(layer_types=["gss", "block", "bst", "block"], num_hidden_layers=4),
    ):
        loaded = BSTConfig.from_pretrained(tmp_path, **fields)
        assert loaded.layer_types == ["bst_gss", "bst_block", "bst_context", "bst_block"], fields
        assert AutoConfig.from_pretrained(tmp_path, **fields).layer_types == loaded.layer_types
        assert T.apply_model_overrides(config, fields).layer_types == loaded.layer_types  # --model_overrides
        assert loaded.block_len == config.block_len and loaded.num_hidden_layers == 4
    # an index field alone keeps the saved layers of the other kinds
    assert BSTConfig.from_pretrained(tmp_path, gss_layer_indices=[1]).layer_types.count("bst_context") == 3
    with pytest.raises(BSTConfigError, match="disagrees with layer_types"):
        BSTConfig.from_pretrained(tmp_path, layer_types=["bst_context"] * 12, gss_layer_indices=[1])
    # config.update (transformers' setattr per key) refuses an index field, naming layer_types
    with pytest.raises(BSTConfigError, match="read from layer_types"):
        copy.deepcopy(config).update({"bst_layer_indices": [1]})


def test_config_json_stores_the_index_fields_and_any_reader_accepts_it(tmp_path):
    config = tiny_config(layer_types=["bst_context", "bst_recurrent", "bst_gss"], bst_layer_indices=None)
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" not in data
    assert tuple(data[field] for field in INDEX_FIELDS) == ([0], [1], [2])
    assert BSTConfig.from_pretrained(tmp_path).layer_types == ["bst_context", "bst_recurrent", "bst_gss"]
    # transformers' generic loader, which AutoTokenizer falls back to without trust_remote_code, accepts it; it
    # refuses a config.json with BST layer_types (the reason config.json stores the index fields)
    PreTrainedConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**data, "layer_types": config.layer_types}))
    with pytest.raises(StrictDataclassError, match="layer_types"):
        PreTrainedConfig.from_pretrained(tmp_path)


def test_round_trip_through_every_serialisation(tmp_path):
    config = tiny_config(
        num_hidden_layers=4,
        layer_types=["bst_gss", "bst_context", "bst_block", "bst_recurrent"],
        bst_layer_indices=None,
    )
    data = config.to_dict()
    config.save_pretrained(tmp_path)
    for loaded in (
        BSTConfig.from_dict(config.to_dict()),
        BSTConfig(**config.to_dict()),
        BSTConfig.from_dict(json.loads(config.to_json_string())),
        BSTConfig.from_dict(json.loads(config.to_json_string(use_diff=False))),
        BSTConfig.from_pretrained(tmp_path),
        AutoConfig.from_pretrained(tmp_path),
        pickle.loads(pickle.dumps(config)),
        copy.deepcopy(config),
    ):
        assert loaded.layer_types == ["bst_gss", "bst_context", "bst_block", "bst_recurrent"]
        assert {**loaded.to_dict(), "_name_or_path": ""} == data


def _earlier_config_json(tmp_path, **layer_fields):
    """A config.json as versions before ``layer_types`` (issue #12) wrote it: the index fields only (the oldest
    without ``gss_layer_indices``), none of the fields added since."""
    data = json.loads((FIXTURES / "layout1" / "brect" / "config.json").read_text())
    for field in ("gss_layer_indices", "gss_expansion", "num_s4_head_layers", "layer_types"):
        data.pop(field, None)
    data.update(layer_fields)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_config_json_of_earlier_versions_loads(tmp_path):
    folder = _earlier_config_json(tmp_path)
    assert "gss_layer_indices" not in json.loads((folder / "config.json").read_text())
    assert BSTConfig.from_pretrained(folder).layer_types == ["bst_block", "bst_recurrent", "bst_block"]
    # both layouts: the index fields and layer_types, agreeing
    folder = _earlier_config_json(tmp_path, layer_types=["block", "recurrent", "block"], gss_layer_indices=[])
    assert BSTConfig.from_pretrained(folder).layer_types == ["bst_block", "bst_recurrent", "bst_block"]
    # or not: the error names both fields
    folder = _earlier_config_json(tmp_path, layer_types=["block", "block", "recurrent"])
    with pytest.raises(BSTConfigError, match=r"recurrent_layer_indices=\[1\] disagrees with layer_types"):
        BSTConfig.from_pretrained(folder)
    # layer_types alone (as a hand-written config may have it); the missing index fields follow it
    data = {**TINY_DEFAULTS, "model_type": "bst", "layer_types": ["gss", "block", "bst"]}
    del data["bst_layer_indices"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert _indices(BSTConfig.from_pretrained(tmp_path)) == ([2], [], [0])


@pytest.mark.parametrize("name", ["brect", "gss"])
def test_a_checkpoint_with_an_earlier_config_json_gives_identical_logits(name, tmp_path):
    """The committed fixtures' weights under a config.json of the earliest layout (index fields only)."""
    folder = tmp_path / name
    folder.mkdir()
    data = json.loads((FIXTURES / "layout3" / name / "config.json").read_text())
    if not data["gss_layer_indices"]:
        del data["gss_layer_indices"]
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "model.safetensors").symlink_to(FIXTURES / "layout3" / name / "model.safetensors")
    model = BSTForCausalLM.from_pretrained(folder).eval()
    expected = load_file(str(FIXTURES / "layout3" / name / "expected.safetensors"))
    with torch.no_grad():
        logits = model.double()(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["sh-s4", "brect", "gss"])
def test_earlier_layer_type_names_load_as_the_new_names_with_identical_logits(name, tmp_path):
    """Before issue #45 the layer types were the bare kinds ("block", "bst", "recurrent", "gss"), names that other
    families use too in transformers' process-wide cache-layer registry. A config.json listing them (beside the
    index fields, or hand-written) loads to the prefixed names with the committed logits; saving writes the index
    fields only, which load back to the same."""
    fixture = FIXTURES / "layout3" / name
    data = json.loads((fixture / "config.json").read_text())
    kinds = ["block"] * data["num_hidden_layers"]
    for kind, field in LAYER_INDEX_FIELDS.items():
        for i in data[field]:
            kinds[i] = kind
    folder = tmp_path / "earlier"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**data, "layer_types": kinds}))
    (folder / "model.safetensors").symlink_to(fixture / "model.safetensors")
    expected = load_file(str(fixture / "expected.safetensors"))
    model = BSTForCausalLM.from_pretrained(folder).eval().double()
    assert model.config.layer_types == [LAYER_TYPE_NAMES[kind] for kind in kinds]
    assert [model.config.layer_kind(i) for i in range(len(kinds))] == kinds
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "layer_types" not in saved and all(saved[field] == data[field] for field in INDEX_FIELDS)
    reloaded = BSTForCausalLM.from_pretrained(tmp_path / "saved").eval().double()
    assert reloaded.config.layer_types == model.config.layer_types
    with torch.no_grad():
        for loaded in (model, reloaded):
            torch.testing.assert_close(
                loaded(expected["input_ids"]).logits, expected["logits"], atol=1e-12, rtol=1e-12
            )


# The layer types every preset loaded to before the index fields became views of layer_types (issue #33 item 5),
# one letter a layer: b block, S bst, R recurrent, G gss.
PRESET_LAYER_TYPES = {
    "brect-fixed-skip": "bbbbbbbbbRbb",
    "brect-tiny": "bbRb",
    "bst-mf-s4-l": "SbbbbSbSbSbb",
    "bst-mf-s4": "SbbbbbbSbSbb",
    "bst-mf-unstruct-l": "SbbbbSbSbSbb",
    "bst-mf-unstruct": "SbbbbbbSbSbb",
    "bst-mh-s4": "SbbbbbbSbSbb",
    "bst-sh-s4-l": "SbbbbSbSbSbb",
    "bst-sh-s4": "SbbbbbbSbSbb",
    "bst-sh-unstruct-l": "SbbbbSbSbSbb",
    "bst-sh-unstruct": "SbbbbbbSbSbb",
    "bst-tiny-mf-s4": "SbSb",
    "bst-tiny-mf-unstruct": "SbSb",
    "bst-tiny-mh-s4": "SbSb",
    "bst-tiny-mh-unstruct": "SbSb",
    "bst-tiny-sh-s4": "SbSb",
    "bst-tiny-sh-unstruct": "SbSb",
    # changed on purpose after item 5 (issue #33 item 7a): 32 GSS layers, a Transformer layer every 4th from the 2nd
    # (before: 28 layers, "Gb" + "GGGb" * 6 + "GG")
    "gss-hybrid-l": "Gb" + "GGGb" * 10 + "G",
    "gss-hybrid-tiny": "GbGG",
    "slide-12l": "b" * 12,
    "slide-tiny": "bbbb",
    "trsf-xl-2048": "b" * 12,
    "trsf-xl-tiny": "bbbb",
}
LETTERS = {"b": "bst_block", "S": "bst_context", "R": "bst_recurrent", "G": "bst_gss"}


def test_every_preset_loads_to_the_layer_types_it_had():
    presets = sorted((ROOT / "training" / "presets").glob("*.json"))
    assert {p.stem for p in presets} == set(PRESET_LAYER_TYPES)
    gss_hybrid = [LETTERS[c] for c in PRESET_LAYER_TYPES["gss-hybrid-l"]]
    assert gss_hybrid.count("bst_gss") == 32 and [i for i, t in enumerate(gss_hybrid) if t == "bst_block"] == list(
        range(1, 43, 4)
    )
    for path in presets:
        expected = [LETTERS[c] for c in PRESET_LAYER_TYPES[path.stem]]
        assert AutoConfig.from_pretrained(path).layer_types == expected, path.stem
