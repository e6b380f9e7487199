"""MQAR (research/mqar.py): the generator's format, that the queries really lie beyond a Slide stack's reach (and
within the full-attention reference's), exact resume from checkpoints, and the whole pipeline (runs -> JSON records
-> report section) at toy size."""

import json
import re

import pytest
import torch

from research import mqar


@pytest.mark.parametrize("length,pairs,gap", [(64, 4, 16), (256, 16, 128), (512, 64, 128), (40, 8, 8)])
def test_generator_format(length, pairs, gap):
    ids, labels, query_pos = mqar.make_batch(32, length, pairs, gap, torch.Generator().manual_seed(1))
    keys, values = range(1, 65), range(65, 129)
    assert ids.shape == labels.shape == (32, length) and query_pos.shape == (32, pairs)
    for b in range(32):
        row = ids[b].tolist()
        pair_keys, pair_values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert len(set(pair_keys)) == pairs and all(k in keys for k in pair_keys)
        assert all(v in values for v in pair_values)
        table = dict(zip(pair_keys, pair_values))
        q = sorted(query_pos[b].tolist())
        assert q[0] >= 2 * pairs + gap and q[-1] + 1 < length
        assert all(b2 - a >= 2 for a, b2 in zip(q, q[1:]))  # slots do not overlap
        assert sorted(row[p] for p in q) == sorted(pair_keys)  # every key queried exactly once
        for p in q:
            assert row[p + 1] == table[row[p]] == labels[b, p + 1].item()
        scored = (labels[b] != -100).nonzero().flatten().tolist()
        assert scored == [p + 1 for p in q]  # only the values of the queries are scored
        others = set(range(2 * pairs, length)) - set(q) - {p + 1 for p in q}
        assert all(row[i] == mqar.FILLER for i in others)


def test_generator_rejects_impossible_layouts():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="too short"):
        mqar.make_batch(2, 256, 64, 128, g)
    with pytest.raises(ValueError, match="keys"):
        mqar.make_batch(2, 512, 65, 0, g)


def _embedding_grad(model_name: str, layers: int = 2, block_len: int = 8, length: int = 96, pairs: int = 8):
    """|d (scored logits) / d (embeddings)| `(B, L)` at every position, for a small model with the default gap
    (layers * W); also the number of pairs and the query positions."""
    torch.manual_seed(0)
    gap = layers * block_len
    config = mqar.build_config(model_name, 32, layers, block_len, length, mqar.vocab_size(64, 64))
    model = mqar.build_model(config, model_name)
    ids, labels, query_pos = mqar.make_batch(2, length, pairs, gap, torch.Generator().manual_seed(0))
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["emb"] = output

    model.get_input_embeddings().register_forward_hook(keep)
    logits = model(ids).logits
    rows = torch.arange(2)[:, None]
    logits[rows, query_pos].sum().backward()
    return captured["emb"].grad.abs().sum(-1), pairs, query_pos


def test_queries_lie_beyond_the_slide_receptive_field():
    # Slide (2 layers, W = 8): the scored logits do not depend on the key-value pairs at all, so Slide is at chance
    # by construction; a BST layer's SSM (and Mamba's scan) reaches them.
    grad, pairs, query_pos = _embedding_grad("slide")
    assert torch.all(grad[:, : 2 * pairs] == 0)
    assert torch.all(grad.gather(1, query_pos) > 0)  # sanity: the gradient does reach the queried keys
    for name in ("bst-sh-s4", "mamba"):
        grad, pairs, _ = _embedding_grad(name)
        assert torch.all(grad[:, : 2 * pairs].sum(-1) > 0), name


def test_the_reference_attends_to_the_pairs():
    # Attention (W=L): the Slide preset with block_len = L, so the scored logits do depend on every pair (the same
    # probe as above, where Slide's are exactly zero), while the other models keep W.
    grad, pairs, query_pos = _embedding_grad("attention")
    assert torch.all(grad[:, 0 : 2 * pairs : 2] > 0) and torch.all(grad[:, 1 : 2 * pairs : 2] > 0)
    cfg = mqar.build_config("attention", 64, 2, 32, 256, 129)
    assert cfg["block_len"] == 256 and not cfg["bst_layer_indices"] and not cfg["recurrent_layer_indices"]
    assert mqar.build_config("slide", 64, 2, 32, 256, 129)["block_len"] == 32
    with pytest.raises(ValueError, match="'transformer' is not one of"):
        mqar.build_config("transformer", 64, 2, 32, 256, 129)


