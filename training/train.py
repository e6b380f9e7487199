"""Train or fine-tune a BST model with the Hugging Face ``Trainer``: a language model, or a task's classifier.

    python -m training.train --config configs/train/tiny.yaml [--<field> <value> ...]
    python -m training.train --config configs/train/listops-tiny.yaml
    torchrun --nproc_per_node 2 -m training.train --config configs/train/tiny.yaml
    accelerate launch --config_file configs/accelerate/ddp_cpu.yaml -m training.train --config configs/train/tiny.yaml

The YAML holds three sections, ``model`` (:class:`ModelArguments`), ``data`` (:class:`DataArguments`) and
``training`` (``transformers.TrainingArguments``); every field can be overridden on the command line by its name
(``--max_steps 20 --seq_len 256``); command-line values win. ``bf16: auto`` means bf16 where the device supports it,
``torch_compile: auto`` a compiled model on a CUDA GPU.
The run writes Trainer checkpoints (``--resume_from_checkpoint DIR|true`` continues exactly), ``log_history.json``
and, in ``<output_dir>/final``, the model with its tokenizer and ``use_cache=true`` (loads with
``AutoModelForCausalLM``/``AutoTokenizer``).

Segment streaming (``stream_segments: true``, for Transformer-XL and BRecT): each batch row continues the previous
batch's row of the same document; the model's cache is carried from one batch to the next (detached), rows where a
new document starts are reset (``BSTCache.reset_rows``), and the cache is saved with every checkpoint so that resuming
is exact.

Tasks (``task`` in the data section): ``lm`` (default) trains ``BSTForCausalLM`` on text segments; ``listops`` trains
``BSTForSequenceClassification`` on Long Range Arena ListOps (``training/tasks/listops.py``; examples generated from the
``listops_*`` fields, or read from ``dataset_path``), with accuracy as its evaluation metric: evaluation during
training on the validation split (``max_eval_samples`` caps it), at the end on the whole validation and test splits
(``val_accuracy``, ``test_accuracy``). The model is a preset (``model_config``) or ``BSTConfig`` defaults with
``model_overrides`` and the task's defaults (``training.tasks.listops.MODEL_DEFAULTS``). Optimizer, schedule, checkpoints
and resuming are the language model's.
"""

from __future__ import annotations

import copy
import difflib
import gc
import inspect
import json
import logging
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from torch.utils.data import SequentialSampler
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)

from training import data as D
from training import preset
from training.host import keep_large_allocations
from training.optim import parameter_groups


logger = logging.getLogger("training.train")
REPO_ROOT = Path(__file__).resolve().parent.parent
STREAM_CACHE_FILE = "stream_cache_rank{rank}.safetensors"
# Written last (atomically, fsynced) by every checkpoint save: a checkpoint folder without it was interrupted
# (e.g. killed mid-save) and is never resumed from.
CHECKPOINT_COMPLETE = "checkpoint_complete.json"


