"""BST beside other model code in one process (issue #45 points 3 and 6).

transformers keeps one process-wide registry of cache-layer classes by layer-type name, which BST's cache layers join
at import (``DynamicCache(config=bst_config)`` is made of them). So importing BST must change nothing for a
transformers model (its names are prefixed, ``bst_*``), and several copies of BST's code (``trust_remote_code``
folders, each its own module, and the installed package) must work side by side, whichever copy registered last.
Both run in a fresh process, where the import order is the test's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTForCausalLM
from modeling_bst.configuration_bst import LAYER_TYPE_NAMES


REPO = Path(__file__).resolve().parents[3]

# One fresh process for both tests (a process start with torch and transformers is most of their time): a
# transformers model before any BST code is loaded, two BST folders and the installed package side by side, then the
# transformers model again.
SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM, DynamicCache, RecurrentGemmaConfig, RecurrentGemmaForCausalLM
from transformers import StaticCache, cache_utils

torch.set_num_threads(1)
a_folder, b_folder, ids, new = json.loads(sys.argv[1])
ids = torch.tensor(ids)


def transformers_model():
    torch.manual_seed(0)
    config = RecurrentGemmaConfig(  # its blocks are "recurrent", a word BST used as a layer type before
        num_hidden_layers=3, vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        attention_window_size=4, block_types=["recurrent", "recurrent", "attention"],
    )
    model = RecurrentGemmaForCausalLM(config).eval()
    name = lambda cls: f"{cls.__module__}.{cls.__qualname__}"
    return {
        "dynamic": {k: name(v) for k, v in cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.items()},
        "static": {k: name(v) for k, v in cache_utils.STATIC_LAYER_TYPE_MAPPING.items()},
        "layers": [name(type(x)) for x in DynamicCache(config=config).layers],
        "static_layers": [name(type(x)) for x in StaticCache(config=config, max_cache_len=16).layers],
        "tokens": model.generate(ids, max_new_tokens=6, do_sample=False).tolist(),
    }


def greedy(model, **kwargs):
    return model.generate(ids, max_new_tokens=new, do_sample=False, **kwargs)[0, ids.shape[1]:].tolist()


out = {"transformers before": transformers_model()}
a = AutoModelForCausalLM.from_pretrained(a_folder, trust_remote_code=True).eval()
out["a alone"] = greedy(a)
b = AutoModelForCausalLM.from_pretrained(b_folder, trust_remote_code=True).eval()  # registers its cache layers last
modules = {type(a).__module__, type(b).__module__}
assert len(modules) == 2 and all(m.startswith("transformers_modules.") for m in modules), modules
assert "modeling_bst" not in sys.modules
out["a beside b"], out["b beside a"] = greedy(a), greedy(b)
out["a, b drafting"], out["b, a drafting"] = greedy(a, assistant_model=b), greedy(b, assistant_model=a)

import modeling_bst  # the installed package beside the folders: its cache layers are now the registered ones

package = modeling_bst.BSTForCausalLM.from_pretrained(a_folder).eval()
out["package"], out["a beside the package"], out["b beside the package"] = greedy(package), greedy(a), greedy(b)
out["package, b drafting"] = greedy(package, assistant_model=b)
out["b, package drafting"] = greedy(b, assistant_model=package)
out["transformers after"] = transformers_model()
print("RESULT " + json.dumps(out))
"""
IDS = [[1, 9, 4, 33, 17, 8, 2, 40, 12]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """Two ``trust_remote_code`` folders of different models (their greedy tokens alone, by the package) and the
    fresh process's results."""
    tmp_path = tmp_path_factory.mktemp("side_by_side")
    configs = {
        "a": tiny_config(vocab_size=64),
        "b": tiny_config(vocab_size=64, context_mode="mf", bst_layer_indices=[0, 2], recurrent_layer_indices=[1]),
    }
    expected = {}
    for seed, (tag, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = BSTForCausalLM(config).eval()
        model.save_pretrained(tmp_path / tag)  # with the modeling files: a trust_remote_code folder
        tokens = model.generate(torch.tensor(IDS), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected[tag] = tokens[0, len(IDS[0]) :].tolist()
    assert expected["a"] != expected["b"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TRANSFORMERS_VERBOSITY="error")
    args = json.dumps([str(tmp_path / "a"), str(tmp_path / "b"), IDS, NEW_TOKENS])
    # From the repository root: the installed package is this checkout's modeling_bst.
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return expected, json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_importing_bst_changes_nothing_for_a_transformers_model_with_the_same_words(side_by_side):
    _, out = side_by_side
    before, after = out["transformers before"], out["transformers after"]
    for mapping in ("dynamic", "static"):
        # every name transformers had keeps its class; BST adds its own names, all prefixed
        assert {k: after[mapping][k] for k in before[mapping]} == before[mapping]
        assert set(after[mapping]) - set(before[mapping]) == set(LAYER_TYPE_NAMES.values())
        assert not {"block", "bst", "recurrent", "gss"} & set(after[mapping])
    for key in ("layers", "static_layers", "tokens"):
        assert after[key] == before[key], key


def test_two_folders_and_the_package_generate_side_by_side_and_draft_for_each_other(side_by_side):
    """Two ``trust_remote_code`` folders of different models and the installed package in one process: each
    generates its own greedy tokens, and assisted decoding with one as the other's draft gives the target's."""
    expected, out = side_by_side
    a_runs = ("a alone", "a beside b", "a, b drafting", "package", "a beside the package", "package, b drafting")
    b_runs = ("b beside a", "b, a drafting", "b beside the package", "b, package drafting")
    assert {key: out[key] for key in a_runs} == {key: expected["a"] for key in a_runs}
    assert {key: out[key] for key in b_runs} == {key: expected["b"] for key in b_runs}
