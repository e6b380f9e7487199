"""The model card of an exported BST folder (``README.md``, rendered from ``hub_cards/model_card.md``): what the run
recorded (``train_summary.json``, ``log_history.json``, ``sample.txt``), the evaluation (``eval.json``), the training
corpus (Hub ``datasets:`` metadata for real Hub ids only), the limitations of the configuration, and the checksums
of the modeling files. Used by ``training.export``."""

import hashlib
import json
import os
import re
import string
from pathlib import Path
from urllib.parse import urlparse

import yaml

import modeling_bst
from training.data import EMBEDDED_BOOKS, HUB_DEFAULTS, canonical_split


CODE_FILES = (
    "configuration_bst.py",
    "modeling_bst.py",
    "attention_bst.py",
    "layout_bst.py",
    "context_bst.py",
    "ssm_bst.py",
    "cache_bst.py",
    "utils_bst.py",
    "functional_bst.py",
)
CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "hub_cards" / "model_card.md"
PAPER = "https://arxiv.org/abs/2306.09539"
HUB_DATASET_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Corpora of English text (the card's `language:`); code (github) and unknown corpora get no language tag.
ENGLISH_KINDS = ("embedded", "pg19", "arxiv")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def variant_name(config) -> str:
    if config.bst_layer_indices:
        return f"BST:{config.context_mode.upper()}:{config.ssm_kind}"
    if config.recurrent_layer_indices:
        return "BRecT:fixed:skip"
    if getattr(config, "gss_layer_indices", None):
        return "GSS-Hybrid"
    if config.block_len >= config.max_position_embeddings:
        return "Transformer-XL"
    return "Slide"


def evaluation_rows(eval_json: Path | None):
    """``[(length, ppl, bits_per_byte)]`` from a ``training.evaluate`` report (first model), and its dataset entry."""
    if eval_json is None:
        return [], None
    report = json.loads(Path(eval_json).read_text())
    model = report["models"][0]
    rows = [(r["length"], r["ppl_token"], r["bits_per_byte"]) for r in model["results"] if "ppl_token" in r]
    return rows, report.get("dataset", {})


# --------------------------------------------------------------------------------------------------------------------
# What the run recorded
# --------------------------------------------------------------------------------------------------------------------
def hub_id_of_kind(kind: str) -> str | None:
    """The Hub dataset id ``training.data`` loads for a dataset kind (``pg19`` -> ``emozilla/pg19``), else None."""
    spec = HUB_DEFAULTS.get(kind)
    if spec is None:
        return None
    if HUB_DATASET_ID.match(spec["path"]):
        return spec["path"]
    match = re.match(r"hf://datasets/([^/]+/[^/]+)/", str(spec.get("data_files", "")))
    return match.group(1) if match else None


def describe_dataset(
    dataset: str | None, dataset_path: str | None = None, split: str = "train"
) -> tuple[str | None, list[str]]:
    """``(description for the card, Hub dataset ids for the datasets: metadata)`` of a corpus (``split`` of it).

    ``dataset`` is a ``training.data`` kind (embedded, pg19, arxiv, github) or a Hub dataset id; ``dataset_path`` is
    what ``--dataset_path`` was in training (a local file/folder, or a Hub id replacing the kind's default). Local
    corpora have no Hub id: they are described and left out of the metadata."""
    if dataset_path:
        if os.path.exists(dataset_path) or not HUB_DATASET_ID.match(dataset_path):
            loader = f" (read with the `{dataset}` loader)" if dataset and dataset != "embedded" else ""
            return f"a local corpus, `{Path(dataset_path).name}`{loader}; not published with this model", []
        return f"[`{dataset_path}`](https://huggingface.co/datasets/{dataset_path})", [dataset_path]
    if not dataset:
        return None, []
    if dataset == "embedded":
        split = canonical_split(split)
        books = ", ".join(f"*{title}* ({year})" for _, title, year, _, part in EMBEDDED_BOOKS if part == split)
        return (
            f"the {split} split of the public-domain novels shipped with `modeling_bst` (`training/data/`, Project "
            f"Gutenberg texts): {books or 'none'}; a local corpus, not a Hub dataset",
            [],
        )
    hub_id = hub_id_of_kind(dataset)
    if hub_id is not None:
        url = f"https://huggingface.co/datasets/{hub_id}"
        return f"[`{hub_id}`]({url}) (the `{dataset}` loader of `training.data`)", [hub_id]
    if HUB_DATASET_ID.match(dataset) and not os.path.exists(dataset):
        return f"[`{dataset}`](https://huggingface.co/datasets/{dataset})", [dataset]
    return f"a local corpus, `{Path(dataset).name}`; not published with this model", []


def read_run(model_dir: str, train_summary: str | None = None, sample: str | None = None) -> dict:
    """What the training run left next to the model: ``train_summary.json`` (in the model folder or its parent,
    i.e. ``output_dir`` of ``training.train``), ``log_history.json``, ``sample.txt`` and ``eval.json`` (a
    ``training.evaluate`` report whose first model is this folder) beside it."""
    folder = Path(model_dir)
    if train_summary is not None:
        candidates = [Path(train_summary)]
        if not candidates[0].is_file():
            raise FileNotFoundError(f"--train_summary {train_summary}: no such file")
    else:
        candidates = [folder / "train_summary.json", folder.parent / "train_summary.json"]
    run: dict = {}
    summary_path = next((p for p in candidates if p.is_file()), None)
    run_dir = summary_path.parent if summary_path is not None else folder.parent
    if summary_path is not None:
        summary = json.loads(summary_path.read_text())
        run["summary_file"] = summary_path.name
        for key in ("seq_len", "world_size", "train_batch_size", "dataset", "dataset_path"):
            if summary.get(key) is not None:
                run[key] = summary[key]
    history = run_dir / "log_history.json"
    if history.is_file():
        steps = [h["step"] for h in json.loads(history.read_text()) if isinstance(h, dict) and "step" in h]
        if steps:
            run["steps"] = max(steps)
    sample_path = Path(sample) if sample is not None else run_dir / "sample.txt"
    if sample is not None and not sample_path.is_file():
        raise FileNotFoundError(f"--sample {sample}: no such file")
    if sample_path.is_file():
        run["sample"] = sample_path.read_text().strip()
        run["sample_file"] = sample_path.name
    report = run_dir / "eval.json"  # training.evaluate's report, if it evaluated this model (scripts/main_job.sh)
    if report.is_file():
        evaluated = (json.loads(report.read_text()).get("models") or [{}])[0].get("path")
        if evaluated and Path(evaluated).resolve() == folder.resolve():
            run["eval_json"] = str(report)
    return run


def check_code_url(code_url: str | None) -> str | None:
    """A full http(s) URL of the code's repository (a path after the host: not a bare hostname), or None."""
    if code_url is None:
        return None
    parsed = urlparse(code_url)
    if parsed.scheme not in ("http", "https") or "." not in parsed.netloc or parsed.path.strip("/") == "":
        raise ValueError(
            f"code_url must be the full URL of the code repository, e.g. https://github.com/<org>/<repo>; "
            f"got {code_url!r}"
        )
    return code_url


# --------------------------------------------------------------------------------------------------------------------
# The card
# --------------------------------------------------------------------------------------------------------------------
def front_matter(
    config, repo_id: str, rows, hub_datasets: list[str], license_name: str, eval_dataset=None, english=False
):
    meta = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": license_name,
        "tags": [
            "bst",
            "block-state-transformer",
            "state-space-model",
            "ssm",
            "s4" if config.ssm_kind == "s4" else "hyena",
            "long-context",
            "custom_code",
        ],
    }
    if hub_datasets:
        meta["datasets"] = list(hub_datasets)
    if english:
        meta["language"] = ["en"]
    if rows:
        metrics = []
        for length, ppl, bpb in rows:
            metrics.append(
                {"type": "perplexity", "name": f"Token perplexity at {length} tokens", "value": round(ppl, 4)}
            )
            metrics.append(
                {"type": "bits_per_byte", "name": f"Bits per byte at {length} tokens", "value": round(bpb, 4)}
            )
        eval_dataset = eval_dataset or {}
        kind, path, split = eval_dataset.get("dataset"), eval_dataset.get("path"), eval_dataset.get("split")
        _, eval_ids = describe_dataset(kind, path, split or "validation")
        dataset_entry = {"type": eval_ids[0] if eval_ids else (kind or "unknown"), "name": kind or "unknown"}
        if eval_ids:
            dataset_entry["name"] = eval_ids[0]
        if split:
            dataset_entry["split"] = split
        meta["model-index"] = [
            {
                "name": repo_id,
                "results": [
                    {
                        "task": {"type": "text-generation", "name": "Language modelling"},
                        "dataset": dataset_entry,
                        "metrics": metrics,
                    }
                ],
            }
        ]
    return meta


