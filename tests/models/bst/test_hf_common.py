"""transformers' own common model tests applied to the BST models, as for an in-tree model.

``ModelTesterMixin``, ``GenerationTesterMixin`` and ``ConfigTester`` (fetched for the installed transformers version,
see ``tests/hf_common/fetch.py`` and docs/hf-common-tests.md) run against ``BSTModel``, ``BSTForCausalLM`` and
``BSTForSequenceClassification`` on tiny configs: SH:S4 (the full suite), then MF:S4 after a BRecT layer and
SH:unstruct (subclasses of the SH:S4 test case, with transformers' loading/saving plumbing tests marked slow); MH:S4,
MF:S4 and BRecT each on its own are the same subclasses in the slow run.

No model test is skipped here: the skips in a run are the mixins' own capability checks (no GPU, no flash
attention, no RoPE, ...), listed with their reasons in docs/hf-common-tests.md; a skip added here must quote the
reason a built-in recurrent model (Mamba, RecurrentGemma, Jamba, Bamba) gives for the same skip. No test is marked
as a known failure either.
"""

import functools
import re
import unittest
from unittest import mock

import hf_common
import pytest
import torch
from conftest import TINY_DEFAULTS
from hf_common import fetch
from transformers.models.auto import modeling_auto

from modeling_bst import BSTCache, BSTConfig, BSTForCausalLM, BSTForSequenceClassification, BSTModel


# transformers' test_modeling_common.py and test_configuration_common.py are not in this repository: they come from the
# source release of the installed transformers version on the package index, fetched once into a cache
# (tests/hf_common/fetch.py). Where they cannot be had, this whole module is skipped with the reason.
try:
    SDIST_TESTS = fetch.attach_sdist_tests(hf_common.__path__)
except fetch.Unavailable as error:
    pytest.skip(str(error), allow_module_level=True)

from hf_common.generation import test_utils as generation_test_utils  # noqa: E402
from hf_common.generation.test_utils import GenerationTesterMixin  # noqa: E402
from hf_common.test_configuration_common import ConfigTester  # noqa: E402
from hf_common.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402
from hf_common.upstream import ENV_VAR, unavailable_reason, upstream_module  # noqa: E402


GENERATION_UPSTREAM = upstream_module(generation_test_utils)

# The auto-class name tables the mixins consult to pick inputs and labels per head. An in-tree model is listed in
# them; ours is registered with the Auto classes at import (modeling_bst/__init__.py), which does not add it here.
AUTO_NAME_TABLES = {
    "MODEL_MAPPING_NAMES": "BSTModel",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": "BSTForCausalLM",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "BSTForSequenceClassification",
}


