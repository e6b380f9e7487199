"""Greedy parity of the vLLM plugin with ``modeling_bst``'s ``generate()``, in the plugin's own venv.

The fixtures (``fixtures/``, written by ``scripts/make_fixtures.py`` in the main venv) hold tiny random BST
checkpoints and the greedy tokens ``generate()`` gives for 8 prompts of 1 to 150 tokens (block length 16: up to 9
blocks). Here vLLM serves each checkpoint through the plugin, offline (``LLM``) and through the OpenAI-compatible
server on 127.0.0.1, and must return exactly those tokens. The engines run with at most 4 sequences, 64 tokens per
step and 4 state slots, so that long prompts are prefilled in chunks continuing a saved state, steps mix decodes
with prefill chunks, and later requests take over the state slots of finished ones. One server runs with prefix caching
on (``--enable-prefix-caching``): a repeated prompt must hit the cache and give the same tokens.

Run with ``integrations/vllm/scripts/test.sh`` (it sets ``VLLM_CPU_KVCACHE_SPACE`` and the offline variables).
"""

import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
MODELS = list(EXPECTED["models"])
# 5 state blocks (one per running request, and vLLM's null block): requests 5 to 8 must reuse the slots of
# finished ones.
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=5)
SERVED = ["bst-sh-s4", "bst-mf-s4", "brect-bst"]


def test_fixture_prompts_span_several_blocks():
    """The batch mixes lengths: single-token and sub-block prompts and prompts of several blocks."""
    block_len = json.loads((FIXTURES / "slide" / "config.json").read_text())["block_len"]
    lengths = [len(p) for p in EXPECTED["prompts"]]
    assert len(lengths) == 8 and min(lengths) == 1 and max(lengths) >= 5 * block_len


# Compiled mode (``BST_VLLM_COMPILE=1``, ``enforce_eager=False``): a model of each layer kind, both custom ops.
COMPILED = ["slide", "bst-sh-s4", "bst-mf-s4", "brect-bst", "gss-bst"]


@pytest.mark.parametrize(
    "name, compiled", [(name, False) for name in MODELS] + [(name, True) for name in COMPILED if name in MODELS]
)
def test_offline_greedy_tokens_equal_generate(name, compiled, monkeypatch):
    """Eager, and compiled as vLLM compiles its own models (dense parts traced and compiled by inductor, the state
    in the plugin's custom ops)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("BST_VLLM_COMPILE", "1" if compiled else "0")
    llm = LLM(model=str(FIXTURES / name), dtype="float32", enforce_eager=not compiled, seed=0, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=EXPECTED["max_new_tokens"], ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in EXPECTED["prompts"]], params)
        got = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    want = EXPECTED["models"][name]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{name}: prompt {i} ({len(EXPECTED['prompts'][i])} tokens): vLLM {g} != generate() {w}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def _serve(name: str, tmp_path_factory, *extra: str):
    """``python -m vllm.entrypoints.openai.api_server --model <folder> [extra]`` on 127.0.0.1; yields its base url.

    No ``--dtype``: the plugin computes in float32 whatever the engine's dtype ("auto" is bfloat16 on the CPU)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(FIXTURES / name),
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
        "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
        "--num-gpu-blocks-override", str(ENGINE["num_gpu_blocks_override"]), *extra,
    ]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the server did not start in 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module", params=SERVED)
def server(request, tmp_path_factory):
    """A server of each checkpoint in ``SERVED``; yields (base url, name)."""
    with _serve(request.param, tmp_path_factory) as base:
        yield base, request.param


def _complete(base: str, name: str, prompt: list[int]) -> dict:
    """One greedy ``/v1/completions`` request of ``EXPECTED["max_new_tokens"]`` tokens: its choice."""
    body = {
        "model": str(FIXTURES / name),
        "prompt": prompt,
        "max_tokens": EXPECTED["max_new_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return _post(base + "/v1/completions", body)["choices"][0]


def test_server_completions_equal_generate(server):
    """8 concurrent ``/v1/completions`` requests (token-id prompts), greedy: the tokens of ``generate()``."""
    base, name = server
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda prompt: _complete(base, name, prompt), EXPECTED["prompts"]))
    want = EXPECTED["models"][name]
    for i, (choice, w) in enumerate(zip(choices, want)):
        assert choice["token_ids"] == w, f"{name}: prompt {i}: server {choice['token_ids']} != generate() {w}"
        assert choice["text"].split() == [f"t{t}" for t in w]  # detokenised by the checkpoint's tokenizer


def _prefix_cache_hits(base: str) -> float:
    """vLLM's prefix-cache hit counter (prompt tokens found in the cache), from the server's ``/metrics`` (its
    ``_total`` samples: the ``_created`` ones are timestamps)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    )


def test_server_prefix_caching(tmp_path_factory):
    """``--enable-prefix-caching`` through the server: a repeated 150-token prompt starts from the state cached at its
    last whole block (144 tokens, counted by vLLM's hit counter) and gives the tokens of ``generate()``, and so do
    the other prompts sent after it, concurrently."""
    name = "bst-sh-s4"
    want = EXPECTED["models"][name]
    prompts = EXPECTED["prompts"]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    block_len = json.loads((FIXTURES / name / "config.json").read_text())["block_len"]
    with _serve(name, tmp_path_factory, "--enable-prefix-caching") as base:
        first = _complete(base, name, prompts[longest])
        before = _prefix_cache_hits(base)
        again = _complete(base, name, prompts[longest])
        hits = _prefix_cache_hits(base) - before
        with ThreadPoolExecutor(8) as pool:
            choices = list(pool.map(lambda prompt: _complete(base, name, prompt), prompts))
    assert first["token_ids"] == want[longest] and again["token_ids"] == want[longest]
    assert hits == (len(prompts[longest]) - 1) // block_len * block_len, "tokens the repeat found in the cache"
    assert [c["token_ids"] for c in choices] == want


def test_unsupported_configs_name_the_field():
    from bst_vllm.config import BSTServingConfig, check_supported

    with pytest.raises(ValueError, match="bidirectional"):
        check_supported(BSTServingConfig(num_hidden_layers=2, bidirectional=True, bst_layer_indices=[0]))
    # An unstruct filter without taps beyond its length: served up to max_position_embeddings only.
    infinite = BSTServingConfig(
        num_hidden_layers=2, bst_layer_indices=[0], ssm_kind="unstruct", unstruct_finite_filter=False,
        max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unstruct_finite_filter"):
        check_supported(infinite, max_model_len=65)
    check_supported(infinite, max_model_len=64)
    # Every layer kind and SSM of the model serves.
    for overrides in (
        dict(bst_layer_indices=[1], context_mode="mh"),
        dict(ssm_kind="unstruct", bst_layer_indices=[0]),
        dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
        dict(bst_layer_indices=[], gss_layer_indices=[0]),
        dict(context_mode="mf", mf_independent_filters=True, bst_layer_indices=[0]),
    ):
        check_supported(BSTServingConfig(num_hidden_layers=2, **overrides), max_model_len=4096)
