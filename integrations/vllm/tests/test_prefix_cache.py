"""Prefix caching (vLLM's Mamba ``align`` mode) with the plugin: a request whose prompt shares a prefix with an
earlier one starts from the cached state of the prefix and gives the tokens it gives without prefix caching.

Each fixture checkpoint is served with prefix caching on (block length W = 16, so the cache block is 16 tokens),
at most 4 sequences and 64 tokens per step: prompts of 17 to 150 tokens prefill in chunks, and a step mixes decodes
with prefill chunks and with requests resumed from a cached state. vLLM stores a request's state at the end of each
of its prefill chunks (chunk ends fall on cache-block boundaries: 64, 128, ...) and at the last whole block before
its prompt's end; a later prompt hits the longest of these boundaries that its prompt shares. References: the
tokens ``generate()`` gave for the fixture prompts (``fixtures/expected.json``), and for prompts made here the
plugin's layers alone with no cache (``test_layers.Stack``, which gives ``generate()``'s tokens on the fixtures).

Run with ``integrations/vllm/scripts/test.sh`` (it sets ``VLLM_CPU_KVCACHE_SPACE`` and the offline variables).
"""

import gc
import json
from pathlib import Path

import pytest
import torch
from test_layers import Stack


FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
PROMPTS = EXPECTED["prompts"]
NEW = EXPECTED["max_new_tokens"]
W = 16  # the fixtures' block_len: the cache block
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)

P, Q = PROMPTS[7], PROMPTS[6]  # 150 and 100 tokens
# A new 150-token prompt, run alone first: its chunks end at 64 and 128 tokens and at its last whole block (144),
# where vLLM keeps its states. Prompts sharing a prefix with it, and what they hit: whole blocks (its first 128
# tokens), diverging in the middle of block 4 (70 tokens shared: the state at 64), sharing less than the first
# stored boundary (48 tokens: nothing), and the prompt with one more token (the state at 144).
R = [(7 * t + 3) % 256 for t in P]
DERIVED = [(R[:128] + Q[:30], 128), (R[:70] + Q[:50], 64), (R[:48] + Q[:20], 0), (R + [7], 144)]


def first_boundary_hit(length: int) -> int:
    """The cached tokens of a repeated prompt of ``length`` tokens: the last whole block before its last token."""
    return (length - 1) // W * W


@torch.no_grad()
def greedy_without_cache(name: str, prompts) -> list[list[int]]:
    """Greedy tokens from the plugin's layers alone (no engine, no cache): each prompt prefilled from a zero state,
    then all requests decoded together."""
    stack = Stack(name, slots=len(prompts))
    last = [stack.logits(stack.chunk(p, 0, i)[-1:])[0].argmax().item() for i, p in enumerate(prompts)]
    got = [[t] for t in last]
    for step in range(1, NEW):
        positions = [len(p) + step - 1 for p in prompts]
        last = stack.logits(stack.step(last, positions, list(range(len(prompts))))).argmax(-1).tolist()
        for g, t in zip(got, last):
            g.append(t)
    return got


class Engine:
    """An offline ``LLM`` with prefix caching on; ``run`` returns (tokens, cached prompt tokens) per prompt."""

    def __init__(self, name: str, **overrides):
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=str(FIXTURES / name), dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False,
            **{**ENGINE, **overrides},
        )  # fmt: skip
        self.params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def run(self, prompts):
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self.params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    def counter(self, name: str) -> int:
        return sum(m.value for m in self.llm.get_metrics() if m.name == name)

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


@pytest.mark.parametrize("name", list(EXPECTED["models"]))
def test_prefix_hits_give_the_tokens_of_no_cache(name):
    want = EXPECTED["models"][name]
    derived = [p for p, _ in DERIVED]
    engine = Engine(name)
    try:
        cold = engine.run(PROMPTS)
        hits_before = engine.counter("vllm:prefix_cache_hits")
        warm = engine.run(PROMPTS)
        hits_after = engine.counter("vllm:prefix_cache_hits")
        engine.run([R])
        shared = [engine.run([p]) for p in derived]  # one at a time: each hits R's states only
        shared = [t for (t,), _ in shared], [n for _, (n,) in shared]
        # A batch mixing new prompts (no hit) with repeated and derived ones, in another order.
        mixed_prompts = [Q[:33], *derived[::-1], P, [5, 6, 7] * 13, PROMPTS[5]]
        mixed = engine.run(mixed_prompts)
    finally:
        engine.close()
    assert cold == (want, [0] * len(PROMPTS)), f"{name}: the first run"
    assert warm[0] == want, f"{name}: repeated prompts"
    assert warm[1] == [first_boundary_hit(len(p)) for p in PROMPTS], f"{name}: cached tokens of the repeats"
    assert hits_after - hits_before == sum(warm[1]), "vLLM's prefix-cache hit counter"
    assert shared == (greedy_without_cache(name, derived), [hit for _, hit in DERIVED]), f"{name}: shared prefixes"
    assert mixed[0] == greedy_without_cache(name, mixed_prompts), f"{name}: mixed batch"
    assert mixed[1][-2] == 0, "a prompt sharing nothing hits nothing"
    # Q[:33] shares 33 tokens with Q (run before): it hits the longest of Q's stored states within them (at 16 or
    # 32: chunk ends there depend on how the steps were scheduled beside other requests), or nothing.
    assert mixed[1][0] in (0, W, 2 * W), "a prompt sharing 33 tokens hits at most a stored state within them"
    assert mixed[1][5] == first_boundary_hit(len(P)) and mixed[1][1] == 144, "repeated prompts hit their states"


@pytest.mark.parametrize("name", ["bst-sh-s4", "bst-mf-s4"])
def test_reused_slots_with_prefix_caching(name):
    """A pool of 9 state blocks (vLLM's null block and 8 others) for up to 4 running requests: blocks that held other
    requests' states (cached ones among them) are taken over by new requests all the time, and the tokens stay
    those without a cache."""
    want = EXPECTED["models"][name]
    derived = [p for p, _ in DERIVED]
    engine = Engine(name, num_gpu_blocks_override=9)
    try:
        first = engine.run(PROMPTS)
        engine.run([P])
        again = engine.run([P])  # right after the same prompt: its states are not evicted yet
        last = engine.run(PROMPTS)
        engine.run([R])
        shared = engine.run(derived)
    finally:
        engine.close()
    assert first[0] == want and last[0] == want
    assert again == ([want[7]], [first_boundary_hit(len(P))])
    assert shared[0] == greedy_without_cache(name, derived)
