"""The vLLM plugin's layer maths (``integrations/vllm/bst_vllm/layers.py``, importable without vLLM) against
``modeling_bst``, per position: every layer's output for every token of a prompt, prefilled in chunks that start
inside blocks and then decoded token by token in batched steps next to another request, equals the hidden states of
``modeling_bst``'s forward (``output_hidden_states=True``) in float64, for every variant the plugin serves
(``bst_vllm.config.check_supported``). Both sides use ``modeling_bst/functional_bst.py``, which the plugin loads by
path (the test that it is that file is here too)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import modeling_bst
from modeling_bst import BSTConfig, BSTForCausalLM


PLUGIN = Path(__file__).resolve().parents[2] / "integrations" / "vllm"
FIXTURES = PLUGIN / "tests" / "fixtures"
sys.path.insert(0, str(PLUGIN))
from bst_vllm import layers  # noqa: E402
from bst_vllm.config import BSTServingConfig, check_supported  # noqa: E402


# Tiny models beside the plugin's fixtures (slide, bst-sh-s4, bst-mf-s4, bst-mh-s4 with attend_self and a strict
# cross mask): the options of the serving maths the fixtures leave at their defaults.
COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=8,
    intermediate_size=48,
    max_position_embeddings=256,
    block_len=8,
    ssm_state_size=8,
    num_context_states=3,
    tie_word_embeddings=False,
)
BUILT = {
    "sh-raw-strict-self-noqk": dict(
        bst_layer_indices=[0, 2], context_mode="sh", ssm_input="raw", cross_mask="strict", attend_self=True,
        qk_norm=False,
    ),
    "mh-inclusive": dict(bst_layer_indices=[1], context_mode="mh", ssm_hidden_size=5),
    "mf-ids-after-norm-ssm-output": dict(
        bst_layer_indices=[0, 1], context_mode="mf", mf_context_ids_after_norm=True, mf_initial_context="ssm_output",
    ),
    # The other layer kinds and SSMs: unstruct filters (a filter shorter than the sequence: its history is full and
    # drops inputs), one S4D per MF filter, Block-Recurrent and GSS layers (beside BST and block layers).
    "sh-unstruct-short-filter": dict(
        bst_layer_indices=[0, 2], context_mode="sh", ssm_kind="unstruct", max_position_embeddings=20,
        unstruct_order=8, unstruct_emb_dim=5,
    ),
    "mh-unstruct": dict(bst_layer_indices=[1], context_mode="mh", ssm_kind="unstruct", unstruct_order=8),
    "mf-unstruct-short-filter": dict(
        bst_layer_indices=[0, 1], context_mode="mf", ssm_kind="unstruct", max_position_embeddings=20,
        unstruct_order=8,
    ),
    "mf-independent-filters": dict(bst_layer_indices=[0, 2], context_mode="mf", mf_independent_filters=True),
    "recurrent": dict(bst_layer_indices=[], recurrent_layer_indices=[1], num_recurrent_states=5),
    "recurrent-bst-self": dict(
        bst_layer_indices=[0], recurrent_layer_indices=[2], num_recurrent_states=4, attend_self=True,
    ),
    "gss-bst-recurrent": dict(bst_layer_indices=[1], gss_layer_indices=[0], recurrent_layer_indices=[2],
                              num_recurrent_states=3, gss_expansion=2),
}  # fmt: skip
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def checkpoint(name: str, tmp_path: Path) -> Path:
    if name in BUILT:
        torch.manual_seed(0)
        model = BSTForCausalLM(BSTConfig(**{**COMMON, **BUILT[name]}))
        with torch.no_grad():  # non-trivial values where the init leaves ones or zeros
            for param_name, param in model.named_parameters():
                if param_name.endswith(("norm.weight", "scale", "initial_context", "context_ids", "gate_bias")):
                    param.add_(0.3 * torch.randn_like(param))
        model.save_pretrained(tmp_path / name)
        return tmp_path / name
    return FIXTURES / name


class PluginStack:
    """The checkpoint's layers as the plugin builds them, in float64, with per-layer states for ``slots`` requests."""

    def __init__(self, folder: Path, slots: int = 2):
        fields = json.loads((folder / "config.json").read_text())
        fields.pop("model_type", None)
        self.config = BSTServingConfig(**fields)
        check_supported(self.config)
        weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
        self.embed_weight, self.norm_weight = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
        shapes = layers.BSTLayerMath.state_shapes(self.config)
        self.layers, self.states = [], []
        for i, kind in enumerate(self.config.bst_layer_types):
            layer = layers.BSTLayerMath(self.config, kind).double()
            prefix = f"model.layers.{i}."
            layer.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
            self.layers.append(layer)
            self.states.append(tuple(torch.zeros(slots, *s, dtype=torch.float64) for s in shapes))

    def outputs(self, h):
        """Every layer's output, the last one through the final norm (as ``hidden_states[1:]``)."""
        return h[:-1] + [layers.rms_norm(h[-1], self.norm_weight, self.config.rms_norm_eps)]

    def chunk(self, ids, p0: int, slot: int) -> list[torch.Tensor]:
        h, out = self.embed_weight[torch.as_tensor(ids)], []
        for layer, states in zip(self.layers, self.states):
            h = layer.forward_chunk(h, p0, tuple(s[slot] for s in states))
            out.append(h)
        return self.outputs(out)

    def packed(self, requests, padding=float("inf")) -> list[list[torch.Tensor]]:
        """The chunks ``requests`` = ``[(ids, p0, slot), ...]`` in packed prefill calls, one per run of
        ``layers.Prefill.groups`` (``padding`` inf: one call for all); each request's layer outputs."""
        lengths = torch.tensor([len(ids) for ids, _, _ in requests])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        positions = torch.cat([torch.arange(p0, p0 + len(ids)) for ids, p0, _ in requests])
        slots = torch.tensor([slot for _, _, slot in requests])
        runs = layers.Prefill.groups(starts, positions, slots, self.config.block_len, padding)
        h, out = self.embed_weight[torch.tensor([t for ids, _, _ in requests for t in ids])], []
        for layer, states in zip(self.layers, self.states):
            h = torch.cat([layer.prefill(h[a:b], batch, states) for a, b, batch in runs])
            out.append(h)
        out = self.outputs(out)
        return [[o[s:e] for o in out] for s, e in zip(starts[:-1].tolist(), starts[1:].tolist())]

    def step(self, ids, positions, slots) -> list[torch.Tensor]:
        h, out = self.embed_weight[torch.as_tensor(ids)], []
        batch = layers.Decode(torch.as_tensor(positions), torch.as_tensor(slots), self.config)
        for layer, states in zip(self.layers, self.states):
            h = layer.decode(h, batch, states)
            out.append(h)
        return self.outputs(out)


