"""Packed (padding-free) rows: several documents in one row, told apart by ``position_ids`` that restart (TRL's
``SFTTrainer(packing=True)``, transformers' ``DataCollatorWithFlattening``) or by flash-attention's ``cu_seq_lens_q/k``.
Each document must equal the same document run alone: self-attention, context states, SSM state and BRecT state all
start afresh at its first token, and no loss term predicts a document's first token from the previous one (issue #45,
point 1)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import VARIANTS, make_model, one_step, tiny_config

from modeling_bst import BSTCache, BSTModel


ALL_VARIANTS = {**VARIANTS, "gss-hybrid": dict(bst_layer_indices=[], gss_layer_indices=[0, 2])}
# Not block multiples (W = 4), one shorter than a block, one a block multiple.
LENGTHS = [7, 3, 9, 8]


def docs_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g) for n in lengths]


def packed(docs):
    """One row: the documents' ids and restarting position ids."""
    return torch.cat(docs)[None], torch.cat([torch.arange(len(d)) for d in docs])[None]


def per_document_loss(model, docs) -> torch.Tensor:
    """The mean next-token loss over every document run alone (each document's own first token is never a target), in
    float32 like transformers' loss."""
    total, count = 0.0, 0
    for d in docs:
        logits = model(d[None]).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), d[1:], reduction="sum")
        count += len(d) - 1
    return total / count


def cu_seq_lens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_a_packed_row_equals_its_documents_run_apart(variant):
    model = make_model(dtype=torch.float64, **ALL_VARIANTS[variant])
    docs = docs_of(LENGTHS)
    ids, positions = packed(docs)
    with torch.no_grad():
        out = model(ids, position_ids=positions, labels=ids)
        apart = [model(d[None]).logits[0] for d in docs]
        want_loss = per_document_loss(model, docs)
    torch.testing.assert_close(out.logits[0], torch.cat(apart), atol=1e-10, rtol=0)
    # The labels are the plain ids (no -100 at the boundaries): the model itself drops the cross-document targets.
    torch.testing.assert_close(out.loss, want_loss, atol=0, rtol=1e-6)


@pytest.mark.parametrize("variant", ["mh-s4", "bst-brect"])
def test_the_accelerator_code_path(variant):
    """On an accelerator (no host reads in the layers; emulated on the CPU) a packed row equals its documents too."""
    from modeling_bst.utils_bst import accelerator_code_path

    model = make_model(variant, dtype=torch.float64)
    docs = docs_of(LENGTHS)
    ids, positions = packed(docs)
    with accelerator_code_path(), torch.no_grad():
        got = model(ids, position_ids=positions).logits[0]
        apart = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(got, apart, atol=1e-10, rtol=0)


def test_a_batch_of_two_packed_rows_and_a_backbone():
    model = make_model("bst-brect", dtype=torch.float64)
    first, second = docs_of([5, 2, 11], seed=1), docs_of([11, 7], seed=2)  # both rows 18 tokens
    (ids1, pos1), (ids2, pos2) = packed(first), packed(second)
    ids, positions = torch.cat([ids1, ids2]), torch.cat([pos1, pos2])
    with torch.no_grad():
        out = model(ids, position_ids=positions, output_hidden_states=True)
        for row, docs in enumerate([first, second]):
            apart = torch.cat([model(d[None]).logits[0] for d in docs])
            torch.testing.assert_close(out.logits[row], apart, atol=1e-10, rtol=0)
        # The hidden states come back in the caller's columns too, the last one the backbone's output.
        hidden = model.model(ids, position_ids=positions, output_hidden_states=True)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        torch.testing.assert_close(out.hidden_states[-1], hidden.last_hidden_state, atol=0, rtol=0)
        alone = model.model(first[1][None], output_hidden_states=True).hidden_states
        for packed_h, alone_h in zip(out.hidden_states, alone):
            torch.testing.assert_close(packed_h[0, 5:7], alone_h[0], atol=1e-10, rtol=0)
        assert isinstance(model.model, BSTModel)
        embeds = model.get_input_embeddings()(ids)
        torch.testing.assert_close(
            model(inputs_embeds=embeds, position_ids=positions).logits, out.logits, atol=0, rtol=0
        )


