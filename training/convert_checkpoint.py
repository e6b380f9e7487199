"""Convert a checkpoint folder written by an earlier layout of ``modeling_bst`` to the current parameter names.

    python -m training.convert_checkpoint OLD_FOLDER NEW_FOLDER

The model's code knows only the current names: loaded directly, such a folder's renamed parameters are left out
(transformers' load report lists them as unexpected, their layers keep fresh weights). The weights keep their values and
dtypes (only names change, so the converted model's logits are those of the original), the config is rewritten by the
current ``BSTConfig``, the folder gets the current modeling code (``trust_remote_code`` loads it) and every other file
(tokenizer, generation config, model card, training records) is copied unchanged. Safetensors only: a pickled
``pytorch_model.bin`` is refused, since unpickling runs code.

Parameter names by layout, relative to ``model.layers.N.``:

* first layout (one flat decoder layer): ``q_proj`` / ``k_proj`` / ``v_proj`` / ``self_scale`` / ``relative_bias``
  of the self-attention, ``up_proj`` / ``down_proj`` of the MLP, ``q2_proj`` / ``cross_scale`` of the second
  attention, ``context.*`` (BST) and ``recurrent.*`` (BRecT) beside them;
* second layout: ``self_attn.*``, ``mlp.*``, ``cross_attn.{q_proj,scale}``, the context builder with its SSM kernel at
  ``cross_attn.context.*`` (kernel: ``cross_attn.context.ssm.*``) and the BRecT state at ``cross_attn.recurrent.*``;
* current layout: as the second, with the SSM kernel at ``ssm.*``, the context builder at ``context.*`` and the BRecT
  state at ``recurrent.*``, siblings of ``cross_attn`` (the layer's steps, ``BSTContextLayer``).

GSS layers kept their names throughout. Converting a current-layout folder changes nothing.
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

import modeling_bst
from modeling_bst import BSTConfig


# First layout -> second layout, per layer type (a bare name is ambiguous: ``v_proj`` of an attention layer is the
# self-attention's, of a GSS layer the gate's).
FIRST_TO_SECOND = {
    "block": {
        "q_proj.": "self_attn.q_proj.",
        "k_proj.": "self_attn.k_proj.",
        "v_proj.": "self_attn.v_proj.",
        "self_scale": "self_attn.scale",
        "relative_bias.": "self_attn.relative_bias.",
        "up_proj.": "mlp.up_proj.",
        "down_proj.": "mlp.down_proj.",
    },
}
FIRST_TO_SECOND["bst"] = {
    **FIRST_TO_SECOND["block"],
    "q2_proj.": "cross_attn.q_proj.",
    "cross_scale": "cross_attn.scale",
    "context.": "cross_attn.context.",
}
FIRST_TO_SECOND["recurrent"] = {
    **FIRST_TO_SECOND["block"],
    "q2_proj.": "cross_attn.q_proj.",
    "cross_scale": "cross_attn.scale",
    "recurrent.": "cross_attn.recurrent.",
}
# Second layout -> current layout (longest prefix first).
SECOND_TO_CURRENT = {
    "cross_attn.context.ssm.": "ssm.",
    "cross_attn.context.": "context.",
    "cross_attn.recurrent.": "recurrent.",
}
LAYER_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<index>\d+)\.)(?P<name>.+)$")


def _rename(name: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if name == old or (old.endswith(".") and name.startswith(old)):
            return new + name[len(old) :]
    return name


def current_name(key: str, layer_types: list[str]) -> str:
    """The current name of parameter ``key`` written by any earlier layout (``key`` itself if already current)."""
    match = LAYER_KEY.match(key)
    if match is None or int(match["index"]) >= len(layer_types):
        return key
    name = match["name"]
    # A current-layout name that also looks like a first-layout one (``context.*``, ``recurrent.*``) maps to itself:
    # first -> second -> current is the identity on it.
    name = _rename(name, FIRST_TO_SECOND.get(layer_types[int(match["index"])], {}))
    return match["prefix"] + _rename(name, SECOND_TO_CURRENT)


def _model_class(config: BSTConfig):
    names = config.architectures or ["BSTForCausalLM"]
    classes = {
        name: cls
        for name in modeling_bst.__all__
        if isinstance(cls := getattr(modeling_bst, name), type) and issubclass(cls, modeling_bst.BSTPreTrainedModel)
    }
    if names[0] not in classes:
        raise ValueError(f"config.architectures names {names[0]!r}, not a class of modeling_bst ({sorted(classes)}).")
    return classes[names[0]]


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(folder / shard)))
        return state
    if (folder / "pytorch_model.bin").exists():
        raise ValueError(
            f"{folder} holds pickled weights (pytorch_model.bin), which this tool does not load: unpickling runs code. "
            "Convert them to safetensors where you trust the file, then run this command."
        )
    raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json.")


def convert(src: str | Path, dst: str | Path) -> Path:
    """Write the checkpoint folder ``src`` with current parameter names to ``dst`` (which must not exist yet)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; choose a new folder (the conversion never overwrites).")
    config = BSTConfig.from_pretrained(src)
    layer_types = [config.layer_kind(i) for i in range(config.num_hidden_layers)]
    state = {current_name(key, layer_types): value for key, value in _load_weights(src).items()}
    model = _model_class(config)(config)
    expected = set(model.state_dict())
    tied = {key for key in expected if key.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    unknown, missing = sorted(set(state) - expected), sorted(expected - set(state) - tied)
    if unknown or missing:
        raise ValueError(
            f"{src} does not match the model its config describes: unknown parameters {unknown[:5]}, "
            f"missing {missing[:5]}."
        )
    model.load_state_dict(state, strict=False, assign=True)  # assign: keep the stored dtypes
    model.tie_weights()  # assign replaced the embedding that the LM head shares
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for path in src.iterdir():
        weights = path.name.startswith("model") and path.name.endswith((".safetensors", ".json"))
        if weights or path.suffix == ".py" or path.name == "config.json":
            continue
        if path.is_dir():
            shutil.copytree(path, tmp / path.name)
        else:
            shutil.copy2(path, tmp / path.name)  # over what save_pretrained wrote (the generation config)
    tmp.rename(dst)  # the folder appears complete or not at all
    return dst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint folder written by an earlier layout")
    parser.add_argument("dst", help="new folder for the converted checkpoint (must not exist)")
    args = parser.parse_args(argv)
    print(f"converted checkpoint written to {convert(args.src, args.dst)}")


if __name__ == "__main__":
    main()
