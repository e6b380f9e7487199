"""Every Auto class loads a saved or exported folder in a fresh process where ``modeling_bst`` cannot be imported
(the outside-client case: ``trust_remote_code=True`` runs the modeling files copied into the folder)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import conftest
import torch
import transformers
from safetensors.torch import load_file, save_file

import modeling_bst
from modeling_bst import BSTConfig, BSTForCausalLM, BSTForSequenceClassification, BSTModel
from modeling_bst.configuration_bst import AUTO_MAP
from training import export as export_mod


REPO = Path(__file__).resolve().parents[3]
HEADS = {
    "AutoConfig": "BSTConfig",
    "AutoModel": "BSTModel",
    "AutoModelForCausalLM": "BSTForCausalLM",
    "AutoModelForSequenceClassification": "BSTForSequenceClassification",
}

# Run with `python -I` (no PYTHONPATH, no cwd on sys.path) from a temporary directory; the editable install's
# finder and any repository path are removed too, and a regular install is blocked, so that `import modeling_bst`
# fails as it does for a client that only has the saved folder.
CLIENT = """
import importlib, importlib.util, sys
from pathlib import Path
repo = Path({repo!r}).resolve()
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if p and not Path(p).resolve().is_relative_to(repo) or "site-packages" in p]
for name in ("modeling_bst", "training"):
    if importlib.util.find_spec(name) is not None:
        sys.modules[name] = None
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{name}} is importable in the client process")

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

ids = load_file({ids!r})["ids"]
out = {{}}
for tag, folder in {folders!r}.items():
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(config).__name__ == "BSTConfig" and "transformers_modules" in type(config).__module__
    heads = [("model", AutoModel, {{}}), ("lm", AutoModelForCausalLM, {{}}),
             ("cls", AutoModelForSequenceClassification, {{"num_labels": 3}})]
    for head, auto, kwargs in heads:
        model = auto.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()
        assert "transformers_modules" in type(model).__module__, type(model).__module__
        out[f"{{tag}}.{{head}}.class"] = type(model).__name__
        with torch.no_grad():
            result = model(ids)
        key = "last_hidden_state" if head == "model" else "logits"
        save_file({{"y": getattr(result, key).contiguous()}}, f"{{folder}}/client-{{head}}.safetensors")
        if head == "cls":
            save_file({{"w": model.score.weight.contiguous()}}, f"{{folder}}/client-score.safetensors")
            assert model.config.num_labels == 3
print("RESULT " + __import__("json").dumps(out))
"""


def tiny_config(**kw) -> BSTConfig:
    """The suite's tiny config, two layers (block + BST) and a 64-token vocabulary."""
    return conftest.tiny_config(**{"vocab_size": 64, "num_hidden_layers": 2, "bst_layer_indices": [0], **kw})


def test_config_auto_map_lists_every_head(tmp_path):
    # Every Auto class modeling_bst/__init__.py registers a BST class with, and nothing else.
    registered = {"AutoConfig": "configuration_bst.BSTConfig"}
    for name in dir(transformers):
        mapping = (
            getattr(getattr(transformers, name), "_model_mapping", None) if name.startswith("AutoModel") else None
        )
        if mapping is not None:
            try:
                registered[name] = f"modeling_bst.{mapping[BSTConfig].__name__}"
            except KeyError:
                pass
    assert AUTO_MAP == registered
    assert AUTO_MAP == {
        k: ("configuration_bst." if k == "AutoConfig" else "modeling_bst.") + v for k, v in HEADS.items()
    }
    torch.manual_seed(0)
    for model in (BSTForCausalLM(tiny_config()), BSTModel(tiny_config()), BSTForSequenceClassification(tiny_config())):
        folder = tmp_path / type(model).__name__
        model.save_pretrained(folder)
        assert json.loads((folder / "config.json").read_text())["auto_map"] == AUTO_MAP
        code = {p.name for p in Path(modeling_bst.__file__).parent.glob("*_bst.py")}
        assert len(code) >= 6 and code <= {p.name for p in folder.iterdir()}
    # A config.json that already has an auto_map (e.g. Hub-prefixed entries) keeps its entries.
    hub = {"AutoModelForCausalLM": "org/bst--modeling_bst.BSTForCausalLM"}
    assert BSTConfig(auto_map=hub).auto_map == {**AUTO_MAP, **hub}


def test_every_auto_class_loads_in_a_fresh_process_without_the_package(tmp_path):
    torch.manual_seed(0)
    lm = BSTForCausalLM(tiny_config()).eval()
    lm.config.use_cache = False  # what Trainer leaves behind; the export sets it back
    saved = tmp_path / "run" / "final"
    lm.save_pretrained(saved)
    exported = export_mod.export(str(saved), str(tmp_path / "hub"))
    cls_model = BSTForSequenceClassification(tiny_config(num_labels=3)).eval()
    cls_folder = tmp_path / "classifier"
    cls_model.save_pretrained(cls_folder)
    folders = {"saved": str(saved), "exported": str(exported), "classifier": str(cls_folder)}

    ids = torch.randint(0, 64, (2, 11))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    script = CLIENT.format(repo=str(REPO), ids=str(tmp_path / "ids.safetensors"), folders=folders)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=client_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    classes = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for tag in folders:
        assert classes[f"{tag}.model.class"] == "BSTModel"
        assert classes[f"{tag}.lm.class"] == "BSTForCausalLM"
        assert classes[f"{tag}.cls.class"] == "BSTForSequenceClassification"

    def client(folder, head, key="y"):
        return load_file(f"{folder}/client-{head}.safetensors")[key]

    tol = dict(atol=1e-5, rtol=1e-5)  # another process may schedule reductions differently
    with torch.no_grad():
        for tag in ("saved", "exported"):
            folder = folders[tag]
            torch.testing.assert_close(client(folder, "lm"), lm(ids).logits, **tol)
            torch.testing.assert_close(client(folder, "model"), lm.model(ids).last_hidden_state, **tol)
            # The classifier head is new (initialised at load): give the in-process model the client's head.
            head = BSTForSequenceClassification.from_pretrained(folder, num_labels=3).eval()
            head.score.weight.copy_(client(folder, "score", "w"))
            torch.testing.assert_close(client(folder, "cls"), head(ids).logits, **tol)
        folder = folders["classifier"]
        torch.testing.assert_close(client(folder, "score", "w"), cls_model.score.weight)
        torch.testing.assert_close(client(folder, "cls"), cls_model(ids).logits, **tol)
        torch.testing.assert_close(client(folder, "model"), cls_model.model(ids).last_hidden_state, **tol)
