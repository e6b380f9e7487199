"""Outside clients that compute log-probabilities from the hidden states and the LM head (TRL's fused LM head, used by
its SFT, DPO, GRPO, KTO and distillation trainers) see the model's own logit scale (issue #36, point 1)."""

import copy

import pytest
import torch
from conftest import one_step, tiny_config
from datasets import Dataset
from transformers import AutoTokenizer

from modeling_bst import BSTConfig, BSTForCausalLM


trl = pytest.importorskip("trl", reason="TRL is in the test extra (pip install -e .[test])")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402


TOKENIZER = "training/tokenizers/mistral-v1-32k"


def tiny_model_and_tokenizer():
    """A tiny BST (no dropout) over the presets' 32k tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = tiny_config(vocab_size=len(tokenizer), dropout=0.0, attention_dropout=0.0)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(0)
    return BSTForCausalLM(config), tokenizer


def test_the_default_logit_scale_is_a_number_in_the_config(tmp_path):
    config = tiny_config()
    assert config.logit_scale == pytest.approx(1 / 97**0.5)
    # A config.json written when the default was stored as null loads with the same number (identical logits).
    config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text.replace(f'"logit_scale": {config.logit_scale}', '"logit_scale": null'))
    assert '"logit_scale": null' in (tmp_path / "config.json").read_text()
    assert BSTConfig.from_pretrained(tmp_path).logit_scale == config.logit_scale


def test_the_default_scale_follows_vocab_size_set_on_the_config_and_an_explicit_one_stays():
    config = BSTConfig()  # a preset's vocabulary, before the tokenizer's size is set (training.train.build_config)
    config.vocab_size = 300
    assert config.logit_scale == pytest.approx(1 / 300**0.5)
    explicit = BSTConfig(logit_scale=0.5)
    explicit.vocab_size = 300
    assert explicit.logit_scale == 0.5


def test_resizing_the_vocabulary_keeps_the_trained_scale():
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(dropout=0.0, attention_dropout=0.0)).eval()
    ids = torch.randint(1, 97, (1, 9))
    before = model(ids).logits
    model.resize_token_embeddings(120)
    after = model(ids).logits
    torch.testing.assert_close(after[..., :97], before, atol=1e-6, rtol=0)


def test_trl_fused_lm_head_log_probs_equal_the_models():
    torch.manual_seed(0)
    model = BSTForCausalLM(tiny_config(dropout=0.0, attention_dropout=0.0)).eval()
    ids = torch.randint(1, 97, (2, 11))
    with torch.no_grad():
        want = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        add_fused_lm_head(model)
        got = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    torch.testing.assert_close(got.reshape(want.shape), want, atol=1e-5, rtol=1e-5)


def test_sft_trainer_reports_the_models_own_loss(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer()
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(3, len(tokenizer), (4, 16), generator=g)
    dataset = Dataset.from_dict({"input_ids": rows.tolist()})
    args = trl.SFTConfig(per_device_train_batch_size=4, **one_step(tmp_path))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    trainer.train()
    reported = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert reported == pytest.approx(own, rel=1e-3), (reported, own)


def test_dpo_trainer_log_probs_are_the_models(tmp_path):
    """One DPO step: the chosen / rejected log-probabilities TRL logs (the sums over each completion's tokens, through
    the fused LM head) equal those computed from the model's own logits on the same batch."""
    model, tokenizer = tiny_model_and_tokenizer()
    dataset = Dataset.from_dict(
        {
            "prompt": ["The ship sailed", "In the morning the old"],
            "chosen": [" into the harbour at dawn.", " man walked to the village."],
            "rejected": [" away.", " house fell silent and grey and cold."],
        }
    )
    args = trl.DPOConfig(per_device_train_batch_size=2, **one_step(tmp_path))
    # The reference: a copy (TRL would otherwise load it from config.name_or_path, which a model built here has not).
    reference = copy.deepcopy(model)
    trainer = trl.DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    ids, completion = batch["input_ids"], batch["completion_mask"]
    assert ids.shape[0] == 4  # the chosen rows, then the rejected rows
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    token_logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    own = (token_logps * completion[:, 1:]).sum(1)
    own_chosen, own_rejected = own.chunk(2)
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "logps/chosen" in entry)
    assert logged["logps/chosen"] == pytest.approx(own_chosen.mean().item(), rel=1e-4)
    assert logged["logps/rejected"] == pytest.approx(own_rejected.mean().item(), rel=1e-4)
    # The reference model is a copy: the implicit rewards beta (log p - log p_ref) are zero up to float32 rounding.
    assert abs(logged["rewards/chosen"]) < 1e-3 and abs(logged["rewards/rejected"]) < 1e-3