def limitations(config) -> list[str]:
    """What the model cannot do, for the card (each item checked by tests/export/test_export.py or tests/models/bst/test_generation.py)."""
    items = [
        "- A small research model trained on a small corpus: its text is not reliable and may not be coherent or "
        "grammatical (judge from the sample, if the run recorded one). It was not trained to follow instructions and "
        "not evaluated for safety or bias.",
    ]
    refuses_longer = config.ssm_kind == "unstruct" and not getattr(config, "unstruct_finite_filter", False)
    if refuses_longer and config.bst_layer_indices:
        items.append(
            f"- `unstruct` (Hyena-style) filters exist only up to `max_position_embeddings` = "
            f"{config.max_position_embeddings} tokens: longer inputs (and generation past that length) raise an error."
        )
    else:
        items.append(
            "- Runs (and generates) at any length, but the quality beyond the training length is only what a "
            "length-generalisation evaluation (above, if any) shows."
        )
    items += [
        "- Generation: assisted/speculative decoding (`assistant_model=` with another BST model, "
        "`prompt_lookup_num_tokens=`) works and equals greedy decoding (`BSTCache.crop` takes back up to the last "
        "64 positions). The cache is a transformers `Cache` of bounded BST layers (`BSTCache`; `generate` builds it as "
        '`DynamicCache(config=model.config)`); `cache_implementation="static"` builds its compileable twin, with '
        "which `generate` compiles the decode step (on the CPU too, with a `compile_config`). The "
        "decoding strategies Transformers moved to Hub `custom_generate` repositories (contrastive search, DoLa, "
        "group/constrained beam search) are not tested with this model. Greedy, sampling and beam search work.",
        "- Padding (left, right or inside a row) is supported in one forward or a `generate` call; padding inside a "
        "continued (cached) chunk is not (it raises an error).",
        "- `AutoModelForSequenceClassification` loads this checkpoint with a new, untrained classification head.",
    ]
    return items