def test_layer_layouts_of_the_presets_scale_with_depth():
    assert mqar.build_config("bst-sh-s4", 64, 4, 32, 256, 129)["bst_layer_indices"] == [0, 2]
    assert mqar.build_config("gss-hybrid", 64, 4, 32, 256, 129)["gss_layer_indices"] == [0, 2, 3]
    assert mqar.build_config("brect", 64, 2, 32, 256, 129)["recurrent_layer_indices"] == [1]
    # at the default depth (2): both layers BST (layer 1's SSM reads attention output), BRecT on layer 1, both
    # layers GSS (no attention layer left in GSS-Hybrid); the documented layouts
    expected = {"attention": "A A", "slide": "A A", "brect": "A R", "gss-hybrid": "G G", "mamba": "M M"}
    for model in mqar.MODELS:
        cfg = mqar.build_config(model, 64, 2, 32, 256, 65)
        assert mqar.layout(cfg, model) == expected.get(model, "B B"), model
    assert mqar.layout(mqar.build_config("gss-hybrid", 64, 4, 32, 256, 65), "gss-hybrid") == "G A G G"
    cfg = mqar.build_config("bst-mf-s4", 96, 3, 16, 512, 129)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["block_len"], cfg["head_dim"]) == (96, 3, 16, 24)


def test_pipeline_at_toy_size(tmp_path):
    out = tmp_path / "runs"
    argv = ["--models", "slide", "bst-sh-s4", "--lengths", "64", "--pairs-at-lengths", "4", "--pairs", "2", "4"]
    argv += ["--length-for-pairs", "64", "--steps", "3", "--batch-size", "2", "--layers", "2", "--block-len", "8"]
    argv += ["--output", str(out), "--no-report"]
    mqar.main(argv)
    files = sorted(p.name for p in out.glob("*.json"))
    assert files == [f"{m}-L64-N{n}-3x2-s0.json" for m in ("bst-sh-s4", "slide") for n in (2, 4)]
    record = json.loads((out / "slide-L64-N4-3x2-s0.json").read_text())
    assert record["command"].startswith("python -m research.mqar --models slide bst-sh-s4")
    assert 0.0 <= record["accuracy"] <= 1.0 and record["settings"]["gap"] == 16
    assert record["settings"]["examples"] == 6 and len(record["train_losses"]) == 1
    # Resumable: a second invocation finds every run done and trains nothing.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    mqar.main(argv)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before
    docs = tmp_path / "results.md"
    docs.write_text("# Results\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    text = mqar.report(out, docs, length_for_pairs=64, pairs_at_lengths=4)
    written = docs.read_text()
    assert "<!-- mqar:start -->" in written and "kept" in written and (tmp_path / "results" / "mqar.png").exists()
    slide_row = next(line for line in text.splitlines() if line.startswith("| Slide |"))
    assert f"{100 * record['accuracy']:.1f}" in slide_row and "L=64 N=2" in text


def test_report_lists_a_run_stopped_at_its_deadline(tmp_path):
    out = tmp_path / "runs"
    mqar.main(["--models", "slide", "--steps", "2", *TINY, "--output", str(out)])
    kw = dict(steps=5, batch_size=2, hidden=32, layers=2, block_len=8, num_keys=16, num_values=16, eval_examples=8)
    ckpt = mqar.checkpoint_path(out, mqar.run_name("bst-sh-s4", 48, 4, 0, 5, 2))
    assert mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, checkpoint=ckpt, deadline=0.0) is None
    text = mqar.report(out, None)
    assert "Runs in progress" in text
    assert "- BST:SH:S4 L=48 N=4 seed 0, budget 5x2: step 1 of 5 (0.0 h of training in 1 sitting)" in text
    (out / "junk.ckpt.safetensors").write_bytes(b"not a checkpoint")
    assert "`junk.ckpt.safetensors`: unreadable" in mqar.report(out, None)
    ckpt.unlink()
    (out / "junk.ckpt.safetensors").unlink()
    assert "Runs in progress" not in mqar.report(out, None)


TINY = ["--lengths", "48", "--pairs-at-lengths", "4", "--pairs", "4", "--length-for-pairs", "48", "--batch-size", "2"]
TINY += ["--hidden", "32", "--block-len", "8", "--num-keys", "16", "--num-values", "16", "--no-report"]
SAME = ("accuracy", "eval_loss", "train_losses", "final_train_loss", "weights_sha256", "parameters", "settings")


