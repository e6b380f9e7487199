"""Training pipeline: recipes, parameter groups, a short Trainer run, exact resume, evaluation JSON, 2-process DDP."""

import glob
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from modeling_bst import BSTForCausalLM
from training import data as D
from training import evaluate as E
from training import train as T
from training.optim import parameter_groups


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(glob.glob(str(REPO / "configs" / "train" / "*.yaml")))
TINY_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "block_len": 16,
    "bst_layer_indices": [0],
    "num_context_states": 4,
    "ssm_state_size": 4,
    "max_position_embeddings": 256,
}
BRECT_MODEL = dict(TINY_MODEL, bst_layer_indices=[], recurrent_layer_indices=[1], num_recurrent_states=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small local corpus in split folders: 6 training and 1 validation 'books' cut from the embedded ones."""
    root = tmp_path_factory.mktemp("corpus")
    books = D.embedded_books()
    (root / "train").mkdir()
    (root / "validation").mkdir()
    for i in range(6):
        text = books[i]["text"]
        (root / "train" / f"doc{i}.txt").write_text(text[20_000 : 20_000 + 6_000 + 1_000 * i])
    (root / "validation" / "val.txt").write_text(books[6]["text"][30_000:36_000])
    return root


def tiny_argv(corpus, out, *extra, model=TINY_MODEL):
    return [
        "--config",
        str(REPO / "configs" / "train" / "tiny.yaml"),
        "--dataset",
        "pg19",
        "--dataset_path",
        str(corpus),
        "--tokenizer_vocab_size",
        "300",
        "--model_overrides",
        json.dumps(model),
        "--seq_len",
        "64",
        "--max_eval_docs",
        "1",
        "--max_eval_segments",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        str(out),
        "--warmup_steps",
        "2",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        *extra,
    ]


# ---------------------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("path", RECIPES, ids=[Path(p).stem for p in RECIPES])
def test_every_recipe_parses(path):
    model_args, data_args, train_args = T.parse_args(["--config", path])
    assert data_args.task in T.TASKS
    if data_args.task == "lm":
        assert model_args.model_config and Path(T.resolve_preset(model_args.model_config)).exists()
        assert data_args.dataset in D.DATASET_KINDS and data_args.seq_len > 0
    else:  # a task's model is built from the recipe's model_overrides
        T.check_run(data_args, T.build_task_config(model_args, data_args))
    assert train_args.output_dir.startswith("outputs/")
    raw = yaml.safe_load(open(path))
    assert set(raw) <= {"model", "data", "training"}


def test_paper_recipes_follow_the_paper():
    paper = [p for p in RECIPES if Path(p).stem not in ("tiny", "quality-cpu") and "listops" not in Path(p).stem]
    for kind in ("pg19", "arxiv", "github"):
        assert any(kind in Path(p).stem for p in paper), f"no recipe for {kind}"
    for path in paper:
        model_args, data_args, train_args = T.parse_args(["--config", path])
        config = T.build_config(model_args)
        T.check_run(data_args, config)
        # L = 4096, global batch 32; Transformer-XL: segments of its window (2048), the same tokens per step.
        rows = train_args.per_device_train_batch_size * train_args.gradient_accumulation_steps
        assert data_args.seq_len * rows == 4096 * 32
        assert data_args.seq_len == (config.block_len if "trsf-xl" in path else 4096)
        assert str(train_args.optim.value).startswith("adam")
        assert model_args.tokenizer == "mistral-v1-32k"
        kind = next(k for k in ("pg19", "arxiv", "github") if k in Path(path).stem)
        assert data_args.dataset == kind
        if "trsf-xl" in path or "brect" in path:
            assert data_args.stream_segments
        # "the same learning rate for all layers" (Sec. 4.1): the SSM parameters follow --learning_rate
        assert model_args.ssm_lr is None and config.ssm_lr is None, path
        small = {**TINY_MODEL, "vocab_size": 64, "layer_types": ["bst", "block"]}
        del small["bst_layer_indices"]
        model = BSTForCausalLM(T.apply_model_overrides(config, small))
        groups = parameter_groups(model, train_args.learning_rate, train_args.weight_decay, config.ssm_lr)
        assert {g["lr"] for g in groups} == {train_args.learning_rate}, path


def test_command_line_overrides_win(tmp_path):
    model_args, data_args, train_args = T.parse_args(
        ["--config", str(REPO / "configs/train/tiny.yaml"), "--seq_len", "128", "--learning_rate", "0.5"]
    )
    assert data_args.seq_len == 128 and train_args.learning_rate == 0.5
    assert model_args.model_config == "bst-tiny-sh-s4" and train_args.max_steps == 150
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  not_a_field: 1\n")
    with pytest.raises(ValueError, match="not_a_field"):
        T.parse_args(["--config", str(bad)])


@pytest.mark.parametrize(
    "preset, overrides",
    [("bst-tiny-sh-s4", {}), ("bst-tiny-sh-s4", {"bidirectional": True}), ("bst-tiny-sh-unstruct", {})],
    ids=["s4", "s4-bidirectional", "unstruct"],
)
def test_parameter_groups_ssm_own_lr_no_decay(preset, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    import modeling_bst  # noqa: F401

    # keyword overrides: the layer fields go into the construction (BSTConfig.from_dict), the others are set after
    config = AutoConfig.from_pretrained(T.resolve_preset(preset), **dict(TINY_MODEL, vocab_size=100, **overrides))
    model = AutoModelForCausalLM.from_config(config)
    groups = {g["name"]: g for g in parameter_groups(model, lr=1e-2, weight_decay=0.1, ssm_lr=1e-3)}
    assert list(groups) == ["decay", "no_decay", "ssm"]
    ssm = set(model.ssm_parameter_names())
    assert ssm, "the tiny BST has SSM parameters"
    names = {id(p): n for n, p in model.named_parameters()}
    in_group = {k: {names[id(p)] for p in g["params"]} for k, g in groups.items()}
    assert in_group["ssm"] == ssm
    assert groups["ssm"]["lr"] == 1e-3 and groups["ssm"]["weight_decay"] == 0.0
    assert groups["decay"]["lr"] == groups["no_decay"]["lr"] == 1e-2
    assert groups["decay"]["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in groups["decay"]["params"])
    assert groups["no_decay"]["weight_decay"] == 0.0
    # every parameter in exactly one group
    all_ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len({id(p) for p in model.parameters()})
    # the SSM group holds the state-space parameters, whatever their shape, and nothing else
    kernel = "model.layers.0.ssm."
    if config.ssm_kind == "s4":
        expected = {kernel + k for k in ("A_log_real", "A_imag", "log_dt", "B")}
        assert {kernel + "C", kernel + "D"} <= in_group["decay"]
        if config.bidirectional:
            assert kernel + "C_backward" in in_group["decay"]
    else:  # the implicit filter, its MLP's biases included; its D-term (``bias``) is a read-out
        mlp = [f"mlp.{i}.{w}" for i in range(config.unstruct_num_inner_mlps + 1) for w in ("weight", "bias")]
        expected = {kernel + k for k in ("pos_emb", "sin.freq", "out.weight", *mlp)}
        assert kernel + "mlp.0.bias" in in_group["ssm"]
        assert kernel + "bias" in in_group["decay"]
    assert in_group["ssm"] == expected


def test_parameter_groups_rules_for_mamba_and_the_research_scripts():
    """The rules the research scripts pick live in training.optim: HF Mamba's SSM parameters (A_log, D, dt_proj.bias),
    no decay for norms and embeddings (MQAR), decay for everything outside the SSM group (long-range recall)."""
    from transformers import MambaConfig, MambaForCausalLM

    from training import optim

    mamba = MambaForCausalLM(MambaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, state_size=4))
    ssm = optim.ssm_parameter_names(mamba)
    assert ssm == {n for n, _ in mamba.named_parameters() if n.endswith(("A_log", ".D", "dt_proj.bias"))}
    assert len(ssm) == 6
    names = {id(p): n for n, p in mamba.named_parameters()}
    groups = {g["name"]: g for g in parameter_groups(mamba, 1e-2, 0.1, no_decay=optim.norms_and_embeddings)}
    in_group = {k: [names[id(p)] for p in g["params"]] for k, g in groups.items()}
    assert set(in_group["ssm"]) == ssm and groups["ssm"]["lr"] == 1e-2
    assert "backbone.embeddings.weight" in in_group["no_decay"]
    assert all("norm" not in n and "embed" not in n for n in in_group["decay"])
    everything = {g["name"]: g for g in parameter_groups(mamba, 1e-2, 0.1, no_decay=optim.decay_everything)}
    assert list(everything) == ["decay", "ssm"]


# ---------------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    summary = T.main(tiny_argv(corpus, out, "--max_steps", "200", "--learning_rate", "1e-2"))
    return out, summary


def test_short_trainer_run_loss_falls_and_saves_a_loadable_model(trained, corpus):
    out, summary = trained
    losses = summary["losses"]
    assert len(losses) == 200 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > math.log(300) - 1.0, "starts near chance level"
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert math.isfinite(summary["metrics"]["eval_loss"])
    # The corpus, for training.export's model card (issue #45: the card said "Data: not recorded").
    assert summary["dataset"] == "pg19" and Path(summary["dataset_path"]) == corpus

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_bst  # noqa: F401

    final = Path(summary["final_model"])
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.use_cache is True and len(tok) == 300 == model.config.vocab_size
    ids = tok("It is a truth", return_tensors="pt", add_special_tokens=False)["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 5)
    assert (out / "log_history.json").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["shuffled-segments", "streamed-brect"])
def test_resume_from_checkpoint_is_exact(corpus, tmp_path, stream):
    model = BRECT_MODEL if stream else TINY_MODEL
    common = ["--max_steps", "8", "--save_strategy", "steps", "--save_steps", "4", "--learning_rate", "3e-3"]
    if stream:
        common += ["--stream_segments", "true"]
    a, b = tmp_path / "a", tmp_path / "b"
    full = T.main(tiny_argv(corpus, a, *common, model=model))
    if stream:
        assert (a / "checkpoint-4" / T.STREAM_CACHE_FILE.format(rank=0)).exists()
    resumed = T.main(
        tiny_argv(
            corpus,
            b,
            *common,
            "--tokenizer",
            str(a / "tokenizer"),
            "--resume_from_checkpoint",
            str(a / "checkpoint-4"),
            model=model,
        )
    )
    assert len(full["losses"]) == 8
    assert resumed["losses"][-4:] == full["losses"][-4:]
    wa = load_file(str(a / "final" / "model.safetensors"))
    wb = load_file(str(b / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------------------------------------------- evaluation
def test_evaluation_json_and_plot(trained, corpus, tmp_path):
    _, summary = trained
    out = tmp_path / "eval.json"
    report = E.main(
        [
            "--model",
            summary["final_model"],
            summary["final_model"],
            "--lengths",
            "32",
            "128",
            "--dataset",
            "pg19",
            "--dataset_path",
            str(corpus),
            "--split",
            "validation",
            "--output",
            str(out),
        ]
    )
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert Path(saved["plot"]).exists() and Path(saved["plot"]).stat().st_size > 1000
    assert len(saved["models"]) == 2
    text = (corpus / "validation" / "val.txt").read_text()
    for row in saved["models"][0]["results"]:
        for key in ("length", "ppl_token", "bits_per_byte", "ppl_word", "nll_sum", "tokens", "bytes", "windows"):
            assert key in row and math.isfinite(row[key])
        assert row["bytes"] == len(text.encode()) and row["words"] == len(text.split())
        assert row["windows"] == math.ceil(row["tokens"] / row["length"])
        assert math.isclose(row["ppl_token"], math.exp(row["nll_sum"] / row["tokens"]))
        assert math.isclose(row["bits_per_byte"], row["nll_sum"] / (math.log(2) * row["bytes"]))
        assert 1.0 < row["ppl_token"] < 300
    a, b = saved["models"][0]["results"], saved["models"][1]["results"]
    assert [r["nll_sum"] for r in a] == [r["nll_sum"] for r in b]


def test_chunked_evaluation_equals_whole_windows(trained, corpus):
    _, summary = trained
    model, tok = E.load_model(summary["final_model"])
    texts = [(corpus / "validation" / "val.txt").read_text()[:1500]]
    whole = E.evaluate_model(model, tok, texts, [96])[0]
    chunked = E.evaluate_model(model, tok, texts, [96], chunk_size=40)[0]
    batched = E.evaluate_model(model, tok, texts, [96], batch_size=3)[0]
    assert math.isclose(whole["nll_sum"], chunked["nll_sum"], rel_tol=1e-5)
    assert math.isclose(whole["nll_sum"], batched["nll_sum"], rel_tol=1e-5)


def test_the_saved_tokenizer_encodes_a_prompt_as_training_did(trained):
    """The trained (BPE) tokenizer saved with the model starts a prompt with BOS, as every training document starts
    (``encode_document``): ``pipeline`` and a user's ``tok(prompt)`` prompt the model the way it was trained."""
    from transformers import AutoTokenizer

    _, summary = trained
    tok = AutoTokenizer.from_pretrained(summary["final_model"])
    prompt = "It is a truth universally acknowledged, that"
    fed = D.encode_document(tok, prompt, add_eos=False)
    assert fed[0] == tok.bos_token_id and tok(prompt)["input_ids"] == fed
    assert D.encode_document(tok, prompt) == fed + [tok.eos_token_id]  # training still ends a document with EOS
    assert tok.decode(tok(prompt)["input_ids"], skip_special_tokens=True) == prompt


def test_evaluation_shows_progress_over_the_scored_tokens(trained, corpus, capsys):
    """A long evaluation is not silent: with ``progress`` a bar per length counts the scored tokens (tokens/s) and
    names the document; without it nothing is printed."""
    _, summary = trained
    model, tok = E.load_model(summary["final_model"])
    texts = [(corpus / "validation" / "val.txt").read_text()[:1500]] * 2
    capsys.readouterr()  # what loading printed
    E.evaluate_model(model, tok, texts, [96], progress=False)
    assert capsys.readouterr().err == ""
    rows = E.evaluate_model(model, tok, texts, [96, 40], progress=True)
    err = capsys.readouterr().err
    assert "eval L=96" in err and "eval L=40" in err and "document 2/2" in err, err
    assert "tok/s" in err and rows[0]["tokens"] == rows[1]["tokens"], err


# ---------------------------------------------------------------------------------------------------- DDP
# accelerate's launcher also runs in the default tests (tests/training/test_fsdp.py), and the command it builds from
# configs/accelerate/ddp_cpu.yaml is checked there (test_accelerate_launch_dry_run); its DDP run is in the slow runs.
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_two_process_ddp_run(corpus, tmp_path, launcher):
    out = tmp_path / "ddp"
    with socket.socket() as sock:  # a free port, so that parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    else:
        config = REPO / "configs" / "accelerate" / "ddp_cpu.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd += ["--main_process_port", str(port)]
    cmd += ["-m", "training.train", *tiny_argv(corpus, out, "--max_steps", "4", "--per_device_train_batch_size", "2")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["train_batch_size"] == 4  # 2 processes x 2 rows
    assert len(summary["losses"]) == 4 and all(math.isfinite(x) for x in summary["losses"])
    history = json.loads((out / "log_history.json").read_text())
    assert history[-1]["step"] == 4
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "tokenizer.json").exists()


@pytest.mark.parametrize("finished", [True, False])
def test_shutdown_destroys_the_process_group(tmp_path, finished):
    """training.train's exit path tears every process group down before the interpreter exits (on success after a
    barrier; after a failure without one, since the other ranks may never reach it)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        work = dist.all_reduce(torch.ones(3), async_op=True)  # a work object the teardown must not leave behind
        work.wait()
        dist.new_group([0])  # sub-groups (FSDP's device mesh makes them) go too
        T._shutdown_distributed(finished)
        assert not dist.is_initialized()
        T._shutdown_distributed(finished)  # nothing to tear down: a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- crash safety
def test_sigkill_mid_run_resumes_with_the_same_losses(corpus, tmp_path):
    """A real run killed with SIGKILL resumes from its last complete checkpoint and continues with the losses of an
    uninterrupted run; an interrupted (marker-less) checkpoint is never picked."""
    import signal
    import subprocess
    import sys
    import time

    common = ["--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1", "--learning_rate", "3e-3"]
    common += ["--lr_scheduler_type", "constant", "--warmup_steps", "0", "--save_total_limit", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    full = T.main(tiny_argv(corpus, a, *common, "--max_steps", "16"))
    tok = ["--tokenizer", str(a / "tokenizer")]
    argv = tiny_argv(corpus, b, *common, *tok, "--max_steps", "100000")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.train", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while not (b / "checkpoint-8" / T.CHECKPOINT_COMPLETE).exists():
            assert proc.poll() is None, "training exited before it could be killed"
            assert time.time() < deadline, "no checkpoint-8 within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # A checkpoint whose save was cut short: files present, no completion marker. It must be skipped.
    broken = b / "checkpoint-99999"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"truncated")
    complete = T.complete_checkpoints(str(b))
    assert complete and str(broken) not in complete
    resumed = T.main(tiny_argv(corpus, b, *common, *tok, "--max_steps", "16", "--resume_from_checkpoint", "true"))
    start = int(Path(complete[-1]).name.split("-")[1])
    assert 8 <= start < 16
    # The resumed run's history holds the killed run's first `start` losses (from the checkpoint) and its own.
    assert resumed["losses"][-(16 - start) :] == full["losses"][start:]
    assert resumed["losses"] == full["losses"]
    wa = load_file(str(a / "final" / "model.safetensors"))
    wb = load_file(str(b / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------------------------------------------- streaming
def test_stream_inputs_drop_only_right_padding():
    ids = torch.arange(12).view(2, 6)
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    assert T.stream_inputs(full) is full
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    right = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    out = T.stream_inputs(right)
    assert "attention_mask" not in out and out["labels"] is right["labels"]
    left = dict(right, attention_mask=mask.flip(-1), labels=ids.masked_fill(mask.flip(-1) == 0, -100))
    with pytest.raises(ValueError, match="right"):
        T.stream_inputs(left)
    with pytest.raises(ValueError, match="-100"):
        T.stream_inputs(dict(right, labels=ids))


@pytest.mark.parametrize("model", [BRECT_MODEL, dict(TINY_MODEL, block_len=32)], ids=["brect", "bst"])
def test_streamed_padded_last_segment_equals_the_whole_document(model):
    """A document's right-padded last segment, fed with the previous segment's cache and no attention mask (what
    BSTTrainer does), gives exactly the whole-document forward's loss on its tokens."""
    from modeling_bst import BSTConfig, BSTForCausalLM

    torch.manual_seed(0)
    m = BSTForCausalLM(BSTConfig(vocab_size=50, **model)).eval()
    seq = 64
    doc = torch.randint(1, 50, (1, seq + 40))
    segs = [D.Segment(0, 0, 0, doc[0, :seq].tolist()), D.Segment(0, 1, seq, doc[0, seq:].tolist())]
    rows = [D.pad_segment(s, seq, 0) for s in segs]
    with torch.no_grad():
        first = m(input_ids=rows[0]["input_ids"][None], use_cache=True)
        batch = {k: rows[1][k][None] for k in ("input_ids", "attention_mask", "labels")}
        out = m(**T.stream_inputs(batch), past_key_values=first.past_key_values, use_cache=True)
        whole = m(input_ids=doc).logits
    # The model's loss shifts labels inside the segment: targets are tokens seq+1 .. end of the document.
    ref = torch.nn.functional.cross_entropy(whole[0, seq : doc.shape[1] - 1], doc[0, seq + 1 :])
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)


def test_streamed_training_crosses_document_ends(tmp_path):
    """Trsf-XL/BRecT streaming over documents that end mid-segment (right-padded last segments) trains."""
    root = tmp_path / "corpus"
    (root / "train").mkdir(parents=True)
    books = D.embedded_books()
    for i in range(4):
        (root / "train" / f"doc{i}.txt").write_text(books[i]["text"][30_000 : 30_000 + 700 + 150 * i])
    argv = tiny_argv(root, tmp_path / "out", "--stream_segments", "true", "--max_steps", "12", model=BRECT_MODEL)
    argv += ["--eval_split", ""]
    summary = T.main(argv)
    assert len(summary["losses"]) == 12 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["train_segments"] < 12 * 4  # more steps than segments: every document's end was crossed
