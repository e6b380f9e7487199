"""Shared helpers for the BST test suite: tiny configs, variants, seeding, dtype hygiene.

Kept small and import-safe: test modules may ``from conftest import tiny_config, VARIANTS, make_model``. torch and
the package are imported where tests run (``pytest_configure`` below, and the helpers), not at this module's import:
pytest-xdist's controller process loads this file too and runs no test, and importing them there (~6 s on a 2-core VM)
would delay the start of every worker.
"""

import os


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller: it only hands out tests
    import torch

    import modeling_bst  # noqa: F401  (registers model_type "bst" with the Auto classes)

    # The models under test are tiny: intra-op threading only adds overhead (10x slower on a loaded 2-core box).
    torch.set_num_threads(1)


TINY_DEFAULTS = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=8,
    intermediate_size=48,
    max_position_embeddings=64,
    block_len=4,
    bst_layer_indices=[0, 2],
    ssm_state_size=4,
    num_context_states=3,
    num_recurrent_states=3,
    dropout=0.0,
    attention_dropout=0.0,
)

# Every model family of the paper's Table 1 on the tiny config (id -> overrides).
VARIANTS = {
    "sh-s4": dict(context_mode="sh", ssm_kind="s4"),
    "mh-s4": dict(context_mode="mh", ssm_kind="s4"),
    "mf-s4": dict(context_mode="mf", ssm_kind="s4"),
    "sh-unstruct": dict(context_mode="sh", ssm_kind="unstruct"),
    "mh-unstruct": dict(context_mode="mh", ssm_kind="unstruct"),
    "mf-unstruct": dict(context_mode="mf", ssm_kind="unstruct"),
    "slide": dict(bst_layer_indices=[]),
    "brect": dict(bst_layer_indices=[], recurrent_layer_indices=[1]),
    # Transformer-XL-like: one window as long as the test sequences (SEQ_LEN below).
    "trsf-xl": dict(bst_layer_indices=[], block_len=18),
    "bst-brect": dict(bst_layer_indices=[0, 2], recurrent_layer_indices=[1], context_mode="mf"),
}

# Default test sequence length: not a multiple of block_len 4, covers >= 4 blocks.
SEQ_LEN = 18


def tiny_config(**overrides):
    """A tiny BSTConfig (vocab 97, hidden 32, 3 layers, 2 heads x 8, W=4, N=4, no dropout) with ``overrides``."""
    from modeling_bst import BSTConfig

    fields = dict(TINY_DEFAULTS)
    fields.update(overrides)
    return BSTConfig(**fields)


def seed_all(seed: int = 0) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def make_model(variant: str | None = None, dtype=None, seed: int = 0, model_cls=None, **overrides):
    """A seeded, eval-mode model of ``variant`` (a key of VARIANTS, or None for the plain tiny config): a
    ``BSTForCausalLM`` unless ``model_cls``, in ``dtype`` (default float32)."""
    import torch

    from modeling_bst import BSTForCausalLM

    model_cls = BSTForCausalLM if model_cls is None else model_cls
    fields = dict(VARIANTS[variant]) if variant is not None else {}
    fields.update(overrides)
    seed_all(seed)
    return model_cls(tiny_config(**fields)).to(torch.float32 if dtype is None else dtype).eval()


def one_step(tmp_path, **overrides) -> dict:
    """Trainer (TRL config) arguments for one logged step at learning rate 0 on the CPU (the model stays as it is),
    with ``overrides``."""
    return (
        dict(
            output_dir=str(tmp_path),
            max_steps=1,
            learning_rate=0.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            max_length=None,
        )
        | overrides
    )


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _seed():
    seed_all(0)
    yield


def __getattr__(name):
    """``DecodeStep``, a ``torch.nn.Module``, is made on first use (torch is not imported at this module's import)."""
    if name != "DecodeStep":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    class DecodeStep(torch.nn.Module):
        """One decode step taking and returning the cache (what an exported step runs)."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, token, cache):
            out = self.model(token, past_key_values=cache, use_cache=True)
            return out.logits, out.past_key_values

    globals()["DecodeStep"] = DecodeStep
    return DecodeStep