def _tiny_run(monkeypatch, out, steps=7, kill_at=None):
    """``mqar.main`` on a toy BST:SH:S4 and reference run, killed (an exception out of the data generator, as if the
    process died: no graceful save) while drawing batch ``kill_at``."""
    calls = {"n": 0}
    real = mqar.make_batch

    def make_batch(*args, **kwargs):
        calls["n"] += 1
        if kill_at is not None and calls["n"] == kill_at:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(mqar, "make_batch", make_batch)
    argv = ["--models", "bst-sh-s4", "attention", "--steps", str(steps), "--checkpoint-every", "3", *TINY]
    mqar.main([*argv, "--output", str(out)])


def test_an_interrupted_run_resumes_bitwise(tmp_path, monkeypatch):
    _tiny_run(monkeypatch, tmp_path / "straight")
    # killed while drawing batch 6 of the first run (bst-sh-s4: its checkpoint holds step 3), then resumed
    with pytest.raises(KeyboardInterrupt):
        _tiny_run(monkeypatch, tmp_path / "killed", kill_at=6)
    ckpt = tmp_path / "killed" / "bst-sh-s4-L48-N4-7x2-s0.ckpt.safetensors"
    assert ckpt.exists() and not list((tmp_path / "killed").glob("*.json"))
    _tiny_run(monkeypatch, tmp_path / "killed")
    for model in ("bst-sh-s4", "attention"):
        a, b = (json.loads((tmp_path / d / f"{model}-L48-N4-7x2-s0.json").read_text()) for d in ("straight", "killed"))
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, model
        assert len(a["train_losses"]) == 1 and a["layout"] == ("B B" if model == "bst-sh-s4" else "A A")
    resumed = json.loads((tmp_path / "killed" / "bst-sh-s4-L48-N4-7x2-s0.json").read_text())
    assert [s["start_step"] for s in resumed["sittings"]] == [0, 3]
    assert not list(tmp_path.glob("*/*.safetensors*"))  # checkpoints are deleted once the JSON is written


@pytest.mark.slow  # about 90 s on 2 cores (a process per run); the in-process runs are covered above
def test_runs_side_by_side_give_the_records_of_runs_one_after_another(tmp_path, capfd):
    """--jobs N trains up to N runs at once, each in a process of its own (how the GPU sweep shares one GPU): every
    record is the one the sequential invocation writes (weights bit for bit), and a deadline that has passed starts
    nothing."""
    argv = ["--models", "bst-sh-s4", "attention", "slide", "--steps", "3", *TINY]
    mqar.main([*argv, "--output", str(tmp_path / "one")])
    mqar.main([*argv, "--output", str(tmp_path / "two"), "--jobs", "2"])
    assert "3 runs to do, 2 at a time" in capfd.readouterr().out
    names = sorted(p.name for p in (tmp_path / "one").glob("*.json"))
    assert len(names) == 3 and names == sorted(p.name for p in (tmp_path / "two").glob("*.json"))
    for name in names:
        a, b = (json.loads((tmp_path / d / name).read_text()) for d in ("one", "two"))
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, name
        assert b["command"].endswith("--jobs 2")
    mqar.main([*argv, "--output", str(tmp_path / "late"), "--jobs", "2", "--deadline-minutes", "0"])
    out = capfd.readouterr().out
    assert "0 of 3 runs finished" in out and "is left for the next invocation" in out
    assert not (tmp_path / "late").exists()
    with pytest.raises(SystemExit):
        mqar.main([*argv, "--jobs", "0"])
    assert "--jobs must be positive, got 0" in capfd.readouterr().err


def test_a_run_stopped_at_its_deadline_resumes_bitwise(tmp_path):
    kw = dict(steps=5, batch_size=2, hidden=32, layers=2, block_len=8, num_keys=16, num_values=16, eval_examples=8)
    straight = mqar.train_and_eval("bst-sh-s4", 48, 4, **kw)
    ckpt = tmp_path / "run.ckpt.safetensors"
    assert mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, checkpoint=ckpt, deadline=0.0) is None  # stops after step 1
    resumed = mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, checkpoint=ckpt)
    assert {k: straight[k] for k in SAME} == {k: resumed[k] for k in SAME}
    assert [s["start_step"] for s in resumed["sittings"]] == [0, 1]
    # a checkpoint of other settings is refused, naming the field
    with pytest.raises(ValueError, match=r"lr: 0\.01 there, 0\.001 here"):
        mqar.train_and_eval("bst-sh-s4", 48, 4, **dict(kw, lr=1e-3), checkpoint=ckpt)


