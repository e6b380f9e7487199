"""Export a trained BST model as a complete Hugging Face Hub repository folder (and optionally push it).

    python -m training.export --model outputs/tiny/final --out outputs/tiny/hub \\
        [--eval-json outputs/tiny/eval.json] [--dataset-name books] [--push org/bst-tiny [--private]]

The folder holds ``model.safetensors``, ``config.json`` (with ``auto_map`` and ``use_cache: true``),
``generation_config.json``, the tokenizer files, the four modeling files (so that
``AutoModelForCausalLM.from_pretrained(folder_or_repo, trust_remote_code=True)`` works where ``modeling_bst`` is not
installed), and a ``README.md`` model card rendered from ``hub_cards/model_card.md`` (YAML metadata with
``library_name``, ``pipeline_tag``, tags, datasets, licence and a ``model-index`` of the evaluated perplexities).

``--push`` uploads the folder with ``huggingface_hub.HfApi`` (``create_repo`` + ``upload_folder``); it needs a token
(``huggingface-cli login`` or ``HF_TOKEN``) and network access.
"""

import argparse
import hashlib
import json
import string
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_bst


CODE_FILES = ("configuration_bst.py", "modeling_bst.py", "ssm_bst.py", "cache_bst.py")
CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "hub_cards" / "model_card.md"
PAPER = "https://arxiv.org/abs/2306.09539"


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
    """``[(length, ppl, bits_per_byte)]`` from a ``training.evaluate`` report (first model)."""
    if eval_json is None:
        return [], None
    report = json.loads(Path(eval_json).read_text())
    model = report["models"][0]
    rows = [(r["length"], r["ppl_token"], r["bits_per_byte"]) for r in model["results"] if "ppl_token" in r]
    return rows, report.get("dataset", {})


def front_matter(config, repo_id: str, rows, dataset_name: str, license_name: str) -> dict:
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
        "datasets": [dataset_name],
        "language": ["en"],
    }
    if rows:
        metrics = []
        for length, ppl, bpb in rows:
            metrics.append(
                {"type": "perplexity", "name": f"Token perplexity at {length} tokens", "value": round(ppl, 4)}
            )
            metrics.append(
                {"type": "bits_per_byte", "name": f"Bits per byte at {length} tokens", "value": round(bpb, 4)}
            )
        meta["model-index"] = [
            {
                "name": repo_id,
                "results": [
                    {
                        "task": {"type": "text-generation", "name": "Language modelling"},
                        "dataset": {"type": dataset_name, "name": dataset_name},
                        "metrics": metrics,
                    }
                ],
            }
        ]
    return meta


def render_card(model, repo_id: str, rows, dataset_name: str, license_name: str, out: Path) -> str:
    config = model.config
    n_params = sum(p.numel() for p in model.parameters())
    kinds = [config.layer_kind(i) for i in range(config.num_hidden_layers)]
    architecture = "\n".join(
        [
            "| field | value |",
            "|---|---|",
            f"| variant | {variant_name(config)} |",
            f"| layers | {config.num_hidden_layers} ({', '.join(f'{i}: {k}' for i, k in enumerate(kinds))}) |",
            f"| width D / heads / head dim / MLP | {config.hidden_size} / {config.num_attention_heads} / "
            f"{config.head_dim} / {config.intermediate_size} (ReLU) |",
            f"| block length W / training length L | {config.block_len} / {config.max_position_embeddings} |",
            f"| context states | {config.context_mode.upper()}"
            + (f", S = {config.num_context_states}" if config.context_mode == "mf" else "")
            + " |",
            f"| SSM | {config.ssm_kind}, D_s = {config.ssm_channels}, state size N = {config.ssm_state_size} |",
            f"| vocabulary | {config.vocab_size} (tied embeddings) |",
            f"| parameters | {n_params / 1e6:.2f}M |",
        ]
    )
    if rows:
        evaluation = "\n".join(
            ["| evaluation length | token perplexity | bits per byte |", "|---|---|---|"]
            + [f"| {length} | {ppl:.3f} | {bpb:.4f} |" for length, ppl, bpb in rows]
        )
    else:
        evaluation = "Not evaluated (run `python -m training.evaluate` and export with `--eval-json`)."
    limitations = [
        "- Small research model: expect fluent-looking but unreliable text.",
        "- `unstruct` (Hyena-style) filters exist only up to `max_position_embeddings` tokens; longer inputs raise an"
        " error. S4 models run (and generate) at any length, but quality beyond the training length is not"
        " guaranteed."
        if config.ssm_kind == "unstruct"
        else "- S4 kernels are computed for the actual input length: the model runs at any length, but quality beyond"
        " the training length is only what the length-generalisation evaluation shows.",
        "- Left padding and right padding are supported; padding inside a continued (cached) chunk is not.",
    ]
    code_rows = "\n".join(f"| `{name}` | `{sha256(out / name)}` |" for name in CODE_FILES)
    meta = front_matter(config, repo_id, rows, dataset_name, license_name)
    values = dict(
        front_matter=yaml.safe_dump(meta, sort_keys=False).strip(),
        title=repo_id.split("/")[-1],
        variant=variant_name(config),
        n_params=f"{n_params / 1e6:.1f}M",
        architecture=architecture,
        block_len=config.block_len,
        training_data=f"Trained on `{dataset_name}` with `python -m training.train` (see the training recipe saved "
        "with the run). Paper: " + PAPER + ".",
        evaluation=evaluation,
        limitations="\n".join(limitations),
        repo_id=repo_id,
        package_version=modeling_bst.__version__,
        code_files=code_rows,
    )
    return string.Template(CARD_TEMPLATE.read_text()).substitute(values)


def export(
    model_dir: str,
    out_dir: str,
    repo_id: str | None = None,
    eval_json: str | None = None,
    dataset_name: str = "books",
    license_name: str = "apache-2.0",
) -> Path:
    """Write the Hub folder; returns its path."""
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
    rows, _ = evaluation_rows(Path(eval_json) if eval_json else None)
    card = render_card(model, repo_id, rows, dataset_name, license_name, out)
    (out / "README.md").write_text(card)
    return out


def push(out_dir: Path, repo_id: str, private: bool = False):
    """Create the Hub repository (if needed) and upload the folder."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, commit_message="Upload BST model")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="folder written by training.train (save_pretrained)")
    parser.add_argument("--out", required=True, help="Hub repository folder to write")
    parser.add_argument("--push", metavar="ORG/NAME", help="upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--eval-json", help="report of training.evaluate, for the model card's model-index")
    parser.add_argument("--dataset-name", default="books")
    parser.add_argument("--license", default="apache-2.0")
    args = parser.parse_args(argv)
    out = export(args.model, args.out, args.push, args.eval_json, args.dataset_name, args.license)
    print(f"Hub folder: {out}")
    if args.push:
        push(out, args.push, args.private)
        print(f"pushed to https://huggingface.co/{args.push}")
    return out


if __name__ == "__main__":
    main()