def _fsync_write(path: str, text: str):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(output_dir: str) -> list[str]:
    """Checkpoint folders of ``output_dir`` whose save finished, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if (
            name.startswith("checkpoint-")
            and name[11:].isdigit()
            and os.path.isfile(os.path.join(path, CHECKPOINT_COMPLETE))
        ):
            found.append((int(name[11:]), path))
    return [path for _, path in sorted(found)]


def last_complete_checkpoint(output_dir: str) -> str | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


@dataclass
class ModelArguments:
    model_config: str | None = field(
        default=None, metadata={"help": "preset name under training/presets/ or a config.json path (new model)"}
    )
    model_name_or_path: str | None = field(default=None, metadata={"help": "pretrained folder/Hub id to fine-tune"})
    model_overrides: str | None = field(default=None, metadata={"help": "JSON object of config fields to override"})
    tokenizer: str = field(
        default=D.DEFAULT_TOKENIZER,
        metadata={"help": "shipped name (mistral-v1-32k), folder or Hub id, or 'bpe' to train one on the train docs"},
    )
    tokenizer_vocab_size: int = field(default=8192, metadata={"help": "vocabulary size when tokenizer == 'bpe'"})
    tokenizer_train_docs: int | None = field(default=None, metadata={"help": "train the BPE on the first N docs"})
    ssm_lr: float | None = field(
        default=None, metadata={"help": "lr of SSM parameters (default: config.ssm_lr; None there: the lr)"}
    )
    ssm_weight_decay: float = field(default=0.0, metadata={"help": "weight decay of SSM parameters"})
    cpu_allocation_threshold_mib: int = field(
        default=1024,
        metadata={
            "help": "CPU runs: allocations below this size reuse malloc's heap (training/host.py); 0: unchanged"
        },
    )


TASKS = ("lm", "listops")


@dataclass
class DataArguments:
    task: str = field(default="lm", metadata={"help": "lm (language model) | listops (LRA ListOps classifier)"})
    dataset: str = field(default="embedded", metadata={"help": "embedded | pg19 | arxiv | github"})
    dataset_path: str | None = field(
        default=None, metadata={"help": "local file/folder or Hub id (default per kind); listops: a folder of splits"}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config name"})
    data_files: str | None = field(default=None, metadata={"help": "data_files pattern ({split} is substituted)"})
    dataset_revision: str | None = field(default=None, metadata={"help": "Hub revision"})
    text_column: str | None = field(default=None, metadata={"help": "column holding the document text"})
    streaming: bool = field(default=False, metadata={"help": "stream the training documents (Hub-scale data)"})
    train_split: str = field(default="train")
    eval_split: str | None = field(default="validation", metadata={"help": "None/'' disables evaluation data"})
    seq_len: int = field(default=4096, metadata={"help": "segment length L (the paper: 4096)"})
    max_train_docs: int | None = field(default=None)
    max_eval_docs: int | None = field(default=None)
    max_eval_segments: int | None = field(default=None, metadata={"help": "evaluate on the first N segments only"})
    stream_segments: bool = field(
        default=False, metadata={"help": "carry the model cache across consecutive segments (Trsf-XL / BRecT)"}
    )
    shuffle_buffer: int = field(default=1000, metadata={"help": "segment shuffle buffer when streaming"})
    # task: listops (dataset_path: a folder of train/val/test splits; unset: the splits are generated)
    listops_train: int = field(default=96000, metadata={"help": "listops: generated training examples"})
    listops_val: int = field(default=2000, metadata={"help": "listops: generated validation examples"})
    listops_test: int = field(default=2000, metadata={"help": "listops: generated test examples"})
    listops_min_length: int = field(default=500, metadata={"help": "listops: shortest generated expression (tokens)"})
    listops_max_length: int = field(default=2000, metadata={"help": "listops: longest generated expression (tokens)"})
    listops_max_depth: int = field(default=10, metadata={"help": "listops: deepest generated nesting"})
    listops_max_args: int = field(default=10, metadata={"help": "listops: most arguments of an operator"})
    listops_p_op: float = field(default=0.25, metadata={"help": "listops: probability that a node is an operator"})
    listops_seed: int = field(default=0, metadata={"help": "listops: generator seed"})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "listops: validation examples evaluated during training (final: all)"}
    )


# --------------------------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------------------------
def read_recipe(path: str | os.PathLike) -> dict:
    """A recipe YAML flattened to ``{field: value}``. Sections ``model``, ``data``, ``training`` are merged; top-level
    scalar keys are accepted too. Raises ``ValueError`` on a field named twice."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    flat: dict = {}
    for key, value in raw.items():
        items = value.items() if key in ("model", "data", "training") and isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if k in flat:
                raise ValueError(f"{path}: field {k!r} given twice")
            flat[k] = v
    return flat


def _auto_value(field: str) -> bool:
    """What ``auto`` means for a recipe field: ``bf16`` where the GPU supports it; ``torch_compile`` on a CUDA GPU
    (a compiled training step there is one graph, without the eager per-op launches that bound BST's step; on the
    CPU the first compile takes minutes for little gain, docs/performance.md)."""
    if field == "bf16":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return bool(torch.cuda.is_available())


AUTO_FIELDS = ("bf16", "torch_compile")