# Runs longer than one sitting commit their checkpoint (research/mqar.py, "Runs span sessions"): each must be one
# that the command of its folder continues on a fresh clone, with today's code: the default command for the CPU
# grid's folder, the accelerator grid's (`research/gpu_quality.sh --mqar`: 64 keys and 64 values) for its folder.
GRID_SETTINGS = {mqar.RESULTS: {}, mqar.GPU_RESULTS: dict(num_keys=64, num_values=64)}
COMMITTED = sorted(p for folder in GRID_SETTINGS for p in folder.glob("*.ckpt.safetensors"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_a_committed_checkpoint_continues_under_the_default_command(path, tmp_path):
    meta = mqar.checkpoint_meta(path)
    ident = meta["identity"]
    model, length, pairs, seed = ident["model"], ident["length"], ident["num_pairs"], ident["seed"]
    steps, batch, overrides = ident["steps"], ident["batch_size"], ident.get("overrides")
    curriculum = mqar.curriculum_of(ident)
    name = mqar.run_name(model, length, pairs, seed, steps, batch, overrides, curriculum)
    assert path.name == f"{name}.ckpt.safetensors"
    assert not (path.parent / f"{name}.json").exists(), "a finished run's checkpoint must be deleted"
    assert 0 < meta["step"] < steps and len(meta["sittings"]) >= 1
    # The default command (only the budget from the name) loads it with today's code and takes the next step, on a
    # copy; a checkpoint of other settings would be refused, naming the field.
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    kw = dict(steps=steps, batch_size=batch, seed=seed, overrides=overrides, curriculum=curriculum)
    kw.update(checkpoint=copy, deadline=0.0)
    kw.update(GRID_SETTINGS[path.parent])
    assert mqar.train_and_eval(model, length, pairs, **kw) is None
    after = mqar.checkpoint_meta(copy)
    assert ident == after["identity"]  # the identity the default command builds today
    assert after["step"] == meta["step"] + 1


def test_report_has_one_table_per_budget_reference_first(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    _tiny_run(monkeypatch, out, steps=2)
    mqar.main(["--models", "slide", "--steps", "1", *TINY, "--output", str(out)])
    for path in out.glob("*.json"):  # budget 2x2: the reference learned the task; 1x2: every run at chance
        record = json.loads(path.read_text())
        accuracy = 0.5 if path.name.startswith("attention") else record["chance"]
        path.write_text(json.dumps(dict(record, accuracy=accuracy)))
    text = mqar.report(out, None)
    tables = re.findall(r"\*\*Budget (\d+x\d+)\*\*(.*)", text)
    assert [b for b, _ in tables] == ["2x2", "1x2"]  # the larger budget first
    assert "too small" not in tables[0][1] and "too small" in tables[1][1]
    assert "chance 6.2%" in tables[0][1] and "W = 8 (the reference: W = L)" in tables[0][1]
    large, small = text.split("**Budget 1x2**")
    rows = [line for line in large.splitlines() if line.startswith("| ") and not line.startswith("| Model")]
    assert rows[0] == "| Attention (W=L) | A A | 26k | 50.0 |" and rows[1].startswith("| BST:SH:S4 | B B |")
    assert "| Slide | A A |" in small and "| Attention" not in small and "No reference run" in small


def test_report_gives_a_cell_of_several_seeds_once_with_its_range(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    _tiny_run(monkeypatch, out, steps=2)
    for path in out.glob("*.json"):  # a second seed of every run: the first at 50%, the second at 25%
        record = json.loads(path.read_text())
        path.write_text(json.dumps(dict(record, accuracy=0.5)))
        path.with_name(path.name.replace("-s0.json", "-s1.json")).write_text(
            json.dumps(dict(record, seed=1, accuracy=0.25))
        )
    text = mqar.report(out, None)
    assert "| Attention (W=L) | A A | 26k | 37.5 (25.0–50.0, 2 seeds) |" in text
    assert "4 runs above twice chance: Attention (W=L) L=48 N=4 (2 seeds), BST:SH:S4 L=48 N=4 (2 seeds)." in text


def test_report_names_its_section_folder_and_machine(tmp_path, monkeypatch):
    """`--section NAME` writes section NAME of `--docs` and results/NAME.png beside it, whatever the output folder;
    the text names that folder and the records' machine (the GPU's name for CUDA records; the "other runs"
    sentence only in the CPU protocol's `mqar` section). Without `--section`, a non-default folder is only printed."""
    from reporting import cpu_name

    out = tmp_path / "runs"
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()
    docs.write_text("# Results\n\n<!-- mqar:start -->\nthe CPU section\n<!-- mqar:end -->\n")
    argv = ["--models", "slide", "--steps", "1", *TINY[:-1], "--output", str(out), "--docs", str(docs)]
    mqar.main(argv)  # no --section: the report is printed, docs/ untouched
    assert docs.read_text().count("start -->") == 1 and not (tmp_path / "docs" / "results").exists()
    record = json.loads(next(out.glob("*.json")).read_text())
    assert record["settings"]["device"] == "cpu" and record["settings"]["device_name"] == cpu_name()
    assert record["sittings"][0]["device_name"] == cpu_name()

    mqar.main([*argv, "--section", "mqar_gpu", "--report-only"])
    written = docs.read_text()
    assert "<!-- mqar:start -->\nthe CPU section\n<!-- mqar:end -->" in written  # the other section is kept
    section = written.split("<!-- mqar_gpu:start -->\n")[1].split("\n<!-- mqar_gpu:end -->")[0]
    assert (tmp_path / "docs" / "results" / "mqar_gpu.png").stat().st_size > 0
    assert "![MQAR accuracy](results/mqar_gpu.png)" in section and f"`{out.as_posix()}/`" in section
    assert f"Machine: {cpu_name()}, one thread per run" in section and "other runs" not in section
    assert "research/results/mqar/" not in section and "gpu_quality.sh --mqar" in section

    # the same records as if run on a GPU: the report names the GPU, not this machine's CPU
    for path in out.glob("*.json"):
        r = json.loads(path.read_text())
        r["settings"].update(device="cuda", device_name="NVIDIA H100 80GB HBM3")
        path.write_text(json.dumps(r))
    text = mqar.report(out, docs, section="mqar_gpu")
    assert "Machine: NVIDIA H100 80GB HBM3, one run at a time" in text and cpu_name() not in text
    assert docs.read_text().count("<!-- mqar_gpu:start -->") == 1  # rewritten in place

    # the CPU protocol's section says where its runs were made, and names its own folder
    text = mqar.report(out, None)
    assert "other runs" not in text  # GPU records, even in the `mqar` section
    for path in out.glob("*.json"):
        r = json.loads(path.read_text())
        r["settings"].update(device="cpu", device_name="Some CPU")
        path.write_text(json.dumps(r))
    text = mqar.report(out, None)
    machine = "Machine: Some CPU, one thread per run unless a run's settings say otherwise, each run sharing the\n"
    assert machine + "2-core CPU with one or two other runs" in text
    assert "`python -m research.mqar` runs the\nfirst cell" in text and "50 x 8, is kept" in text
    assert mqar._folder(mqar.RESULTS) == "research/results/mqar/" and mqar._folder(mqar.GPU_RESULTS).endswith("_gpu/")
    with pytest.raises(ValueError, match="section must be"):
        mqar.report(out, docs, section="bad name")
    with pytest.raises(SystemExit):
        mqar.main([*argv, "--section", "a b", "--report-only"])


@pytest.mark.skipif(
    not (mqar.ROOT / ".venv" / "bin" / "python").exists(),
    reason="gpu_quality.sh runs in the repository's .venv (without one it would create it: scripts/setup.sh)",
)
@pytest.mark.slow
def test_gpu_protocol_mqar_dry_run():
    """`bash research/gpu_quality.sh --mqar --dry-run`: the accelerator protocol's MQAR sweep on the CPU at 2 steps
    of 2 sequences (3 models and the BST:SH:unstruct ablation, 3 tiny cells) into a temporary folder: records, section
    and plot there, docs/ and research/results/ untouched. Slow (~25 s of CPU: two spawned interpreters, twelve runs):
    the default run has the same pipeline at toy size in one process (test_pipeline_at_toy_size) and the committed
    GPU checkpoints continuing under the default command."""
    import shutil
    import subprocess

    watched = (mqar.ROOT / "docs", mqar.ROOT / "research" / "results")

    def snapshot():
        return {p: (p.stat().st_mtime_ns, p.stat().st_size) for d in watched for p in d.rglob("*")}

    before = snapshot()
    out = subprocess.run(
        ["bash", str(mqar.ROOT / "research" / "gpu_quality.sh"), "--mqar", "--dry-run"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    folder = mqar.Path(out.stdout.strip().splitlines()[-1].split("dry run complete: ")[1])
    try:
        assert not folder.resolve().is_relative_to(mqar.ROOT)  # a temporary folder outside the repository
        records = sorted(p.name for p in (folder / "research" / "results" / "mqar_gpu").glob("*.json"))
        cells = ("L128-N4", "L128-N8", "L256-N4")
        models = ("attention", "bst-sh-s4", "bst-sh-unstruct+unstruct_decay_target=0.5+unstruct_sin_freq=1", "slide")
        assert records == [f"{m}-{c}-2x2-s0.json" for m in models for c in cells]
        record = json.loads((folder / "research" / "results" / "mqar_gpu" / records[0]).read_text())
        assert record["settings"]["steps"] == 2 and record["settings"]["num_keys"] == 64
        assert record["command"].startswith("python -m research.mqar --grid gpu")
        assert "<!-- mqar_gpu:start -->" in (folder / "docs" / "results.md").read_text()
        assert (folder / "docs" / "results" / "mqar_gpu.png").exists()
        assert not list(folder.rglob("*.safetensors"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
def test_cuda_without_a_gpu_is_refused_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit):
        mqar.main(["--device", "cuda", *TINY, "--output", str(tmp_path)])
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_set_parses_config_overrides_and_refuses_what_it_cannot_set():
    assert mqar.parse_overrides(["unstruct_sin_freq=1", "ssm_lr=0.01", "ssm_kind=s4", "bidirectional=true"]) == {
        "unstruct_sin_freq": 1,
        "ssm_lr": 0.01,
        "ssm_kind": "s4",
        "bidirectional": True,
    }
    assert mqar.overrides_tag({"ssm_lr": 0.01, "unstruct_sin_freq": 1}) == "+ssm_lr=0.01+unstruct_sin_freq=1"
    for item, message in [
        ("unstruct_sin_freq", "expected FIELD=VALUE"),
        ("=1", "expected FIELD=VALUE"),
        ("block_len=16", "use --block-len"),
        ("max_position_embeddings=512", "the cell's length"),
        ("model_type=llama", "use --models"),
        ("no_such_field=1", "BSTConfig has no field 'no_such_field'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            mqar.parse_overrides([item])
    with pytest.raises(ValueError, match="set twice"):
        mqar.parse_overrides(["ssm_lr=0.01", "ssm_lr=0.1"])
    with pytest.raises(ValueError, match="a file name"):
        mqar.overrides_tag({"ssm_kind": "s4/x"})
    with pytest.raises(ValueError, match="HF Mamba"):
        mqar.build_config("mamba", 32, 2, 8, 64, 33, overrides={"ssm_lr": 0.01})
    with pytest.raises(SystemExit):
        mqar.main(["--models", "mamba", "--set", "ssm_lr=0.01", "--no-report"])


def test_an_ablation_is_a_run_and_a_report_row_of_its_own(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    _tiny_run(monkeypatch, out, steps=2)
    argv = ["--models", "bst-sh-s4", "--steps", "2", *TINY, "--output", str(out), "--set", "ssm_state_size=4"]
    mqar.main(argv)
    name = "bst-sh-s4+ssm_state_size=4-L48-N4-2x2-s0.json"
    plain, ablation = (json.loads((out / n).read_text()) for n in ("bst-sh-s4-L48-N4-2x2-s0.json", name))
    assert ablation["overrides"] == {"ssm_state_size": 4} and ablation["config"]["ssm_state_size"] == 4
    assert plain["config"]["ssm_state_size"] == 16 and ablation["parameters"] < plain["parameters"]
    assert ablation["label"] == "BST:SH:S4 [ssm_state_size=4]" and "--set ssm_state_size=4" in ablation["command"]
    # the same command finds its run done; the preset's run is not mistaken for it (nor it for the preset's)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    mqar.main(argv)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before
    for path in out.glob("*.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(dict(record, accuracy=0.5 if "+" in path.name else 0.25)))
    rows = [line for line in mqar.report(out, None).splitlines() if line.startswith("| BST:SH:S4")]
    assert rows == [
        f"| BST:SH:S4 | B B | {plain['parameters'] / 1e3:.0f}k | 25.0 |",
        f"| BST:SH:S4 [ssm_state_size=4] | B B | {ablation['parameters'] / 1e3:.0f}k | 50.0 |",
    ]
    mqar.plot(mqar.load_results(out), tmp_path / "mqar.png")
    assert (tmp_path / "mqar.png").stat().st_size > 0


@pytest.mark.slow
def test_gpu_sitting_mqar_dry_run(tmp_path):
    """`bash scripts/gpu_sitting.sh --dry-run --mqar 1`: the MQAR sweep's dry run beside the `gpu` tests part, its log
    and the packed archive in $OUT; minutes that are not whole are refused. (The dry run takes the runs one at a time;
    runs side by side under --jobs: test_runs_side_by_side_give_the_records_of_runs_one_after_another.)"""
    import os
    import subprocess
    import tarfile

    script = str(mqar.ROOT / "scripts" / "gpu_sitting.sh")
    out = subprocess.run(
        ["bash", script, "--dry-run", "--mqar", "1"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    log = (tmp_path / "mqar.log").read_text()
    assert "dry run complete" in log and "mqar rc 0" in log and "9 runs to do\n" in log
    assert "tests: ok" in (tmp_path / "tests.log").read_text()
    with tarfile.open(tmp_path / "results.tgz") as tar:
        assert any(n.endswith("gpu_suite.json") for n in tar.getnames())
    bad = subprocess.run(["bash", script, "--mqar", "0.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--mqar takes whole minutes" in bad.stderr


def test_a_curriculum_trains_short_first_evaluates_at_the_length_and_resumes_bitwise(tmp_path, monkeypatch):
    kw = dict(steps=5, batch_size=2, hidden=32, layers=2, block_len=8, num_keys=16, num_values=16, eval_examples=8)
    lengths = []
    real = mqar.make_batch

    def spy(batch_size, length, *args, **kwargs):
        lengths.append(length)
        return real(batch_size, length, *args, **kwargs)

    monkeypatch.setattr(mqar, "make_batch", spy)
    straight = mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, curriculum=(40, 2))
    assert lengths == [40, 40, 48, 48, 48, 48]  # two steps at 40, three at 48, then the held-out batch at 48
    assert straight["settings"]["curriculum"] == {"length": 40, "steps": 2}
    assert straight["label"] == "BST:SH:S4 [first 2 steps at L=40]" and straight["length"] == 48
    plain = mqar.train_and_eval("bst-sh-s4", 48, 4, **kw)
    assert "curriculum" not in plain["settings"] and plain["weights_sha256"] != straight["weights_sha256"]
    ckpt = tmp_path / "run.ckpt.safetensors"
    assert mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, curriculum=(40, 2), checkpoint=ckpt, deadline=0.0) is None
    with pytest.raises(ValueError, match="curriculum"):  # a checkpoint without the curriculum is refused
        mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, checkpoint=ckpt)
    assert "- BST:SH:S4 [first 2 steps at L=40] L=48 N=4 seed 0" in "\n".join(mqar._in_progress(tmp_path))
    resumed = mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, curriculum=(40, 2), checkpoint=ckpt)
    assert {k: straight[k] for k in SAME} == {k: resumed[k] for k in SAME}
    for bad in ((48, 2), (40, 5), (40, 0), (20, 2)):  # not shorter, no steps left, no steps, too short for the pairs
        with pytest.raises(ValueError, match="curriculum"):
            mqar.train_and_eval("bst-sh-s4", 48, 4, **kw, curriculum=bad)


def test_a_curriculum_run_has_its_own_name_and_report_row(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    _tiny_run(monkeypatch, out, steps=3)
    mqar.main(["--models", "bst-sh-s4", "--steps", "3", *TINY, "--output", str(out), "--curriculum", "40", "2"])
    record = json.loads((out / "bst-sh-s4+curriculum=40x2-L48-N4-3x2-s0.json").read_text())
    assert "--curriculum 40 2" in record["command"] and record["settings"]["curriculum"]["steps"] == 2
    rows = [line.split(" | ")[0] for line in mqar.report(out, None).splitlines() if line.startswith("| BST:SH:S4")]
    assert rows == ["| BST:SH:S4", "| BST:SH:S4 [first 2 steps at L=40]"]