@pytest.mark.parametrize("name", FIXTURE_NAMES + sorted(BUILT))
@torch.no_grad()
def test_plugin_layers_equal_modeling_bst_per_position(name, tmp_path):
    folder = checkpoint(name, tmp_path)
    model = BSTForCausalLM.from_pretrained(folder).double().eval()
    stack = PluginStack(folder)
    w = stack.config.block_len
    length = 5 * w + 3
    ids = torch.randint(1, stack.config.vocab_size, (length,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states[1:]
    # Prefill in chunks that start inside a block (one spans several blocks), then decode token by token in batched
    # steps next to a second request at other positions.
    cut1, cut2 = w // 2 + 1, 3 * w + 2
    got = [stack.chunk(ids[:cut1], 0, 0), stack.chunk(ids[cut1:cut2], cut1, 0)]
    other = ids[::-1]
    stack.chunk(other[:3], 0, 1)
    for p in range(cut2, length):
        q = p - cut2 + 3
        got.append([h[:1] for h in stack.step([ids[p], other[q]], [p, q], [0, 1])])
    assert len(expected) == len(stack.layers)
    for layer, want in enumerate(expected):
        have = torch.cat([g[layer] for g in got])
        torch.testing.assert_close(have, want[0], atol=1e-10, rtol=1e-10, msg=f"{name}: layer {layer}")


@pytest.mark.parametrize("name", FIXTURE_NAMES + sorted(BUILT))
@torch.no_grad()
def test_packed_prefill_equals_modeling_bst_per_position(name, tmp_path):
    """Several requests' chunks in one prefill call (``BSTLayerMath.prefill``): new requests (in slots holding
    another request's state) beside chunks continuing saved states from inside a block, of unequal lengths, then
    batched decode steps; every layer's output at every position of every request equals ``modeling_bst``'s."""
    folder = checkpoint(name, tmp_path)
    model = BSTForCausalLM.from_pretrained(folder).double().eval()
    stack = PluginStack(folder, slots=4)
    w = stack.config.block_len
    g = torch.Generator().manual_seed(11)
    lengths = (5 * w + 3, 4 * w + 1, 2 * w + 5)
    prompts = [torch.randint(1, stack.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    for states in stack.states:  # stale states of earlier requests in every slot: new requests must not read them
        for s in states:
            s.normal_(generator=g)
    got = [[] for _ in prompts]
    # Step 1: A's first chunk, B whole up to 1.5 blocks (new requests). Step 2: A from inside its first block
    # across 3 blocks, B from inside a block, C new. Step 3: A and C to their ends (mid-block starts).
    a1, a2, b1, c1 = w // 2 + 1, 3 * w + 2, w + w // 2, w + 3
    schedule = [
        [(0, 0, a1, 2), (1, 0, b1, 0)],
        [(0, a1, a2, 2), (1, b1, lengths[1] - 2, 0), (2, 0, c1, 3)],
        [(2, c1, lengths[2] - 1, 3), (0, a2, lengths[0] - 3, 2)],
    ]
    slot_of = {0: 2, 1: 0, 2: 3}
    for i, chunks in enumerate(schedule):  # the last step split into runs of one chunk each (unequal lengths)
        outs = stack.packed([(prompts[r][s:e], s, slot) for r, s, e, slot in chunks], 1.0 if i == 2 else float("inf"))
        for (r, *_), out in zip(chunks, outs):
            got[r].append(out)
    # Then the last tokens of all three as batched decode steps (positions differ per request).
    ends = [lengths[0] - 3, lengths[1] - 2, lengths[2] - 1]
    while any(e < n for e, n in zip(ends, lengths)):
        live = [r for r in range(3) if ends[r] < lengths[r]]
        out = stack.step([prompts[r][ends[r]] for r in live], [ends[r] for r in live], [slot_of[r] for r in live])
        for i, r in enumerate(live):
            got[r].append([h[i : i + 1] for h in out])
            ends[r] += 1
    for r, ids in enumerate(prompts):
        expected = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states[1:]
        for layer, want in enumerate(expected):
            have = torch.cat([g[layer] for g in got[r]])
            torch.testing.assert_close(
                have, want[0], atol=1e-10, rtol=1e-10, msg=f"{name}: request {r}, layer {layer}"
            )


def test_prefill_runs_bound_the_padding():
    """``Prefill.groups`` keeps consecutive chunks together while the padded layout stays within ``padding`` times
    their tokens, and every run's tokens and requests are its own."""
    lengths = [100, 100, 90, 4000, 3900, 10, 10]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(7 * i, 7 * i + n) for i, n in enumerate(lengths)])
    runs = layers.Prefill.groups(starts, positions, torch.arange(7) + 10, 16)
    assert [(a, b) for a, b, _ in runs] == [(0, 290), (290, 8190), (8190, 8210)]
    assert [r.lengths.tolist() for _, _, r in runs] == [[100, 100, 90], [4000, 3900], [10, 10]]
    assert [r.slots.tolist() for _, _, r in runs] == [[10, 11, 12], [13, 14], [15, 16]]
    assert runs[1][2].p0.tolist() == [21, 28] and runs[1][2].max_len == 4000


def test_plugin_loads_the_models_maths_file():
    """One source: the plugin's maths module is ``modeling_bst/functional_bst.py`` itself, loaded by path."""
    source = Path(modeling_bst.__file__).parent / "functional_bst.py"
    assert Path(layers.fb.__file__).resolve() == source.resolve()
    assert layers.FUNCTIONAL.resolve() == source.resolve()
    # It imports torch only (no transformers, no sibling modules): it runs under vLLM's older transformers.
    imports = [line for line in source.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert all(line.split()[1].split(".")[0] in ("functools", "math", "torch") for line in imports), imports
