"""Export a trained BST model as a complete Hugging Face Hub repository folder (and optionally push it).

    python -m training.export --model outputs/tiny/final --out outputs/tiny/hub \\
        [--eval_json outputs/tiny/eval.json] [--dataset embedded] [--code_url https://github.com/ORG/REPO] \\
        [--onnx [--onnx_seq_len 128] [--onnx_batch_size 1]] [--push org/bst-tiny [--private]]

The folder holds ``model.safetensors``, ``config.json`` (with an ``auto_map`` of every head and ``use_cache: true``),
``generation_config.json``, the tokenizer files, the four modeling files (so that ``AutoModel``,
``AutoModelForCausalLM`` and ``AutoModelForSequenceClassification`` load the folder with ``trust_remote_code=True``
where ``modeling_bst`` is not installed), and a ``README.md`` model card rendered from ``hub_cards/model_card.md``.

The card states only what the run recorded: the training sequence length and corpus come from the run's
``train_summary.json`` (next to ``final/``, or ``--train_summary``), the optimizer steps from ``log_history.json``,
an unedited sample from ``sample.txt`` if present, the evaluation from ``--eval_json`` (default: the run's
``eval.json`` if it evaluated this model folder), so exporting again (``--onnx``) writes the same card. ``datasets:`` metadata lists
real Hub dataset ids only (``--dataset pg19`` -> ``emozilla/pg19``, or a Hub id); local corpora (the embedded books,
``--dataset_path`` folders) are described in the text and left out of the metadata. ``--code_url`` adds a link to
the code's repository (no default: the modeling code is in the exported folder itself).

``--onnx`` also writes ``onnx/``: ``model.onnx`` (input ids -> logits), ``prefill.onnx`` (-> logits and the decoding
state) and ``decode_step.onnx`` (one token and the state -> logits and the new state) for ``--onnx_batch_size`` rows
of ``--onnx_seq_len`` tokens (fixed shapes), with ``onnx_state.json`` naming the state tensors; see
``training.onnx_export.export_onnx`` and docs/clients.md. It needs the ``onnx`` extra (onnx, onnxscript; onnxruntime to run the files).

The card is rendered by ``training.model_card``, the ONNX files written by ``training.onnx_export``; this module
writes the folder, pushes it, and is the command line.

``--push`` uploads the folder with ``huggingface_hub.HfApi`` (``create_repo`` + ``upload_folder``); it needs a token
(``huggingface-cli login`` or ``HF_TOKEN``) and network access.
"""

import argparse
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_bst  # noqa: F401  (the Auto classes load BST folders)
from training.model_card import (
    ENGLISH_KINDS,
    check_code_url,
    describe_dataset,
    evaluation_rows,
    read_run,
    render_card,
)
from training.onnx_export import export_onnx


def export(
    model_dir: str,
    out_dir: str,
    repo_id: str | None = None,
    eval_json: str | None = None,
    dataset_name: str | None = None,
    license_name: str = "apache-2.0",
    *,
    dataset: str | None = None,
    dataset_path: str | None = None,
    code_url: str | None = None,
    train_summary: str | None = None,
    sample: str | None = None,
) -> Path:
    """Write the Hub folder; returns its path.

    ``dataset`` / ``dataset_path``: the training corpus as given to ``training.train`` (default: what the run's
    ``train_summary.json`` recorded, if anything); ``dataset_name``: a free-text description that replaces the
    derived one (it never becomes ``datasets:`` metadata)."""
    code_url = check_code_url(code_url)
    run = read_run(model_dir, train_summary, sample)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # Trainer writes use_cache=false into the config it saves; generation and plain calls want the cache.
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.save_pretrained(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    repo_id = repo_id or f"bst/{Path(model_dir).resolve().parent.name}"
    eval_json = eval_json or run.get("eval_json")
    rows, eval_dataset = evaluation_rows(Path(eval_json) if eval_json else None)
    dataset = dataset or run.get("dataset")
    dataset_path = dataset_path or run.get("dataset_path")
    dataset_text, hub_datasets = describe_dataset(dataset, dataset_path)
    if dataset_name:
        dataset_text = dataset_name
    card = render_card(
        model,
        repo_id,
        rows,
        dataset_text,
        license_name,
        out,
        hub_datasets=hub_datasets,
        run=run,
        eval_dataset=eval_dataset,
        code_url=code_url,
        english=dataset in ENGLISH_KINDS and not dataset_path,
    )
    (out / "README.md").write_text(card)
    return out


def push(out_dir: Path, repo_id: str, private: bool = False):
    """Create the Hub repository (if needed) and upload the folder."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, commit_message="Upload BST model")


class _OldSpelling(argparse.Action):
    """Stores the value; the old dashed spelling (``--eval-json``) still works, with a deprecation warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string and "-" in option_string[2:]:
            new = "--" + option_string[2:].replace("-", "_")
            warnings.warn(
                f"training.export: {option_string} is deprecated and will be removed; use {new} (underscores, like "
                "the other CLIs).",
                FutureWarning,
                stacklevel=1,
            )
        setattr(namespace, self.dest, values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="folder written by training.train (save_pretrained)")
    parser.add_argument("--out", required=True, help="Hub repository folder to write")
    parser.add_argument("--push", metavar="ORG/NAME", help="upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true")
    parser.add_argument(
        "--eval_json",
        "--eval-json",
        action=_OldSpelling,
        help="report of training.evaluate, for the model card's evaluation and model-index (default: the run's "
        "eval.json if it evaluated --model; --eval-json: deprecated)",
    )
    parser.add_argument(
        "--dataset",
        help="training corpus: a training.data kind (embedded, pg19, arxiv, github) or a Hub dataset id; "
        "default: what the run's train_summary.json recorded",
    )
    parser.add_argument("--dataset_path", help="--dataset_path of the training run (a local corpus or a Hub id)")
    parser.add_argument(
        "--dataset_name",
        "--dataset-name",
        action=_OldSpelling,
        help="free-text description of the training data for the card (never written as datasets: metadata)",
    )
    parser.add_argument(
        "--code_url",
        help="full URL of the code's repository for the card (default: no link; the code is in the folder)",
    )
    parser.add_argument(
        "--train_summary", help="train_summary.json of the run (default: next to --model or its parent)"
    )
    parser.add_argument("--sample", help="text file with a generated sample (default: sample.txt of the run, if any)")
    parser.add_argument("--license", default="apache-2.0")
    parser.add_argument("--onnx", action="store_true", help="also export ONNX files to OUT/onnx (export_onnx)")
    parser.add_argument("--onnx_seq_len", type=int, default=128, help="prompt length of the ONNX forward / prefill")
    parser.add_argument("--onnx_batch_size", type=int, default=1, help="rows of the ONNX forward / prefill / step")
    args = parser.parse_args(argv)
    out = export(
        args.model,
        args.out,
        args.push,
        args.eval_json,
        args.dataset_name,
        args.license,
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        code_url=args.code_url,
        train_summary=args.train_summary,
        sample=args.sample,
    )
    print(f"Hub folder: {out}")
    if args.onnx:
        model = AutoModelForCausalLM.from_pretrained(out)
        result = export_onnx(model, out / "onnx", seq_len=args.onnx_seq_len, batch_size=args.onnx_batch_size)
        print(f"ONNX: {', '.join(result['files'])}")
    if args.push:
        push(out, args.push, args.private)
        print(f"pushed to https://huggingface.co/{args.push}")
    return out


if __name__ == "__main__":
    main()
