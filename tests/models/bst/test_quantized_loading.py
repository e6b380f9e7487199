"""Loading a BST model the ways users load models that do not fit (issue #45, point 2): bitsandbytes 8-bit and 4-bit
(its CPU backend), torchao int8 weight-only, and a ``device_map`` with layers offloaded to disk (accelerate).

Quantized: every ``nn.Linear`` outside the SSM kernels is quantized, the SSM kernels (``_keep_in_fp32_modules``) and
MH's / MF's per-head weights (raw parameters) stay float32, and the model runs the context path on it (SSM outputs
cast to the activation dtype, not to a quantized weight's int8 / uint8). Tolerances, measured on these tiny models
(4 variants, logits of 2 x 18 tokens):

* 4-bit NF4 and torchao int8 weight-only compute ``x @ dequantize(W)``: the quantized model equals the float model
  whose weights are replaced by their dequantized values (measured <= 9.1e-7; asserted 1e-5): BST adds no error of
  its own. Against the float model the relative logit error ||dl|| / ||l|| is the weights' rounding: 4-bit
  0.18-0.25 (16 levels per block of 64), torchao 0.007-0.010 (255 levels per row); asserted 0.35 and 0.02.
* 8-bit LLM.int8 also quantizes the activations (per row, in float16): against the dequantized-weight model the
  logits differ by 0.025-0.038, against the float model relatively by 0.010-0.016; asserted 0.03.
* Greedy decoding with the cache equals greedy decoding without it (the recurrent step on the quantized weights
  matches the full-sequence form). Greedy tokens against the float model's (8 new tokens, 2 rows): torchao all equal
  (asserted), 8-bit 81-100% and 4-bit 62-100% equal (stated, not asserted: a random tiny model's top logits are close).

Offloaded: ``device_map="auto"`` with a ``max_memory`` that leaves layers on disk (``offload_folder``) gives the
in-memory model's logits and greedy tokens exactly. (CPU offload proper, weights on the CPU for an accelerator,
needs an accelerator: on a CPU-only machine accelerate keeps "cpu" layers in place; the same hooks serve both.)
"""

import pytest
import torch
from conftest import VARIANTS, tiny_config

from modeling_bst import BSTForCausalLM


CONTEXT_VARIANTS = ["sh-s4", "mh-s4", "mf-s4", "sh-unstruct"]


def ids():
    return torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def saved(tmp_path, request):
    """A tiny seeded model of ``request.param`` saved to ``tmp_path``, and the float model loaded back."""
    torch.manual_seed(0)
    BSTForCausalLM(tiny_config(**VARIANTS[request.param])).save_pretrained(tmp_path)
    return tmp_path, BSTForCausalLM.from_pretrained(tmp_path).eval()


def greedy(model, use_cache=True):
    with torch.no_grad():
        return model.generate(ids()[:, :6], max_new_tokens=8, do_sample=False, use_cache=use_cache)[:, 6:]


def logits(model):
    with torch.no_grad():
        return model(ids()).logits


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def dequantized_twin(folder, quantized, dequantize):
    """The float model of ``folder`` with every quantized linear weight of ``quantized`` replaced by its dequantized
    value (``dequantize(module)``, None for a module left as it was); and how many were replaced."""
    twin = BSTForCausalLM.from_pretrained(folder).eval()
    twins, replaced = dict(twin.named_modules()), 0
    for name, module in quantized.named_modules():
        weight = dequantize(module) if isinstance(module, torch.nn.Linear) else None
        if weight is not None:
            twins[name].weight.data.copy_(weight)
            replaced += 1
    return twin, replaced


def assert_ssm_and_per_head_weights_stay_float32(model):
    for name, module in model.named_modules():
        if name.endswith(".ssm"):
            for pname, p in module.named_parameters():
                assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, f"{name}.{pname}"
            assert all(type(m) is torch.nn.Linear for m in module.modules() if isinstance(m, torch.nn.Linear)), name
        if name.endswith(".context"):
            for pname, p in module.named_parameters(recurse=False):  # MH / MF: per-head lifts and projections
                assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, f"{name}.{pname}"


@pytest.mark.parametrize("saved", CONTEXT_VARIANTS, indirect=True)
@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_load_forward_generate(saved, bits):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the test extra (pip install -e .[test])")
    from transformers import BitsAndBytesConfig

    folder, reference = saved
    config = BitsAndBytesConfig(load_in_8bit=bits == 8, load_in_4bit=bits == 4)
    model = BSTForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu").eval()
    quantized_type = bnb.nn.Linear8bitLt if bits == 8 else bnb.nn.Linear4bit
    quantized_modules = [m for m in model.modules() if isinstance(m, quantized_type)]
    quantized = {n for n, m in model.named_modules() if isinstance(m, quantized_type)}
    # Every projection outside the SSM kernels is quantized (the tied lm_head stays, as transformers keeps it),
    # the context path's input projection included.
    expected = {
        n
        for n, m in reference.named_modules()
        if isinstance(m, torch.nn.Linear) and ".ssm." not in n and n != "lm_head"
    }
    assert quantized == expected and "model.layers.0.context.down_proj" in quantized
    assert_ssm_and_per_head_weights_stay_float32(model)

    got, want = logits(model), logits(reference)
    if bits == 4:
        twin, replaced = dequantized_twin(
            folder,
            model,
            lambda m: (
                bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state) if m in quantized_modules else None
            ),
        )
        assert replaced == len(quantized)
        torch.testing.assert_close(got, logits(twin), atol=1e-5, rtol=0)
        assert relative_error(got, want) < 0.35
    else:
        assert relative_error(got, want) < 0.03
    assert torch.equal(greedy(model), greedy(model, use_cache=False))


@pytest.mark.parametrize("saved", CONTEXT_VARIANTS, indirect=True)
def test_torchao_int8_weight_only(saved):
    pytest.importorskip("torchao", reason="torchao is in the test extra (pip install -e .[test])")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    folder, reference = saved
    model = BSTForCausalLM.from_pretrained(
        folder, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), device_map="cpu"
    ).eval()
    assert_ssm_and_per_head_weights_stay_float32(model)
    twin, replaced = dequantized_twin(
        folder, model, lambda m: None if type(m.weight) is torch.nn.Parameter else m.weight.dequantize()
    )
    assert replaced > 0 and type(model.model.layers[0].context.down_proj.weight) is not torch.nn.Parameter
    got = logits(model)
    torch.testing.assert_close(got, logits(twin), atol=1e-5, rtol=0)
    assert relative_error(got, logits(reference)) < 0.02
    assert torch.equal(greedy(model), greedy(model, use_cache=False))
    assert torch.equal(greedy(model), greedy(reference))


@pytest.mark.parametrize("saved", [*CONTEXT_VARIANTS, "brect"], indirect=True)
def test_disk_offload_equals_the_in_memory_model(saved):
    pytest.importorskip("accelerate", reason="device_map needs accelerate (pip install -e .[train])")
    folder, reference = saved
    # Room for the embedding and at most one layer: the rest goes to disk.
    embedding = reference.model.embed_tokens.weight.numel() * 4
    layer = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in reference.model.layers)
    model = BSTForCausalLM.from_pretrained(
        folder,
        device_map="auto",
        max_memory={"cpu": embedding + layer},
        offload_folder=str(folder / "offload"),
    ).eval()
    assert "disk" in model.hf_device_map.values(), model.hf_device_map
    torch.testing.assert_close(logits(model), logits(reference), atol=0, rtol=0)
    assert torch.equal(greedy(model), greedy(reference))