def test_documents_run_in_groups_of_similar_length():
    """TRL's padding (``pad_to_multiple_of``) gives every pad token position 0: one-token documents. They run in rows
    of one block, not as wide as the longest document."""
    from modeling_bst.layout_bst import _Documents

    lengths = [9, 1, 1, 1, 30, 5]
    model = make_model("mf-s4", dtype=torch.float64)
    docs = docs_of(lengths)
    ids, positions = packed(docs)
    documents = _Documents(_Documents.starts({"position_ids": positions}, None, ids.shape), block_len=4)
    # Blocks 3, 1, 1, 1, 8, 2 -> widths 16, 4, 4, 4, 32, 8 tokens, in groups by width (one row of 32, not six).
    assert documents.sizes == [4 * 3, 8, 16, 32]
    assert [tuple(m.shape) for m in documents.masks] == [(3, 4), (1, 8), (1, 16), (1, 32)]
    with torch.no_grad():
        got = model(ids, position_ids=positions).logits[0]
        apart = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(got, apart, atol=1e-10, rtol=0)


def test_gradients_equal_the_per_document_gradients():
    docs = docs_of(LENGTHS)
    ids, positions = packed(docs)
    model = make_model("bst-brect", dtype=torch.float64)
    model(ids, position_ids=positions, labels=ids).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    per_document_loss(model, docs).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name], atol=1e-8, rtol=1e-5, msg=name)  # float32 losses


@pytest.mark.parametrize("variant", ["mh-s4", "brect"])
def test_position_ids_without_a_restart_change_nothing(variant):
    model = make_model(variant)
    ids = torch.randint(1, 97, (2, 18))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        plain = model(ids).logits
        torch.testing.assert_close(model(ids, position_ids=torch.arange(18)[None]).logits, plain, atol=0, rtol=0)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(3, 21)[None]).logits, plain, atol=0, rtol=0)
        padded = model(ids, attention_mask=mask).logits
        # generate's convention for a left-padded row (cumsum of the mask, pads at 0 or 1): one document per row.
        for fill in (0, 1):
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, fill)
            got = model(ids, attention_mask=mask, position_ids=pos).logits
            torch.testing.assert_close(got, padded, atol=0, rtol=0)


def test_flash_attention_style_sequence_lengths():
    model = make_model("sh-s4", dtype=torch.float64)
    docs = docs_of(LENGTHS)
    ids, positions = packed(docs)
    cu = cu_seq_lens(LENGTHS)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    with torch.no_grad():
        want = model(ids, position_ids=positions).logits
        torch.testing.assert_close(model(ids, **flash).logits, want, atol=0, rtol=0)
        torch.testing.assert_close(model(ids, position_ids=positions, **flash).logits, want, atol=0, rtol=0)
        seq_idx = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), torch.tensor(LENGTHS))[None]
        torch.testing.assert_close(model(ids, seq_idx=seq_idx, **flash).logits, want, atol=0, rtol=0)
        # One document per row, said by cu_seq_lens: the plain forward.
        rows = ids[:, :18].reshape(2, 9)
        torch.testing.assert_close(
            model(rows, cu_seq_lens_q=cu_seq_lens([9, 9]), cu_seq_lens_k=cu_seq_lens([9, 9])).logits,
            model(rows).logits,
            atol=0,
            rtol=0,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seq_lens_q=cu_seq_lens([7, 3, 17])), r"cu_seq_lens_q .* disagree with position_ids"),
        (
            dict(cu_seq_lens_q=cu_seq_lens(LENGTHS), cu_seq_lens_k=cu_seq_lens([10, 17])),
            r"cu_seq_lens_k .* disagree with position_ids",
        ),
        (dict(cu_seq_lens_q=cu_seq_lens([7, 3, 9])), r"cu_seq_lens_q must rise from 0 to 27"),
        (dict(cu_seq_lens_q=cu_seq_lens(LENGTHS), max_length_q=8), r"max_length_q=8 .* longest document has 9"),
        (dict(seq_idx=torch.zeros(1, 27, dtype=torch.int32)), r"seq_idx .* disagree with position_ids"),
        (dict(attention_mask=torch.ones(1, 27).index_fill(1, torch.tensor([26]), 0)), r"attention_mask with zeros"),
        (dict(use_cache=True), r"cache"),
        (dict(past_key_values=BSTCache(make_model().config, 1)), r"cache"),
        (dict(output_attentions=True), r"attention weights"),
    ],
)
def test_what_packing_cannot_honour_raises(kwargs, match):
    model = make_model(attn_implementation="eager")
    ids, positions = packed(docs_of(LENGTHS))
    with pytest.raises(ValueError, match=match):
        model(ids, position_ids=positions, **kwargs)


