"""The plugin's layer maths without vLLM: a prompt prefilled in one piece, in chunks starting anywhere in a block,
or token by token in batched decode steps next to other requests gives the same hidden states, and greedy decoding
with these layers alone gives ``generate()``'s stored tokens."""

import json
from pathlib import Path

import pytest
import torch
from bst_vllm.config import BSTServingConfig
from bst_vllm.layers import BSTLayerMath, Decode, Prefill, rms_norm
from safetensors.torch import load_file


# Tiny tensors: intra-op threads only add overhead (and the 2-core CI box runs vLLM engines next to this).
torch.set_num_threads(1)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


class Stack:
    """The fixture checkpoint's layers with per-layer states for ``slots`` requests."""

    def __init__(self, name: str, slots: int = 3):
        fields = json.loads((FIXTURES / name / "config.json").read_text())
        fields.pop("model_type", None)
        self.config = BSTServingConfig(**fields)
        self.weights = load_file(FIXTURES / name / "model.safetensors")
        shapes = BSTLayerMath.state_shapes(self.config)
        self.layers, self.states = [], []
        for i, kind in enumerate(self.config.bst_layer_types):
            layer = BSTLayerMath(self.config, kind)
            prefix = f"model.layers.{i}."
            layer.load_state_dict({k[len(prefix) :]: v for k, v in self.weights.items() if k.startswith(prefix)})
            self.layers.append(layer)
            # Zeros, as the model's forward leaves a new request's slot (masked entries still enter the matmuls).
            self.states.append(tuple(torch.zeros(slots, *s) for s in shapes))

    def embed(self, ids):
        return self.weights["model.embed_tokens.weight"][torch.as_tensor(ids)]

    def chunk(self, ids, p0: int, slot: int):
        h = self.embed(ids)
        for layer, states in zip(self.layers, self.states):
            h = layer.forward_chunk(h, p0, tuple(s[slot] for s in states))
        return h

    def packed(self, prompts, slots):
        """Every prompt of ``prompts`` prefilled from position 0 in one packed call ([`Prefill`]): the hidden
        states of each prompt's last token `(P, D)`."""
        lengths = torch.tensor([len(p) for p in prompts])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        batch = Prefill.from_query_starts(starts, positions, torch.as_tensor(slots), self.config.block_len)
        h = self.embed([t for p in prompts for t in p])
        for layer, states in zip(self.layers, self.states):
            h = layer.prefill(h, batch, states)
        return h[starts[1:] - 1]

    def step(self, ids, positions, slots):
        h = self.embed(ids)
        batch = Decode(torch.as_tensor(positions), torch.as_tensor(slots), self.config)
        for layer, states in zip(self.layers, self.states):
            h = layer.decode(h, batch, states)
        return h

    def logits(self, h):
        h = rms_norm(h, self.weights["model.norm.weight"], self.config.rms_norm_eps)
        head = self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])
        return (h * self.config.logit_scale) @ head.t()


@pytest.mark.parametrize("name", list(EXPECTED["models"]))
@torch.no_grad()
def test_chunks_and_steps_agree(name):
    ids = EXPECTED["prompts"][-1]  # 150 tokens: 9 blocks of 16 and a part
    whole = Stack(name).chunk(ids, 0, 0)
    for pieces in ([37, 63, 50], [5, 11, 16, 1, 20, 97]):
        stack, start, outs = Stack(name), 0, []
        for n in pieces:
            outs.append(stack.chunk(ids[start : start + n], start, 1))
            start += n
        torch.testing.assert_close(torch.cat(outs), whole, atol=2e-5, rtol=0)
    # A prefill of 90 tokens, then token by token, batched with two other requests at other positions (slots 0, 2).
    stack = Stack(name)
    other = EXPECTED["prompts"][-2]
    stack.chunk(other[:40], 0, 0)
    stack.chunk(other[:7], 0, 2)
    outs = [stack.chunk(ids[:90], 0, 1)]
    for p in range(90, len(ids)):
        h = stack.step([other[p - 50], ids[p], other[p - 83]], [p - 50, p, p - 83], [0, 1, 2])
        outs.append(h[1:2])
    torch.testing.assert_close(torch.cat(outs), whole, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", list(EXPECTED["models"]))
@torch.no_grad()
def test_greedy_tokens_equal_generate(name):
    """Prefill all 8 prompts in one packed call (into slots in another order), then decode all 8 requests
    together: the stored ``generate()`` tokens."""
    stack = Stack(name, slots=8)
    prompts = EXPECTED["prompts"]
    slots = [5, 2, 7, 0, 1, 6, 3, 4]
    last = stack.logits(stack.packed(prompts, slots)).argmax(-1).tolist()
    got = [[t] for t in last]
    for step in range(1, EXPECTED["max_new_tokens"]):
        positions = [len(p) + step - 1 for p in prompts]
        logits = stack.logits(stack.step(last, positions, slots))
        last = logits.argmax(-1).tolist()
        for g, t in zip(got, last):
            g.append(t)
    assert got == EXPECTED["models"][name]
