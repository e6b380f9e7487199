"""Writes the plugin's parity fixtures: tiny random BST checkpoints and the greedy tokens of this package's
``generate()`` for a batch of mixed-length prompts.

Runs in the main venv (it needs ``modeling_bst``), from the repository root:

    PYTHONPATH=. .venv/bin/python integrations/vllm/scripts/make_fixtures.py [--check]

``--check`` regenerates the tokens from the stored checkpoints and compares them with the stored ones instead of
writing anything (what ``tests/integrations/test_vllm_plugin.py`` runs in the main suite).
"""

import argparse
import json
import sys
from pathlib import Path

import torch


FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
VOCAB = 256
BLOCK_LEN = 16
MAX_NEW_TOKENS = 24
# Mixed lengths: a single token, less than a block, exactly one block, one more, and several blocks (up to 9).
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 63, 100, 150]
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=256,
    block_len=BLOCK_LEN,
    ssm_state_size=8,
    num_context_states=4,
    dropout=0.0,
    attention_dropout=0.0,
    eos_token_id=None,
    # An untied head: with the tied N(0, 1) embedding a random model's logits favour the input token, and greedy
    # decoding repeats it, which would make the parity test weak.
    tie_word_embeddings=False,
)
# name -> config overrides; one tiny checkpoint each.
MODELS = {
    "slide": dict(bst_layer_indices=[]),
    "bst-sh-s4": dict(bst_layer_indices=[0, 2], context_mode="sh"),
    "bst-mf-s4": dict(bst_layer_indices=[1, 3], context_mode="mf"),
    "bst-mh-s4": dict(bst_layer_indices=[0, 3], context_mode="mh", cross_mask="strict", attend_self=True),
    "bst-sh-unstruct": dict(bst_layer_indices=[0, 2], context_mode="sh", ssm_kind="unstruct", unstruct_order=16),
    "bst-mf-independent": dict(bst_layer_indices=[1, 3], context_mode="mf", mf_independent_filters=True),
    "brect-bst": dict(bst_layer_indices=[0], recurrent_layer_indices=[2], num_recurrent_states=8),
    "gss-bst": dict(bst_layer_indices=[3], gss_layer_indices=[0, 2]),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def tokenizer():
    """A word-level tokenizer over the names ``t0`` .. ``t255`` (one token per id, no training data needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


@torch.no_grad()
def greedy(model, batch: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of every prompt, one ``generate()`` call per prompt (no padding involved)."""
    out = []
    for ids in batch:
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, min_new_tokens=MAX_NEW_TOKENS)
        out.append(y[0, len(ids) :].tolist())
    return out


def main(argv=None) -> int:
    from modeling_bst import BSTConfig, BSTForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored tokens, write nothing")
    args = parser.parse_args(argv)
    batch = prompts()
    expected_path = FIXTURES / "expected.json"
    stored = json.loads(expected_path.read_text()) if args.check else None
    result = {"max_new_tokens": MAX_NEW_TOKENS, "prompts": batch, "models": {}}
    for name, overrides in MODELS.items():
        folder = FIXTURES / name
        if args.check:
            model = BSTForCausalLM.from_pretrained(folder).eval()
        else:
            torch.manual_seed(0)
            model = BSTForCausalLM(BSTConfig(**COMMON, **overrides)).eval()
            model.save_pretrained(folder)
            tokenizer().save_pretrained(folder)
            for source in folder.glob("*.py"):  # the remote-code copies save_pretrained adds; the plugin needs none
                source.unlink()
        result["models"][name] = greedy(model, batch)
    if args.check:
        if stored != result:
            bad = [n for n in MODELS if stored["models"].get(n) != result["models"][n]]
            print(f"generate() differs from {expected_path} for {bad or 'the prompts'}", file=sys.stderr)
            return 1
        print(f"{expected_path}: generate() reproduces all {len(MODELS)} models x {len(batch)} prompts")
        return 0
    expected_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {len(MODELS)} checkpoints and {expected_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
