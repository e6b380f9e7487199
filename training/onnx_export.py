"""ONNX export of a BST model (``python -m training.export --onnx``): ``model.onnx`` (input ids -> logits),
``prefill.onnx`` (-> logits and the decoding state) and ``decode_step.onnx`` (one token and the state -> logits and
the new state), in fixed shapes, with ``onnx_state.json`` naming the state tensors; see [`export_onnx`] and
docs/clients.md. Needs the ``onnx`` extra (onnx, onnxscript; onnxruntime to run the files)."""

import json
import time
import warnings
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from tqdm.auto import tqdm

from modeling_bst.ssm_bst import real_arithmetic


class OnnxForward(torch.nn.Module):
    """The full forward for ONNX: ``input_ids`` `(B, L)` -> ``logits`` `(B, L, V)` (no cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=False).logits


class OnnxPrefill(torch.nn.Module):
    """The forward that also returns the decoding cache, flattened: ``input_ids`` -> ``(logits, *state)``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids, use_cache=True)
        return (out.logits, *pytree.tree_leaves(out.past_key_values))


class OnnxDecodeStep(torch.nn.Module):
    """One decoding step with the cache as a flat list of tensors (ONNX has no cache object):
    ``(input_ids (B, 1), *state)`` -> ``(logits (B, 1, V), *new state)``, the state tensors in the order (and with the
    names, [`cache_state_names`]) of the cache's pytree leaves; ``spec`` is the cache's tree structure."""

    def __init__(self, model, spec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, input_ids, *state):
        # Copies: a step updates the cache's tensors in place, the graph's inputs stay unchanged.
        cache = pytree.tree_unflatten([t.clone() for t in state], self.spec)
        out = self.model(input_ids, past_key_values=cache, use_cache=True)
        return (out.logits, *pytree.tree_leaves(out.past_key_values))


def cache_state_names(cache) -> list[str]:
    """The names of a cache's state tensors (``positions``, ``layers.0.k``, ...) in pytree-leaf order."""
    return [pytree.keystr(path)[2:-2] for path, _ in pytree.tree_flatten_with_path(cache)[0]]


def onnx_prefill(model, input_ids: torch.Tensor):
    """The PyTorch prefill whose cache an exported decode step continues: logits and the flat state tensors (in
    [`modeling_bst.ssm_bst.real_arithmetic`], as the export runs)."""
    with torch.no_grad(), real_arithmetic():
        out = model(input_ids, use_cache=True)
    return out.logits, pytree.tree_leaves(out.past_key_values), out.past_key_values


def export_onnx(
    model, folder, seq_len: int = 32, batch_size: int = 1, optimize: bool = True, progress: bool = True
) -> dict:
    """Export ``model`` (a ``BSTForCausalLM``) to ONNX in ``folder``, with ``torch.onnx.export(..., dynamo=True)``:

    * ``model.onnx``: ``input_ids`` `(batch_size, seq_len)` -> ``logits`` (fixed shape, no padding);
    * ``prefill.onnx``: the same forward returning the cache's state tensors too (``present.<name>``);
    * ``decode_step.onnx``: ``input_ids`` `(batch_size, 1)` and the state (``past.<name>``) -> ``logits`` and the
      new state (``present.<name>``), to be run once per token starting from prefill's state;
    * ``onnx_state.json``: the state names in input/output order, ``seq_len``, ``batch_size``.

    The SSM kernels run in real arithmetic while exporting ([`modeling_bst.ssm_bst.use_real_arithmetic`]: a direct
    convolution instead of the FFT; S4D states are always real pairs). Returns ``{"files": [...], "seconds": {...}}``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    vocab = model.config.vocab_size
    input_ids = torch.randint(1, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    _, state, cache = onnx_prefill(model, input_ids)
    names = cache_state_names(cache)
    spec = pytree.tree_structure(cache)
    seconds = {}
    # Each file takes from seconds to minutes (torch.onnx's tracing and optimisation): a bar per file, on stderr.
    bar = tqdm(total=3, desc="ONNX export", unit="file", disable=not progress)

    def run(name, module, args, input_names, output_names):
        bar.set_postfix_str(name)
        start = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                input_names=input_names,
                output_names=output_names,
                optimize=optimize,
                verbose=False,
            )
        program.save(str(folder / name))
        seconds[name] = time.perf_counter() - start
        bar.update(1)

    present = [f"present.{n}" for n in names]
    run("model.onnx", OnnxForward(model), (input_ids,), ["input_ids"], ["logits"])
    run("prefill.onnx", OnnxPrefill(model), (input_ids,), ["input_ids"], ["logits", *present])
    step_args = (input_ids[:, -1:], *[t.clone() for t in state])
    run(
        "decode_step.onnx",
        OnnxDecodeStep(model, spec),
        step_args,
        ["input_ids", *[f"past.{n}" for n in names]],
        ["logits", *present],
    )
    bar.close()
    (folder / "onnx_state.json").write_text(
        json.dumps({"state": names, "seq_len": seq_len, "batch_size": batch_size}, indent=2) + "\n"
    )
    files = ["model.onnx", "prefill.onnx", "decode_step.onnx", "onnx_state.json"]
    return {"files": [str(folder / f) for f in files], "seconds": seconds}
