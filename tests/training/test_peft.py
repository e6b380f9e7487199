"""PEFT LoRA on a BST model (issue #36): the adapter on the attention projections trains (only the adapter), changes
the output, saves and loads back, and ``merge_and_unload`` gives the adapter model's logits in a plain BST model."""

import pytest
import torch
from conftest import tiny_config

from modeling_bst import BSTForCausalLM


peft = pytest.importorskip("peft", reason="PEFT is in the test extra (pip install -e .[test])")

# Every attention projection: self-attention Q/K/V, the cross-attention query, the context-state K/V, the output.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_lora_trains_merges_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    BSTForCausalLM(tiny_config()).save_pretrained(tmp_path / "base")
    base = BSTForCausalLM.from_pretrained(tmp_path / "base").eval()
    ids = torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(1))
    before = logits(base, ids)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    adapted_modules = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert {n.split(".")[-1] for n in adapted_modules} == set(TARGETS)
    assert any(n.endswith("context.k_proj") for n in adapted_modules)  # the BST context-state projections too
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # A fresh adapter (B = 0) leaves the model as it was.
    torch.testing.assert_close(logits(model.eval(), ids), before, atol=0, rtol=0)

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # Every adapter gets a gradient (B, the factor that starts at zero; A's gradient is zero at the first step).
    lora_b = [(n, p) for n, p in model.named_parameters() if ".lora_B." in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora_b), [n for n, _ in lora_b]
    optimizer.step()
    model.eval()
    adapted = logits(model, ids)
    assert (adapted - before).abs().max() > 1e-3  # the step changed the output
    for name, p in model.get_base_model().named_parameters():
        if "lora_" not in name:  # the base weights stay as they were
            assert torch.equal(p, frozen[name.replace(".base_layer", "")]), name

    # The adapter alone saves and loads back onto the base model.
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = peft.PeftModel.from_pretrained(BSTForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded.eval(), ids), adapted, atol=0, rtol=0)
    # Greedy generation through the adapter model.
    with torch.no_grad():
        generated = model.generate(input_ids=ids[:, :6], max_new_tokens=5, do_sample=False)

    # Merged into the weights: a plain BST model with the adapter model's logits, which saves and loads as one.
    merged = model.merge_and_unload()
    assert type(merged) is BSTForCausalLM
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), adapted, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(merged.generate(input_ids=ids[:, :6], max_new_tokens=5, do_sample=False), generated)
    merged.save_pretrained(tmp_path / "merged")
    loaded = BSTForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(loaded, ids), logits(merged, ids), atol=0, rtol=0)


# MH's and MF's per-head lifts and projections are raw parameters `(H or S, in, out)`: PEFT adapts them through
# ``target_parameters`` (a rank-r adapter per head), beside every ``nn.Linear`` of ``"all-linear"``.
PER_HEAD = {"mh": ["context.up_proj", "context.k_proj", "context.v_proj"], "mf": ["context.up_proj"], "sh": []}


@pytest.mark.parametrize("variant", ["mh-s4", "mf-s4", "sh-unstruct"])
def test_lora_on_all_linear_and_per_head_weights_trains_the_context_path(variant):
    from conftest import VARIANTS

    torch.manual_seed(0)
    base = BSTForCausalLM(tiny_config(**VARIANTS[variant])).eval()
    ids = torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(1))
    before = logits(base, ids)
    builder = base.model.layers[0].context
    contexts = []
    builder.register_forward_hook(lambda module, args, out: contexts.append(out[0].detach()))

    targets = PER_HEAD[VARIANTS[variant]["context_mode"]]
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", target_parameters=targets or None)
    model = peft.get_peft_model(base, config)
    # Adapted modules (a per-head weight's adapter wraps the builder: one "...context" entry per weight).
    adapted = [
        n.split(".lora_A.")[0].replace(".base_layer", "") for n, _ in model.named_parameters() if ".lora_A." in n
    ]
    assert "base_model.model.model.layers.0.context.down_proj" in adapted
    assert adapted.count("base_model.model.model.layers.0.context") == len(targets)
    contexts.clear()
    # B = 0: no change yet (up to float32 rounding: an adapted per-head weight is recomposed as W + 0 in a new tensor)
    torch.testing.assert_close(logits(model.eval(), ids), before, atol=1e-6, rtol=0)
    fresh = contexts[-1]

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    # Every adapter is used: its B factor has a gradient (the unstruct filter's MLP, called as modules, included).
    lora_b = [(n, p) for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora_b), [
        n for n, p in lora_b if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert sum(".context" in n for n, _ in lora_b) >= 1 + len(targets) and len(lora_b) == len(adapted)
    optimizer.step()
    contexts.clear()
    adapted_logits = logits(model.eval(), ids)
    assert (contexts[-1] - fresh).abs().max() > 1e-3  # the context path's keys changed
    assert (adapted_logits - before).abs().max() > 1e-3
    # Merged into the weights (compared in float64: the unstruct filter's sine MLP amplifies float32 rounding).
    model.double()
    adapted_logits = logits(model, ids)
    merged = model.merge_and_unload()
    assert type(merged) is BSTForCausalLM
    torch.testing.assert_close(logits(merged, ids), adapted_logits, atol=1e-9, rtol=0)


def test_qlora_on_a_4bit_model_trains_its_adapters(tmp_path):
    """LoRA on a bitsandbytes 4-bit model (QLoRA): the adapters, the context path's included, get gradients."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the test extra (pip install -e .[test])")
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    BSTForCausalLM(tiny_config(context_mode="mh")).save_pretrained(tmp_path)
    base = BSTForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    )
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", target_parameters=PER_HEAD["mh"])
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    lora_b = [(n, p) for n, p in model.named_parameters() if ".lora_B." in n]
    assert sum(".context" in n for n, _ in lora_b) >= 4
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora_b)