def _resolve_auto(values: dict) -> dict:
    for name in AUTO_FIELDS:
        if values.get(name) == "auto":
            values[name] = _auto_value(name)
    if isinstance(values.get("model_overrides"), dict):
        values["model_overrides"] = json.dumps(values["model_overrides"])
    return values


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, TrainingArguments]:
    """Parse ``--config FILE`` plus overrides into the three argument dataclasses (command line wins)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # No abbreviations: a near-miss flag (--learning_rat) is an error, not a prefix of another flag.
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments), allow_abbrev=False)
    parser.add_argument("--config", default=None, help="recipe YAML (configs/train/*.yaml)")
    known = {a.dest for a in parser._actions}
    # `--bf16 auto` / `--torch_compile auto` on the command line.
    for i, a in enumerate(argv[:-1]):
        if a.startswith("--") and a[2:] in AUTO_FIELDS and argv[i + 1] == "auto":
            argv[i + 1] = str(_auto_value(a[2:]))
    pre, _ = parser.parse_known_args(argv)  # only to find --config
    defaults: dict = {}
    if pre.config:
        defaults = read_recipe(pre.config)
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"{pre.config}: unknown fields {unknown}")
    defaults = _resolve_auto(defaults)
    # Without a GPU, say so: accelerate only forms a CPU process group (gloo, torchrun / accelerate launch) when
    # TrainingArguments.use_cpu is set; otherwise every process would silently train alone.
    if not (torch.cuda.is_available() or getattr(torch, "xpu", None) and torch.xpu.is_available()):
        defaults.setdefault("use_cpu", True)
    # Required-ness comes from the dataclasses; a YAML value satisfies it.
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False
    parser.set_defaults(**defaults)
    model_args, data_args, train_args, _ = parser.parse_args_into_dataclasses(args=argv)
    return model_args, data_args, train_args


# --------------------------------------------------------------------------------------------------------------------
# Model and tokenizer
# --------------------------------------------------------------------------------------------------------------------
def resolve_preset(name: str) -> str:
    """A preset name (``bst-tiny-sh-s4``, [`training.preset`]) or path to a config.json."""
    return name if os.path.exists(name) else preset(name)


def build_tokenizer(model_args: ModelArguments, data_args: DataArguments, train_args: TrainingArguments):
    """The tokenizer: from the fine-tuned model's folder, a shipped/local/Hub one, or a BPE trained (on the main
    process, then saved to ``<output_dir>/tokenizer`` and read back everywhere, so all ranks and resumed runs use the
    same one)."""
    if model_args.tokenizer != "bpe":
        if model_args.model_name_or_path and model_args.tokenizer == D.DEFAULT_TOKENIZER:
            try:
                return D.load_tokenizer(model_args.model_name_or_path)
            except (OSError, ValueError):
                pass
        return D.load_tokenizer(model_args.tokenizer)
    tok_dir = Path(train_args.output_dir) / "tokenizer"
    with train_args.main_process_first(desc="train BPE tokenizer"):
        if not (tok_dir / "tokenizer.json").exists():
            docs = D.load_documents(
                data_args.dataset,
                data_args.train_split,
                path=data_args.dataset_path,
                name=data_args.dataset_config,
                data_files=data_args.data_files,
                revision=data_args.dataset_revision,
                streaming=data_args.streaming,
                text_column=data_args.text_column,
            )
            import itertools

            n = model_args.tokenizer_train_docs or data_args.max_train_docs
            texts = itertools.islice(D.texts_of(docs), n)
            tok = D.train_bpe_tokenizer(texts, vocab_size=model_args.tokenizer_vocab_size)
            tok.save_pretrained(str(tok_dir))
    return D.load_tokenizer(str(tok_dir))


# Config bookkeeping entries that are not model settings and cannot be overridden.
_NOT_OVERRIDABLE = frozenset({"model_type", "transformers_version", "_name_or_path", "architectures", "auto_map"})


def parse_model_overrides(text: str | None) -> dict:
    """``--model_overrides`` (a JSON object) as a dict; a clear ``ValueError`` for anything else."""
    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model_overrides must be a JSON object of config fields, got {text!r} ({e})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--model_overrides must be a JSON object of config fields, got {text!r}")
    return overrides


def apply_model_overrides(config, overrides: dict, source: str = "--model_overrides"):
    """``config`` with ``overrides`` set, after the config's own validation (``BSTConfig.validate_bst``).

    Raises ``ValueError`` naming the field for an unknown field (with the closest known name), a value of the wrong
    type, or a value the config rejects (``block_len: 0``, ``context_mode: "xx"``, ...), so that a bad override
    fails before anything is built."""
    signature = inspect.signature(type(config).__init__).parameters
    fields = (set(signature) | set(config.to_dict())) - _NOT_OVERRIDABLE - {"self", "kwargs"}
    fixed = sorted(set(overrides) & _NOT_OVERRIDABLE)
    if fixed:
        raise ValueError(f"{source}: {', '.join(map(repr, fixed))} cannot be overridden")
    unknown = sorted(set(overrides) - fields)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, fields, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"{source}: unknown {type(config).__name__} field(s) {', '.join(hints)}")
    config = copy.deepcopy(config)
    for name, value in overrides.items():
        accepted = _accepted_types(signature.get(name), getattr(config, name, None))
        if accepted and not (isinstance(value, accepted) and (bool in accepted or not isinstance(value, bool))):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
            raise ValueError(f"{source}: {type(config).__name__}.{name} must be {names}, got {value!r}")
    # The layer fields (num_hidden_layers, layer_types, the index fields) make a new config, in any order
    # (BSTConfig.from_dict): {"num_hidden_layers": 4, "bst_layer_indices": [0, 2]} on a 12-layer preset.
    layers = {name: value for name, value in overrides.items() if name in getattr(config, "layer_fields", ())}
    try:
        for name, value in overrides.items():
            if name not in layers:
                setattr(config, name, value)  # a strict config checks each field's own range here
        if layers:
            config = type(config).from_dict(config.to_dict(), **layers)
        if hasattr(config, "validate_bst"):
            config.validate_bst()
        config.validate()
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"{source}: {e}") from None
    return config


def _accepted_types(param, current) -> tuple:
    """The types a config field accepts: from its ``__init__`` annotation, else from its current value; ``()`` when
    unknown. An ``int`` is accepted where a ``float`` is."""
    if param is not None and param.annotation is not inspect.Parameter.empty:
        hints = typing.get_args(param.annotation) or (param.annotation,)
    elif current is not None:
        hints = (type(current),)
    else:
        return ()
    accepted = tuple(typing.get_origin(t) or t for t in hints)
    accepted = tuple(dict.fromkeys(t for t in accepted if isinstance(t, type)))
    return accepted + (int,) if float in accepted and int not in accepted else accepted


def build_config(model_args: ModelArguments, tokenizer=None):
    """The model's config: the preset's (or the pretrained folder's) with ``model_overrides`` applied and validated.
    With a tokenizer, a new model also takes its vocabulary size and special token ids (unless overridden)."""
    import modeling_bst  # noqa: F401  (registers model_type "bst")

    overrides = parse_model_overrides(model_args.model_overrides)
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    elif model_args.model_config:
        config = AutoConfig.from_pretrained(resolve_preset(model_args.model_config))
        if tokenizer is not None:
            overrides.setdefault("vocab_size", len(tokenizer))
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                overrides.setdefault(key, getattr(tokenizer, key))
    else:
        raise ValueError("set model_config (a preset) or model_name_or_path")
    return apply_model_overrides(config, overrides)


def build_task_config(model_args: ModelArguments, data_args: DataArguments, max_length: int | None = None):
    """The config of the recipe's model: :func:`build_config` for ``task: lm``; for ``task: listops`` the classifier's
    (``training.tasks.listops.classifier_config``: a preset's or ``BSTConfig`` defaults, the task's defaults, then
    ``model_overrides``, checked like the language model's)."""
    if data_args.task not in TASKS:
        raise ValueError(f"unknown task {data_args.task!r}; known: {', '.join(TASKS)}")
    if data_args.task == "lm":
        return build_config(model_args)
    from modeling_bst import BSTConfig
    from training.tasks import listops

    overrides = parse_model_overrides(model_args.model_overrides)
    max_length = max_length or data_args.listops_max_length
    if model_args.model_name_or_path:
        return apply_model_overrides(AutoConfig.from_pretrained(model_args.model_name_or_path), overrides)
    base = AutoConfig.from_pretrained(resolve_preset(model_args.model_config)) if model_args.model_config else None
    # Names, types and values of the overrides are checked on the config they end up in.
    checked = base if base is not None else BSTConfig()
    layers = None if base is not None else checked.num_hidden_layers
    apply_model_overrides(checked, {**listops.classifier_fields(overrides, max_length, layers), **listops.TASK_FIELDS})
    return listops.classifier_config(overrides, max_length, base=base)


def check_run(data_args: DataArguments, config) -> None:
    """Cross-checks of data and model settings that would otherwise train the wrong thing silently.

    Transformer-XL (a model of block attention layers only: no BST, recurrent or GSS layers) with segment streaming
    trains on segments of its window, reading the previous segment through the detached cache: a longer segment
    would put several windows in one segment, with gradients flowing between them (issue #13)."""
    is_xl = not (
        getattr(config, "bst_layer_indices", None)
        or getattr(config, "recurrent_layer_indices", None)
        or getattr(config, "gss_layer_indices", None)
    )
    if data_args.task != "lm":
        if data_args.stream_segments or data_args.streaming:
            raise ValueError(f"task {data_args.task!r}: stream_segments / streaming apply to language modelling only")
        return
    if data_args.stream_segments and is_xl and data_args.seq_len != config.block_len:
        raise ValueError(
            f"stream_segments with a Transformer-XL model (no BST, recurrent or GSS layers): seq_len "
            f"({data_args.seq_len}) must equal the model's block_len ({config.block_len}), so that each segment is "
            f"one window and the previous one is read from the detached cache; pass --seq_len {config.block_len} "
            f"(and scale the batch to keep the tokens per step)."
        )


def build_model(model_args: ModelArguments, tokenizer):
    """A new model from a preset (vocabulary and special ids taken from the tokenizer) or a pretrained one."""
    config = build_config(model_args, tokenizer)
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size is {config.vocab_size}")
    return AutoModelForCausalLM.from_config(config)


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------
def build_datasets(data_args: DataArguments, train_args: TrainingArguments, tokenizer):
    """Training and evaluation segment datasets (see ``training.data``)."""
    import itertools

    order = "stream" if data_args.stream_segments else "document"
    load = dict(
        path=data_args.dataset_path,
        name=data_args.dataset_config,
        data_files=data_args.data_files,
        revision=data_args.dataset_revision,
        text_column=data_args.text_column,
    )
    if data_args.streaming:

        def texts():
            return D.texts_of(D.load_documents(data_args.dataset, data_args.train_split, streaming=True, **load))

        train = D.StreamingSegmentDataset(
            texts,
            tokenizer,
            data_args.seq_len,
            order=order,
            per_device_batch=train_args.per_device_train_batch_size,
            num_processes=train_args.world_size,
            shuffle_buffer=data_args.shuffle_buffer,
            seed=train_args.seed,
            max_docs=data_args.max_train_docs,
        )
    else:
        docs = D.load_documents(data_args.dataset, data_args.train_split, **load)
        token_docs = D.tokenize_documents(tokenizer, D.texts_of(docs), data_args.max_train_docs)
        train = D.SegmentDataset(
            token_docs,
            data_args.seq_len,
            tokenizer.pad_token_id,
            order=order,
            per_device_batch=train_args.per_device_train_batch_size,
            num_processes=train_args.world_size,
        )
    evalset = None
    if data_args.eval_split:
        eval_docs = D.load_documents(
            data_args.dataset, data_args.eval_split, streaming=data_args.streaming, **load
        )  # evaluation data is always materialised (max_eval_docs caps it)
        texts = itertools.islice(D.texts_of(eval_docs), data_args.max_eval_docs)
        evalset = D.SegmentDataset(
            D.tokenize_documents(tokenizer, texts),
            data_args.seq_len,
            tokenizer.pad_token_id,
            order="document",
            max_segments=data_args.max_eval_segments,
        )
    return train, evalset


# --------------------------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------------------------
def stream_inputs(inputs: dict) -> dict:
    """A streamed batch ready for the cached forward: right padding (a document's last segment) keeps its ``-100``
    labels but loses its ``attention_mask``.

    A continued (cached) forward cannot honour padding, and need not here: the model is causal, so right padding
    never changes the real tokens' outputs, and the row's next segment starts a new document, whose ``doc_start``
    resets the row's cache (``BSTCache.reset_rows``) before the padded state is ever read. Padding anywhere but at
    the right end is an error."""
    mask = inputs.get("attention_mask")
    if mask is None or bool(mask.all()):
        return inputs
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("streamed segments may only be padded on the right (a document's last segment)")
    labels = inputs.get("labels")
    if labels is not None and bool((labels[mask == 0] != -100).any()):
        raise ValueError("padding positions of a streamed segment must have label -100")
    return {k: v for k, v in inputs.items() if k != "attention_mask"}


class BSTTrainer(Trainer):
    """``Trainer`` with SSM parameter groups and optional segment streaming (cache carried across batches)."""

    def __init__(self, *args, ssm_lr: float | None = None, ssm_weight_decay: float = 0.0, stream_segments=False, **kw):
        super().__init__(*args, **kw)
        self.ssm_lr = ssm_lr
        self.ssm_weight_decay = ssm_weight_decay
        self.stream_segments = stream_segments
        self._stream_cache = None

    # -- sharded training ---------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self._enable_fsdp_on_cpu()

    def _enable_fsdp_on_cpu(self):
        """FSDP2 (``fully_shard``) on a CPU process group (gloo).

        accelerate turns FSDP on only for accelerator process groups: on CPU a requested FSDP plugin
        (``accelerate launch`` with an FSDP config, or ``--fsdp``/``--fsdp_config``) is silently dropped and the run
        is plain DDP. ``fully_shard`` itself works on CPU with gloo, so the requested plugin is installed here; the
        model and optimizer then go through accelerate's FSDP2 preparation as on GPUs (parameter groups, and so the
        SSM learning rate, are kept: their parameters are swapped for the sharded ones). FSDP1 is refused on CPU."""
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        from_launcher = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1")
        requested = self.args.fsdp_plugin_args is not None or from_launcher
        if not requested or state.distributed_type != DistributedType.MULTI_CPU:
            return
        plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {}))
        if plugin.fsdp_version != 2:
            raise ValueError(
                f"FSDP on CPU needs fsdp_version 2 (fully_shard), got {plugin.fsdp_version}: set fsdp_version: 2 in "
                "the accelerate config (configs/accelerate/fsdp_cpu.yaml) or in --fsdp_config"
            )
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        # As AcceleratorState does for accelerator process groups: every later AcceleratorState() copies it from here.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True

    def sharding_report(self) -> dict:
        """Parameter and optimizer-state elements held by this process (local shards under FSDP), with each
        optimizer group's initial learning rate; gathered from every process (call it on all of them)."""
        from torch.distributed.tensor import DTensor

        def local(t):
            return (t.to_local() if isinstance(t, DTensor) else t).numel()

        model = self.model_wrapped if self.model_wrapped is not None else self.model
        for module in model.modules():
            if hasattr(module, "reshard"):  # FSDP2 keeps the root's parameters gathered after an evaluation forward
                module.reshard()
        report = {
            "parameters": sum(local(p) for p in {id(p): p for p in model.parameters()}.values()),
            "optimizer_state": 0,
            "groups": {},
        }
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                report["groups"][group.get("name", str(len(report["groups"])))] = {
                    "lr": group.get("initial_lr", group["lr"]),
                    "parameters": sum(local(p) for p in group["params"]),
                }
            for st in self.optimizer.state.values():
                report["optimizer_state"] += sum(local(v) for v in st.values() if torch.is_tensor(v) and v.ndim)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reports = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(reports, report)
            return {"ranks": reports}
        return {"ranks": [report]}

    # -- resuming ---------------------------------------------------------------------------------------------
    def _run_epoch(self, *args, **kwargs):
        # A run resumed from a checkpoint already at max_steps: the loop would take one step before its stop check.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return
        return super()._run_epoch(*args, **kwargs)

    def _issue_warnings_after_load(self, load_result):
        # Tied weights (lm_head.weight is the input embedding) are never saved, so no checkpoint holds them: not a
        # missing key. They are re-tied.
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [k for k in load_result.missing_keys if k not in tied]
        if len(missing) != len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(type(load_result)(missing, load_result.unexpected_keys))

    # -- optimiser: own lr / no weight decay for SSM parameters --------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            model = self.model if model is None else model
            groups = parameter_groups(model, self.args.learning_rate, self.args.weight_decay, self.ssm_lr)
            for g in groups:
                if g["name"] == "ssm":
                    g["weight_decay"] = self.ssm_weight_decay
            optim_cls, optim_kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
            optim_kwargs = {k: v for k, v in optim_kwargs.items() if k != "lr"}
            self.optimizer = optim_cls(groups, lr=self.args.learning_rate, **optim_kwargs)
        return self.optimizer

    # -- streaming ------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        if self.stream_segments:
            ds = self.train_dataset if train_dataset is None else train_dataset
            return SequentialSampler(ds)  # rows are already in stream order (training.data.stream_order)
        return super()._get_train_sampler(train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        doc_start = inputs.pop("doc_start", None)
        if not (self.stream_segments and model.training):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        cache = self._stream_cache
        if cache is not None and doc_start is not None:
            cache.reset_rows(doc_start)
        inputs = dict(stream_inputs(inputs), use_cache=True, past_key_values=cache)
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        new_cache = outputs.past_key_values
        self._stream_cache = new_cache.detach() if hasattr(new_cache, "detach") else new_cache
        return (loss, outputs) if return_outputs else loss

    def _save_checkpoint(self, model, trial):
        """Crash-safe checkpoint: the completion marker is written last, and older checkpoints are rotated away
        only after it, so a kill at any moment leaves the previous complete checkpoint usable."""
        run_dir = self._get_output_dir(trial=trial)
        ckpt = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if self.stream_segments and self._stream_cache is not None:
            os.makedirs(ckpt, exist_ok=True)
            path = os.path.join(ckpt, STREAM_CACHE_FILE.format(rank=self.args.process_index))
            from training.cache_snapshot import cache_to_tensors

            save_file(cache_to_tensors(self._stream_cache), path)
        if self.args.should_save:
            _fsync_write(os.path.join(ckpt, CHECKPOINT_COMPLETE), json.dumps({"global_step": self.state.global_step}))
            if limit:
                import shutil

                for old in complete_checkpoints(run_dir)[:-limit]:
                    if old != self.state.best_model_checkpoint:
                        shutil.rmtree(old, ignore_errors=True)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if self.stream_segments and checkpoint is not None:
            path = os.path.join(checkpoint, STREAM_CACHE_FILE.format(rank=self.args.process_index))
            if os.path.exists(path):
                from training.cache_snapshot import cache_from_tensors

                tensors = load_file(path, device=str(self.args.device))
                self._stream_cache = cache_from_tensors(self.model.config, tensors)


def build_listops(model_args: ModelArguments, data_args: DataArguments, train_args: TrainingArguments):
    """``task: listops``: the classifier, the datasets (training, evaluation during training, and the final
    ``{"val", "test"}`` evaluations) and the splits' statistics."""
    from training.tasks import listops

    splits = listops.task_splits(
        data_args.dataset_path,
        {"train": data_args.listops_train, "val": data_args.listops_val, "test": data_args.listops_test},
        seed=data_args.listops_seed,
        min_length=data_args.listops_min_length,
        max_length=data_args.listops_max_length,
        max_depth=data_args.listops_max_depth,
        max_args=data_args.listops_max_args,
        p_op=data_args.listops_p_op,
    )
    stats = {name: listops.split_stats(ex) for name, ex in splits.items()}
    logger.info(
        "listops data (%s): %s",
        data_args.dataset_path or f"generated, seed {data_args.listops_seed}",
        ", ".join(f"{k} {v['n']} (length {v.get('min_length')}-{v.get('max_length')})" for k, v in stats.items()),
    )
    datasets = {name: listops.ListOpsDataset(ex) for name, ex in splits.items()}
    during = datasets["val"]
    if data_args.max_eval_samples and len(during) > data_args.max_eval_samples:
        during = torch.utils.data.Subset(during, range(data_args.max_eval_samples))
    longest = max([s["max_length"] for s in stats.values() if s["n"]] + [data_args.listops_max_length])
    config = build_task_config(model_args, data_args, max_length=longest)
    set_seed(train_args.seed)  # model init independent of how much randomness data preparation used
    from transformers import AutoModelForSequenceClassification

    if model_args.model_name_or_path:
        model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        model = AutoModelForSequenceClassification.from_config(config)
    return model, datasets["train"], during, {"val": datasets["val"], "test": datasets["test"]}, stats


def main(argv: list[str] | None = None) -> dict:
    """Run a recipe; returns a summary (output folders, losses, timings) also written to ``train_summary.json``."""
    import modeling_bst  # noqa: F401  (registers model_type "bst")

    model_args, data_args, train_args = parse_args(argv)
    # Model settings are checked before anything is built (tokenizer, data, model).
    check_run(data_args, build_task_config(model_args, data_args))
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if train_args.process_index == 0 else logging.WARNING,
    )
    keep_large_allocations(model_args.cpu_allocation_threshold_mib, train_args.device.type)
    set_seed(train_args.seed)
    t0 = time.time()
    if data_args.task == "lm":
        tokenizer = build_tokenizer(model_args, data_args, train_args)
        train_ds, eval_ds = build_datasets(data_args, train_args, tokenizer)
        set_seed(train_args.seed)  # model init independent of how much randomness data preparation used
        model = build_model(model_args, tokenizer)
        final_evals = {"eval": eval_ds} if eval_ds is not None and len(eval_ds) else {}
        data_stats, auto_class = None, AutoModelForCausalLM
        task_kwargs = {"data_collator": D.collate_segments}
        n_train = len(train_ds) if hasattr(train_ds, "__len__") else "streamed"
        size = f"{n_train} training segments of {data_args.seq_len} tokens; tokenizer {len(tokenizer)} tokens"
    else:
        from transformers import AutoModelForSequenceClassification

        from training.tasks import listops

        tokenizer = None
        model, train_ds, eval_ds, final_evals, data_stats = build_listops(model_args, data_args, train_args)
        auto_class = AutoModelForSequenceClassification
        task_kwargs = {
            "data_collator": listops.PaddingCollator(),
            "compute_metrics": listops.compute_accuracy,
            "preprocess_logits_for_metrics": listops.argmax_logits,
        }
        size = f"{len(train_ds)} training examples"
    ssm_lr = model_args.ssm_lr if model_args.ssm_lr is not None else getattr(model.config, "ssm_lr", None)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "%s model %s: %.2fM parameters; %s",
        data_args.task,
        model_args.model_config or model_args.model_name_or_path or "(model_overrides)",
        n_params / 1e6,
        size,
    )
    train_args.remove_unused_columns = False
    if data_args.streaming:
        # Each process reads the same ordered stream; accelerate hands every process its own rows.
        train_args.accelerator_config.dispatch_batches = False
    trainer = BSTTrainer(
        model=model,
        args=train_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        ssm_lr=ssm_lr,
        ssm_weight_decay=model_args.ssm_weight_decay,
        stream_segments=data_args.stream_segments,
        **task_kwargs,
    )
    resume = train_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        # The newest checkpoint whose save completed (an interrupted save is skipped).
        resume = last_complete_checkpoint(train_args.output_dir)
        logger.info("resuming from %s", resume or "scratch (no complete checkpoint)")
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = dict(result.metrics)
    for prefix, dataset in final_evals.items():
        metrics.update(trainer.evaluate(dataset, metric_key_prefix=prefix))
    final_dir = os.path.join(train_args.output_dir, "final")
    # Trainer writes use_cache=False into the config while training; a saved model must cache at inference.
    trainer.model.config.use_cache = True
    sharding = trainer.sharding_report()
    if trainer.is_fsdp_enabled:
        # Checkpoints stay sharded; the final model is gathered (on every process) into one plain, loadable folder.
        state_dict = trainer.accelerator.get_state_dict(trainer.model)
        if trainer.args.should_save:
            plain = auto_class.from_config(trainer.model.config)
            plain.load_state_dict(state_dict)
            plain.save_pretrained(final_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(final_dir)
    else:
        trainer.save_model(final_dir)
    summary = {
        "task": data_args.task,
        "output_dir": train_args.output_dir,
        "final_model": final_dir,
        "parameters": n_params,
        "train_segments": len(train_ds) if hasattr(train_ds, "__len__") else None,
        "seq_len": data_args.seq_len if data_args.task == "lm" else None,
        # The corpus, for training.export's model card (listops records its data below).
        "dataset": data_args.dataset if data_args.task == "lm" else None,
        "dataset_path": data_args.dataset_path if data_args.task == "lm" else None,
        "world_size": train_args.world_size,
        "fsdp": trainer.is_fsdp_enabled,
        "sharding": sharding,
        "train_batch_size": train_args.per_device_train_batch_size * train_args.world_size,
        "steps": trainer.state.global_step,
        "wall_seconds": time.time() - t0,
        "metrics": metrics,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    if data_stats is not None:
        from training.tasks import listops

        summary["data"] = data_stats
        summary["data_source"] = data_args.dataset_path or f"generated (seed {data_args.listops_seed})"
        summary["baselines"] = listops.baselines(data_stats)
        logger.info(
            "val_accuracy %.4f, test_accuracy %.4f (chance %.2f, test majority class %.3f)",
            metrics.get("val_accuracy", float("nan")),
            metrics.get("test_accuracy", float("nan")),
            summary["baselines"]["chance_accuracy"],
            summary["baselines"].get("test_majority_accuracy", float("nan")),
        )
    if trainer.is_world_process_zero():
        with open(os.path.join(train_args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)
        with open(os.path.join(train_args.output_dir, "train_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        logger.info("final model%s: %s", " and tokenizer" if tokenizer is not None else "", final_dir)
    return summary


def _shutdown_distributed(finished: bool) -> None:
    """Tear the process group (if any) down while the interpreter is fully alive.

    Left to interpreter exit, gloo's worker threads can still hold work objects (and the tensors in them) that are
    destroyed after Python is gone, aborting a finished run with "terminate called without an active exception".
    A finished run first waits for every rank (rank 0 may still be writing the final model while the others are
    done), frees those objects, then destroys the groups on every rank together. A failed run skips the barrier: the
    other ranks may never reach it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if finished:
        torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    finished = False
    try:
        main()
        finished = True
    except D.DatasetUnavailableError as e:  # a one-paragraph message with the offline alternatives, no traceback
        raise SystemExit(f"training.train: {e}") from None
    finally:
        _shutdown_distributed(finished)