class BSTModelTester:
    """Tiny BST configs and inputs for the common tests (shapes as transformers' Mamba tester: batch 14, length 7).

    ``variant`` overrides go on top of tests/conftest.py's ``TINY_DEFAULTS`` (hidden 32, 2 heads x 8, W = 4, N = 4)
    with 2 layers, a block layer then a BST layer: length 7 spans two blocks, so context states reach block 1.
    """

    def __init__(self, parent, variant: dict, batch_size=14, seq_length=7, is_training=True, use_labels=True):
        self.parent = parent
        self.variant = dict(variant)
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_labels = use_labels
        self.vocab_size = 99
        self.num_labels = 3
        self.type_sequence_label_size = 3
        self.hidden_size = TINY_DEFAULTS["hidden_size"]
        # transformers' test_num_layers_is_small asks for at most 2 layers: one block layer, then one BST layer.
        self.num_hidden_layers = 2
        self.bst_layer_indices = [1]
        self.num_attention_heads = TINY_DEFAULTS["num_attention_heads"]
        self.pad_token_id = self.vocab_size - 1
        self.bos_token_id = self.vocab_size - 1
        self.eos_token_id = self.vocab_size - 1

    def get_config(self) -> BSTConfig:
        fields = dict(TINY_DEFAULTS)
        fields.update(
            vocab_size=self.vocab_size,
            num_hidden_layers=self.num_hidden_layers,
            bst_layer_indices=self.bst_layer_indices,
            num_labels=self.num_labels,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        fields.update(self.variant)
        return BSTConfig(**fields)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)
        # transformers' random mask (first token real, holes anywhere after it, as in-tree testers use), with position
        # 1 masked in every row: no row is unpadded, so get_seq_length() must count padding positions for generate to
        # continue from a cache (issue #12 bug 1).
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        attention_mask[:, 1] = 0
        sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
        return self.get_config(), input_ids, attention_mask, sequence_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class BSTModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    """SH:S4: the whole common suite."""

    variant_id = "sh-s4"
    variant = {"context_mode": "sh", "ssm_kind": "s4"}
    all_model_classes = (BSTModel, BSTForCausalLM, BSTForSequenceClassification)
    all_generative_model_classes = (BSTForCausalLM,)
    has_attentions = True
    # The model files carry no copyright year (transformers reads the year to pick which init tests apply).
    test_can_init_all_missing_weights_before_2023 = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tables = [
            mock.patch.dict(getattr(modeling_auto, table), {"bst": name}) for table, name in AUTO_NAME_TABLES.items()
        ]
        for patch in cls._tables:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._tables:
            patch.stop()
        super().tearDownClass()

    def setUp(self):
        self.model_tester = BSTModelTester(self, self.variant)
        self.config_tester = ConfigTester(
            self,
            config_class=BSTConfig,
            hidden_size=37,
            common_properties=["hidden_size", "num_hidden_layers", "num_attention_heads"],
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    # Cache checks for BSTCache (a transformers ``Cache`` of BST cache layers, whose tensors are not per-layer K/V).
    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        self.assertIsInstance(past_key_values, BSTCache)
        self.assertEqual(len(past_key_values), config.num_hidden_layers)
        self.assertEqual(past_key_values.positions.shape, (batch_size,))
        self.assertEqual(past_key_values.get_seq_length(), seq_length)

    def _check_caches_are_equal(self, cache1, cache2):
        self.assertIsInstance(cache1, BSTCache)
        self.assertIsInstance(cache2, BSTCache)
        from training.cache_snapshot import cache_to_tensors

        t1, t2 = cache_to_tensors(cache1), cache_to_tensors(cache2)
        self.assertEqual(sorted(t1), sorted(t2))
        for name in t1:
            torch.testing.assert_close(t1[name], t2[name], msg=lambda m, name=name: f"BSTCache tensor {name}: {m}")


# Tests of transformers' loading, saving, dtype and attention-dispatch plumbing rather than of the variant's layers:
# they run in the default suite on SH:S4 only, and are marked slow on the other variants (about 30 s per variant
# on a loaded 2-core machine, mostly test_bc_torch_dtype and the fp16/bf16 eager-vs-SDPA comparisons). So is
# test_torch_export (8-10 s of CPU per variant, a third of this file's time): torch.export of the other variants'
# forward is tests/models/bst/test_forward_contract.py's test_torch_export (MF + BRecT backbone, SH:unstruct LM),
# of their decode steps tests/models/bst/test_decode_capture.py's, in the default suite.
PLUMBING_TESTS = re.compile(
    r"test_(config|bc_torch_dtype|torch_export|eager_matches_sdpa_inference_\d+_(fp16|bf16)\w*|can_load\w*|load_\w+"
    r"|base_model_prefix_loads_base_weights|keep_in_fp32_modules|can_use_safetensors|model_weights_reload\w*"
    r"|from_pretrained_no_checkpoint|resize_\w+|sdpa_can_dispatch\w*|torch_save_load"
    r"|cannot_load_with_meta_device_context_manager|correct_missing_keys)"
)


def mark_plumbing_slow(test_case):
    for name in dir(test_case):
        if PLUMBING_TESTS.fullmatch(name) and callable(getattr(test_case, name)):
            method = getattr(test_case, name)

            @functools.wraps(method)
            def test(self, *args, _method=method, **kwargs):
                return _method(self, *args, **kwargs)

            setattr(test_case, name, pytest.mark.slow(test))
    return test_case


# The default run takes the mixins' tests over two more variants: MF:S4 after a Block-Recurrent layer (BRecT's state
# and MF's context states in one model) and SH:unstruct (the other SSM kind and its cache). MH:S4, MF:S4 and BRecT,
# each on its own, run in the slow run: their layers are these variants' (MH's context read-out is SH's with one
# state per head), and tests/models/bst/ checks each of them by default (causality, decoding, padding, save/load).
@mark_plumbing_slow
class BSTMFBRecTModelTest(BSTModelTest):
    """MF:S4 with a Block-Recurrent Transformer layer (the paper's BRecT baseline) before it."""

    variant_id = "mf-s4+brect"
    variant = {"context_mode": "mf", "ssm_kind": "s4", "recurrent_layer_indices": [0]}


@mark_plumbing_slow
class BSTSHUnstructModelTest(BSTModelTest):
    variant_id = "sh-unstruct"
    variant = {"context_mode": "sh", "ssm_kind": "unstruct"}


@pytest.mark.slow
@mark_plumbing_slow
class BSTMHS4ModelTest(BSTModelTest):
    variant_id = "mh-s4"
    variant = {"context_mode": "mh", "ssm_kind": "s4"}


@pytest.mark.slow
@mark_plumbing_slow
class BSTMFS4ModelTest(BSTModelTest):
    variant_id = "mf-s4"
    variant = {"context_mode": "mf", "ssm_kind": "s4"}


@pytest.mark.slow
@mark_plumbing_slow
class BSTBRecTModelTest(BSTModelTest):
    """A Block-Recurrent Transformer layer (the paper's BRecT baseline) in place of the BST layer."""

    variant_id = "brect"
    variant = {"bst_layer_indices": [], "recurrent_layer_indices": [1]}


def test_generation_tester_mixin_ran():
    """Reports whether GenerationTesterMixin's tests ran: they need the transformers repository's tests/generation/
    (from $TRANSFORMERS_TESTS_DIR or the tag archive fetched into the test cache; the source release lacks it)."""
    if not GENERATION_UPSTREAM:
        pytest.skip(
            f"GenerationTesterMixin is repository-only and could not be had ({unavailable_reason()}): set ${ENV_VAR} "
            "to a transformers checkout's tests/ folder, or allow access to github.com, to run its tests "
            "(docs/hf-common-tests.md)"
        )
    assert hasattr(GenerationTesterMixin, "test_greedy_generate")
