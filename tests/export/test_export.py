"""Hub export: folder contents, model-card metadata, --push (mocked); the fresh-process trust_remote_code load of an
exported folder is tests/models/bst/test_auto_classes.py's."""

import json
import re
import warnings
from pathlib import Path
from urllib.parse import urlparse

import conftest
import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import modeling_bst
from modeling_bst import BSTConfig, BSTForCausalLM
from modeling_bst.configuration_bst import AUTO_MAP
from training import export as export_mod
from training import model_card


def trained_folder(tmp_path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    overrides = {"vocab_size": 64, "num_hidden_layers": 2, "bst_layer_indices": [0], **overrides}
    model = BSTForCausalLM(conftest.tiny_config(**overrides))
    model.config.use_cache = False  # what Trainer leaves behind
    folder = tmp_path / "run" / "final"
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder


def test_export_folder_and_card(tmp_path):
    folder = trained_folder(tmp_path)
    report = {"models": [{"results": [{"length": 512, "ppl_token": 12.5, "bits_per_byte": 1.25}, {"length": 4096}]}]}
    (tmp_path / "eval.json").write_text(json.dumps(report))
    out = export_mod.main(
        ["--model", str(folder), "--out", str(tmp_path / "hub"), "--eval_json", str(tmp_path / "eval.json")]
    )
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md", "tokenizer.json"} <= names
    assert set(model_card.CODE_FILES) <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    package = Path(modeling_bst.__file__).parent
    for name in model_card.CODE_FILES:
        assert (out / name).read_bytes() == (package / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache"] is True
    assert (
        config["auto_map"] == AUTO_MAP
    )  # every head (tests/models/bst/test_auto_classes.py loads each in a fresh process)

    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert "bst" in meta["tags"] and meta["license"] == "apache-2.0"
    assert "datasets" not in meta  # training data not recorded: no metadata invented
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    assert {"type": "perplexity", "name": "Token perplexity at 512 tokens", "value": 12.5} in metrics
    for section in ("## Architecture", "## Training data", "## Intended use", "## Limitations", "trust_remote_code"):
        assert section in card
    for name in model_card.CODE_FILES:
        assert model_card.sha256(out / name) in card

    # The tokenizer loads from the folder; a fresh process where modeling_bst cannot be imported loading an exported
    # folder (every Auto class, trust_remote_code) and reproducing the logits is tests/models/bst/test_auto_classes.py.
    assert AutoTokenizer.from_pretrained(out).encode("it is a truth")


def test_push_uses_hf_api(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls.append(("upload_folder", Path(folder_path).name, repo_id))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    folder = trained_folder(tmp_path)
    export_mod.main(["--model", str(folder), "--out", str(tmp_path / "hub"), "--push", "org/bst-tiny", "--private"])
    assert calls == [("create_repo", "org/bst-tiny", True, True), ("upload_folder", "hub", "org/bst-tiny")]


# -- model-card honesty: what the run recorded, real dataset ids, real links, stated limitations -------------------

SAMPLE = "It is a truth universally acknowledged, that the the of , and Mr Darcy ```x``` was"


def run_folder(tmp_path: Path) -> Path:
    """A run folder like training.train + scripts/main_job.sh leave: trained at 512 tokens per sequence with a config
    whose max_position_embeddings is 1024 (the tiny preset's), 150 steps, a sample and an evaluation report."""
    final = trained_folder(tmp_path, max_position_embeddings=1024)
    run = final.parent
    summary = {"final_model": str(final), "seq_len": 512, "world_size": 1, "train_batch_size": 4, "losses": [8.0]}
    (run / "train_summary.json").write_text(json.dumps(summary))
    (run / "log_history.json").write_text(json.dumps([{"loss": 8.0, "step": 10}, {"train_loss": 7.0, "step": 150}]))
    (run / "sample.txt").write_text(SAMPLE + "\n")
    report = {
        "dataset": {"dataset": "embedded", "path": None, "split": "validation", "documents": 1},
        "models": [{"results": [{"length": 512, "ppl_token": 61.83, "bits_per_byte": 2.25}]}],
    }
    (run / "eval.json").write_text(json.dumps(report))
    return run


def card_of(out: Path):
    card = (out / "README.md").read_text()
    return card, yaml.safe_load(card.split("---")[1])


def section(card: str, title: str) -> str:
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_card_states_what_the_run_recorded(tmp_path):
    run = run_folder(tmp_path)
    args = ["--model", str(run / "final"), "--out", str(tmp_path / "hub"), "--eval_json", str(run / "eval.json")]
    card, meta = card_of(export_mod.main([*args, "--dataset", "embedded"]))
    # Training length from train_summary.json, not the config's max_position_embeddings.
    row = next(line for line in card.splitlines() if line.startswith("| training sequence length"))
    assert "512 tokens" in row and "1024" not in row
    training = section(card, "Training data")
    assert "sequences of 512 tokens" in training and "150 optimizer steps" in training and "1024" not in training
    # Local corpus: described, no datasets: metadata; the evaluation names the held-out book.
    assert "datasets" not in meta and meta["language"] == ["en"]
    assert "Emma" in training and "not a Hub dataset" in training
    assert "Northanger Abbey" in section(card, "Evaluation") and "61.830" in section(card, "Evaluation")
    assert meta["model-index"][0]["results"][0]["dataset"]["split"] == "validation"
    # The sample is shown verbatim (a fence longer than its backticks); nothing characterises it.
    assert f"````text\n{SAMPLE}\n````" in section(card, "Sample")
    assert "fluent" not in card.lower()
    # Every link is a full URL with a path (no bare hostname); no code link unless one is given.
    urls = re.findall(r"https?://[^\s)\]>`]+", card)
    assert urls and all(urlparse(u).path.strip("/") for u in urls), urls
    assert "github.com" not in card
    # Limitations list what the model cannot do (checked below in test_card_limitations_hold).
    limitations = section(card, "Limitations")
    for needle in ("assistant_model", "prompt_lookup_num_tokens", "cache_implementation", "inside a continued"):
        assert needle in limitations, needle


def test_exporting_again_keeps_the_card(tmp_path, monkeypatch):
    """The documented ONNX export (``--model .../final --out .../hub --onnx``, no ``--eval_json`` / ``--dataset``)
    after scripts/main_job.sh's export writes the same card: the corpus from train_summary.json (training.train
    records it), the evaluation from the run's eval.json, which evaluated this model folder (issue #45: the second
    export dropped the model-index and the evaluation and said "Data: not recorded")."""
    run = run_folder(tmp_path)
    summary = json.loads((run / "train_summary.json").read_text())
    (run / "train_summary.json").write_text(json.dumps({**summary, "dataset": "embedded", "dataset_path": None}))
    report = json.loads((run / "eval.json").read_text())
    report["models"][0]["path"] = str(run / "final")
    (run / "eval.json").write_text(json.dumps(report))
    hub = tmp_path / "hub"
    base = ["--model", str(run / "final"), "--out", str(hub)]
    first, meta = card_of(export_mod.main([*base, "--eval_json", str(run / "eval.json"), "--dataset", "embedded"]))
    assert meta["model-index"] and "Emma" in section(first, "Training data")
    onnx_calls = []
    monkeypatch.setattr(export_mod, "export_onnx", lambda *a, **k: onnx_calls.append(a) or {"files": []})
    assert card_of(export_mod.main([*base, "--onnx"]))[0] == first and onnx_calls
    # An eval.json of another model is not this model's evaluation.
    report["models"][0]["path"] = str(tmp_path / "other")
    (run / "eval.json").write_text(json.dumps(report))
    card, meta = card_of(export_mod.main(base))
    assert "model-index" not in meta and "Emma" in section(card, "Training data")


def test_card_without_a_run_record_says_so(tmp_path):
    folder = trained_folder(tmp_path)  # no train_summary.json, log_history.json or sample.txt
    card, meta = card_of(export_mod.export(str(folder), str(tmp_path / "hub")))
    assert "| training sequence length L | not recorded |" in card
    assert "- Data: not recorded." in card and "## Sample" not in card
    assert "datasets" not in meta and "language" not in meta


def test_card_datasets_are_real_hub_ids(tmp_path):
    run = run_folder(tmp_path)
    final = str(run / "final")
    cases = [
        (dict(dataset="pg19"), ["emozilla/pg19"]),
        (dict(dataset="arxiv"), ["EleutherAI/proof-pile-2"]),
        (dict(dataset="github"), ["codeparrot/github-code"]),
        (dict(dataset="pg19", dataset_path="org/my-books"), ["org/my-books"]),
        (dict(dataset="pg19", dataset_path=str(tmp_path)), None),  # a local folder
        (dict(dataset="embedded"), None),
        (dict(dataset_name="books"), None),  # free text is never metadata
    ]
    for i, (kwargs, expected) in enumerate(cases):
        card, meta = card_of(export_mod.export(final, str(tmp_path / f"hub{i}"), **kwargs))
        assert meta.get("datasets") == expected, (kwargs, meta.get("datasets"))
        for dataset_id in expected or []:
            assert f"https://huggingface.co/datasets/{dataset_id}" in section(card, "Training data")
    # Recorded by the run (train_summary.json "dataset"), used when --dataset is not given.
    summary = json.loads((run / "train_summary.json").read_text())
    (run / "train_summary.json").write_text(json.dumps({**summary, "dataset": "pg19"}))
    assert card_of(export_mod.export(final, str(tmp_path / "hub-rec")))[1]["datasets"] == ["emozilla/pg19"]


def test_card_code_link_is_a_full_url_or_absent(tmp_path):
    folder = str(trained_folder(tmp_path))
    url = "https://example.org/team/modeling-bst"
    card, _ = card_of(export_mod.export(folder, str(tmp_path / "hub"), code_url=url))
    assert f"[`modeling_bst`]({url})" in card
    for bad in ("https://github.com/", "github.com", "https://github.com", "ftp://example.org/x"):
        with pytest.raises(ValueError, match="code_url"):
            export_mod.export(folder, str(tmp_path / "bad"), code_url=bad)


def test_card_limitations_hold():
    """What the card's limitations say about generation is what the model does."""
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=8)
    small.update(intermediate_size=48, block_len=4, bst_layer_indices=[0], ssm_state_size=4, dropout=0.0)
    model = BSTForCausalLM(BSTConfig(**small)).eval()
    ids = torch.randint(0, 64, (1, 7))
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=model), greedy)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, prompt_lookup_num_tokens=2), greedy)
    assert torch.equal(
        model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="offloaded"), greedy
    )
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static"), greedy)


def test_export_cli_spellings(tmp_path):
    run = run_folder(tmp_path)
    base = ["--model", str(run / "final"), "--dataset", "embedded"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the underscore spelling warns about nothing
        new = export_mod.main([*base, "--out", str(tmp_path / "a"), "--eval_json", str(run / "eval.json")])
    with pytest.warns(FutureWarning, match="--eval-json is deprecated.*--eval_json"):
        old = export_mod.main([*base, "--out", str(tmp_path / "b"), "--eval-json", str(run / "eval.json")])
    assert (new / "README.md").read_text() == (old / "README.md").read_text()
    assert "model-index" in card_of(old)[1]
    with pytest.warns(FutureWarning, match="--dataset-name is deprecated.*--dataset_name"):
        out = export_mod.main(["--model", str(run / "final"), "--out", str(tmp_path / "c"), "--dataset-name", "books"])
    assert "- Data: books." in (out / "README.md").read_text()
    with pytest.raises(SystemExit):  # no abbreviations
        export_mod.main([*base, "--out", str(tmp_path / "d"), "--eval", str(run / "eval.json")])