def render_card(
    model,
    repo_id: str,
    rows,
    dataset_text: str | None,
    license_name: str,
    out: Path,
    *,
    hub_datasets: list[str] = (),
    run: dict | None = None,
    eval_dataset: dict | None = None,
    code_url: str | None = None,
    english: bool = False,
) -> str:
    config = model.config
    run = run or {}
    n_params = sum(p.numel() for p in model.parameters())
    kinds = [config.layer_kind(i) for i in range(config.num_hidden_layers)]
    seq_len = run.get("seq_len")
    summary_file = run.get("summary_file", "train_summary.json")
    trained_at = f"{seq_len} tokens per sequence (from the run's `{summary_file}`)" if seq_len else "not recorded"
    if (
        config.ssm_kind == "unstruct"
        and config.bst_layer_indices
        and not getattr(config, "unstruct_finite_filter", False)
    ):
        limit = f"{config.max_position_embeddings} tokens (unstruct filter length)"
    elif config.ssm_kind == "unstruct" and config.bst_layer_indices:
        limit = f"none (the unstruct filter has {config.max_position_embeddings} taps; beyond, they are zero)"
    else:
        limit = "none (S4 kernels are computed for the input length; config `max_position_embeddings` = "
        limit += f"{config.max_position_embeddings})"
    architecture = "\n".join(
        [
            "| field | value |",
            "|---|---|",
            f"| variant | {variant_name(config)} |",
            f"| layers | {config.num_hidden_layers} ({', '.join(f'{i}: {k}' for i, k in enumerate(kinds))}) |",
            f"| width D / heads / head dim / MLP | {config.hidden_size} / {config.num_attention_heads} / "
            f"{config.head_dim} / {config.intermediate_size} (ReLU) |",
            f"| block length W | {config.block_len} |",
            f"| training sequence length L | {trained_at} |",
            f"| maximum input length | {limit} |",
            f"| context states | {config.context_mode.upper()}"
            + (f", S = {config.num_context_states}" if config.context_mode == "mf" else "")
            + " |",
            f"| SSM | {config.ssm_kind}, D_s = {config.ssm_channels}, state size N = {config.ssm_state_size} |",
            f"| vocabulary | {config.vocab_size} (tied embeddings) |",
            f"| parameters | {n_params / 1e6:.2f}M |",
        ]
    )
    if rows:
        evaluation = ""
        if eval_dataset:
            split = eval_dataset.get("split") or "validation"
            text, _ = describe_dataset(eval_dataset.get("dataset"), eval_dataset.get("path"), split)
            scope = [] if f"{split} split" in (text or "") else [f"split `{split}`"]
            if eval_dataset.get("documents") is not None:
                scope.append(f"{eval_dataset['documents']} document(s)")
            if eval_dataset.get("max_tokens_per_doc"):
                scope.append(f"the first {eval_dataset['max_tokens_per_doc']} tokens of each")
            scope = f" ({', '.join(scope)})" if scope else ""
            evaluation = f"On {text or 'an unrecorded dataset'}{scope}, with `training.evaluate`:\n\n"
        evaluation += "\n".join(
            ["| evaluation length | token perplexity | bits per byte |", "|---|---|---|"]
            + [f"| {length} | {ppl:.3f} | {bpb:.4f} |" for length, ppl, bpb in rows]
        )
    else:
        evaluation = "Not evaluated (run `python -m training.evaluate` and export with `--eval_json`)."
    training = [f"- Data: {dataset_text}." if dataset_text else "- Data: not recorded."]
    facts = []
    if seq_len:
        facts.append(f"sequences of {seq_len} tokens")
    if run.get("train_batch_size"):
        facts.append(
            f"{run['train_batch_size']} sequences per micro-batch over {run.get('world_size', 1)} process(es)"
        )
    if run.get("steps"):
        facts.append(f"{run['steps']} optimizer steps")
    if facts:
        training.append(f"- Trained with `python -m training.train`: {', '.join(facts)}.")
    training.append(f"- Paper: {PAPER}.")
    if run.get("sample"):
        text = run["sample"]
        fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
        sample = (
            f"## Sample\n\nUnedited, from `{run.get('sample_file', 'sample.txt')}` of the run (generated by this model):"
            f"\n\n{fence}text\n{text}\n{fence}\n\n"
        )
    else:
        sample = ""
    if code_url:
        code_link = f"[`modeling_bst`]({code_url}) {modeling_bst.__version__}"
    else:
        code_link = f"`modeling_bst` {modeling_bst.__version__}"
    code_rows = "\n".join(f"| `{name}` | `{sha256(out / name)}` |" for name in CODE_FILES)
    meta = front_matter(config, repo_id, rows, list(hub_datasets), license_name, eval_dataset, english)
    values = dict(
        front_matter=yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip(),
        title=repo_id.split("/")[-1],
        variant=variant_name(config),
        n_params=f"{n_params / 1e6:.1f}M",
        architecture=architecture,
        block_len=config.block_len,
        training_data="\n".join(training),
        evaluation=evaluation,
        sample=sample,
        limitations="\n".join(limitations(config)),
        repo_id=repo_id,
        code_link=code_link,
        package_version=modeling_bst.__version__,
        code_files=code_rows,
    )
    return string.Template(CARD_TEMPLATE.read_text()).substitute(values)