def test_a_packed_row_cannot_be_generated_from():
    model = make_model()
    ids, positions = packed(docs_of([5, 4]))
    with pytest.raises(ValueError, match="cache"):
        model.generate(ids, position_ids=positions, max_new_tokens=2, do_sample=False)


def test_data_collator_with_flattening():
    """transformers' padding-free collator: its labels already drop each document's first token; with its flash
    keyword arguments too, the loss is the per-document loss."""
    from transformers import DataCollatorWithFlattening

    model = make_model("mf-s4", dtype=torch.float64)
    docs = docs_of(LENGTHS)
    features = [{"input_ids": d.tolist()} for d in docs]
    for collator in (DataCollatorWithFlattening(), DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
        batch = collator(features)
        assert (batch["labels"][0, torch.tensor([0, 7, 10, 19])] == -100).all()
        with torch.no_grad():
            got = model(**batch).loss
            want = per_document_loss(model, docs)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_trl_sft_trainer_packing_reports_the_per_document_loss(tmp_path):
    """TRL's ``SFTTrainer(packing=True)``: best-fit packing into rows of ``max_length`` tokens, then padding-free (one
    flattened row, restarting ``position_ids``, ``cu_seq_lens_q/k``, ``seq_idx``) through its fused LM head. One
    logged step at learning rate 0 reports the mean loss of the documents run one by one."""
    trl = pytest.importorskip("trl", reason="TRL is in the test extra (pip install -e .[test])")
    from datasets import Dataset
    from transformers import AutoTokenizer

    from modeling_bst import BSTForCausalLM

    tokenizer = AutoTokenizer.from_pretrained("training/tokenizers/mistral-v1-32k")
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0)
    model = BSTForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, len(tokenizer), (n,), generator=g) for n in [12, 3, 9, 8, 5, 7]]
    dataset = Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
    args = trl.SFTConfig(**one_step(tmp_path, per_device_train_batch_size=8, packing=True, max_length=16))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape == (1, 44) and "attention_mask" not in batch  # all six documents, one row
    starts = (batch["position_ids"][0] == 0).nonzero()[:, 0].tolist() + [44]
    in_batch = sorted(tuple(batch["input_ids"][0, a:b].tolist()) for a, b in zip(starts, starts[1:]))
    assert in_batch == sorted(tuple(d.tolist()) for d in docs)
    with torch.no_grad():
        want = per_document_loss(model.eval(), docs).item()
    trainer.train()
    reported = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert reported == pytest.approx(want, rel=1e-5), (reported, want)


def test_a_packed_row_cannot_be_classified():
    from modeling_bst import BSTForSequenceClassification

    model = make_model(model_cls=BSTForSequenceClassification, num_labels=3)
    ids, positions = packed(docs_of([5, 4]))
    model(ids, position_ids=torch.arange(9)[None])  # one document: classified as before
    with pytest.raises(ValueError, match="cannot be classified"):
        model(ids, position_ids=positions)
