"""Documents, tokenizers and L-token segments for language-model training and evaluation.

The paper (Sec. 4) trains on PG19, arXiv math LaTeX and GitHub with sequences of L = 4096 tokens: every document is
tokenized and split into consecutive, ordered segments. Transformer-XL and the Block-Recurrent Transformer carry a
cache from one segment to the next, so they must see the segments of each document in order, in the same batch row,
with a start-of-document flag where a new document begins. This module provides:

* document loaders: :func:`load_documents` (PG19 / arXiv / GitHub by Hub id with streaming, or local files and
  folders, or the embedded books), all yielding rows with a ``text`` column;
* the GitHub directory-order builder (:func:`repository_document`, :func:`build_repository_documents`,
  :func:`group_rows_by_repository`): one document per repository, files concatenated depth-first in sorted order;
* tokenizers: :func:`load_tokenizer` (the shipped 32k SentencePiece-style tokenizer, a local folder or a Hub id) and
  :func:`train_bpe_tokenizer` (a byte-level BPE trained with ``tokenizers`` on any documents);
* packing: :func:`document_segments` cuts a tokenized document into ordered segments; :class:`SegmentDataset`
  (map-style) and :class:`StreamingSegmentDataset` (iterable, for Hub streaming) serve them as fixed-length rows
  with ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding) and ``doc_start``;
* :func:`stream_order`: the row order under which batch row ``r`` of every batch continues batch row ``r`` of the
  previous batch on the same process (for XL/BRecT streaming), for any per-device batch size and number of processes.
"""

from __future__ import annotations

import heapq
import itertools
import json
import lzma
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset


PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_DIR = PACKAGE_DIR / "data"
SHIPPED_TOKENIZERS_DIR = PACKAGE_DIR / "tokenizers"
DEFAULT_TOKENIZER = "mistral-v1-32k"

# The embedded corpus in the PG19 schema. Split as suggested in /work/shared/notes/data.md: five training books,
# one validation book, one test book (every book is > 100k tokens, so 65k-token evaluation has whole windows).
EMBEDDED_BOOKS = (
    # file stem, short_book_title, publication_date, Gutenberg id, split
    ("emma", "Emma", 1815, 158, "train"),
    ("mansfieldpark", "Mansfield Park", 1814, 141, "train"),
    ("prideprejudice", "Pride and Prejudice", 1813, 1342, "train"),
    ("sensesensibility", "Sense and Sensibility", 1811, 161, "train"),
    ("mobydick", "Moby Dick", 1851, 2701, "train"),
    ("northangerabbey", "Northanger Abbey", 1817, 121, "validation"),
    ("persuasion", "Persuasion", 1817, 105, "test"),
)
SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation"}

# Hub defaults (/work/shared/notes/data.md, section 5). Script-based ids (deepmind/pg19, proof-pile) no longer load
# with datasets >= 4, so the defaults are parquet/JSON repositories read through their files.
HUB_DEFAULTS = {
    "pg19": {"path": "emozilla/pg19"},
    "arxiv": {
        "path": "json",
        "data_files": "hf://datasets/EleutherAI/proof-pile-2/arxiv/{split}/*.jsonl.zst",
    },
    "github": {"path": "codeparrot/github-code", "revision": "refs/convert/parquet"},
}
DATASET_KINDS = ("embedded", "pg19", "arxiv", "github")
# The training.corpora flag and output folder of each kind's offline stand-in.
OFFLINE_CORPORA = {"pg19": ("--books", "books"), "arxiv": ("--latex", "arxiv"), "github": ("--code", "github")}

FILE_HEADER = "<|file|>"
SKIP_DIRS = frozenset({".git", "__pycache__", "node_modules", ".hg", ".svn", ".tox", ".venv", ".mypy_cache"})
MAX_FILE_BYTES = 1 << 20


def canonical_split(split: str) -> str:
    return SPLIT_ALIASES.get(split, split)


# --------------------------------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------------------------------
def pg19_features():
    """The PG19 schema on the Hub: ``short_book_title`` str, ``publication_date`` int32, ``url`` str, ``text`` str."""
    from datasets import Features, Value

    return Features(
        {
            "short_book_title": Value("string"),
            "publication_date": Value("int32"),
            "url": Value("string"),
            "text": Value("string"),
        }
    )


def embedded_books(split: str | None = None) -> list[dict]:
    """The embedded books of ``split`` ("train", "validation", "test"; None: all) as PG19 rows (``text`` decoded)."""
    split = canonical_split(split) if split is not None else None
    if split is not None and split not in {"train", "validation", "test"}:
        raise ValueError(f"unknown split {split!r} for the embedded corpus (train, validation, test)")
    rows = []
    for stem, title, year, ebook, book_split in EMBEDDED_BOOKS:
        if split is not None and book_split != split:
            continue
        with lzma.open(EMBEDDED_DIR / f"{stem}.txt.xz", "rt", encoding="utf-8") as f:
            text = f.read()
        rows.append(
            {
                "short_book_title": title,
                "publication_date": year,
                "url": f"http://www.gutenberg.org/ebooks/{ebook}",
                "text": text,
            }
        )
    return rows


def load_embedded(split: str):
    """The embedded books of ``split`` as a ``datasets.Dataset`` with the exact PG19 features."""
    from datasets import Dataset as HFDataset

    rows = embedded_books(split)
    return HFDataset.from_list(rows, features=pg19_features())


def _read_text(path: Path) -> str:
    if path.suffix == ".xz":
        with lzma.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8", errors="replace")


def _local_files(path: Path, suffixes: Sequence[str]) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and any(p.name.endswith(s) for s in suffixes))


def _load_local(kind: str, path: str, split: str, streaming: bool, text_column: str | None):
    """Local files or folders: parquet / json(l)(.gz|.zst) files through ``datasets``; plain-text, ``.tex`` or
    ``.txt.xz`` files as one document per file; for ``github``, a folder of repositories (one sub-folder each)
    becomes one directory-ordered document per repository."""
    from datasets import Dataset as HFDataset
    from datasets import load_dataset

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    # A folder holding split sub-folders or split-named files (train/validation/test) selects the split.
    if p.is_dir():
        for cand in (p / split, *sorted(p.glob(f"{split}.*")), *sorted(p.glob(f"{split}-*"))):
            if cand.exists():
                p = cand
                break
    table_suffixes = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst")
    tables = _local_files(p, table_suffixes)
    if tables:
        builder = "parquet" if tables[0].name.endswith(".parquet") else "json"
        ds = load_dataset(builder, data_files=[str(t) for t in tables], split="train", streaming=streaming)
        return normalise_rows(ds, kind, text_column)
    if kind == "github" and p.is_dir() and not any(f.is_file() for f in p.iterdir()):
        rows = list(build_repository_documents(p))
        return HFDataset.from_list(rows) if not streaming else HFDataset.from_list(rows).to_iterable_dataset()
    files = _local_files(p, (".txt", ".txt.xz", ".txt.gz", ".tex", ".tex.gz", ".md"))
    if not files:
        raise FileNotFoundError(f"no documents (parquet, json, jsonl, txt, tex) under {path}")
    rows = [{"title": f.name, "text": _read_text(f)} for f in files]
    ds = HFDataset.from_list(rows)
    return ds.to_iterable_dataset() if streaming else ds


def normalise_rows(ds, kind: str, text_column: str | None = None):
    """Give every row a ``text`` column: rename ``text_column`` if set; GitHub file rows (``code``/``content``,
    ``repo_name``, ``path``) are grouped into repository documents in directory order."""
    columns = set(ds.column_names or [])
    if text_column and text_column != "text":
        return ds.rename_column(text_column, "text")
    if kind == "github" and "text" not in columns and "repo_name" in columns and "path" in columns:
        code_col = "code" if "code" in columns else "content"
        return group_rows_by_repository(ds, code_column=code_col)
    if "text" not in columns and ds.column_names is not None:
        raise ValueError(f"no 'text' column in {sorted(columns)}; pass text_column")
    return ds


def load_documents(
    dataset: str = "embedded",
    split: str = "train",
    *,
    path: str | None = None,
    name: str | None = None,
    data_files: str | list[str] | None = None,
    revision: str | None = None,
    streaming: bool = False,
    text_column: str | None = None,
):
    """Documents of ``dataset`` ("embedded", "pg19", "arxiv", "github") for ``split``, each row with a ``text`` column.

    Resolution: ``dataset="embedded"`` reads the shipped books (PG19 schema). Otherwise a local ``path`` (file or
    folder) wins; else the Hub id ``path`` (or the kind's default in ``HUB_DEFAULTS``) is loaded with ``datasets``,
    streaming if asked. Schemas are the Hub's: PG19 rows keep ``short_book_title``/``publication_date``/``url``;
    arXiv rows are proof-pile-style ``{"text", "meta"}``; GitHub file rows are grouped into one document per
    repository in directory order. A Hub id that cannot be reached (offline mode with nothing cached, or no network)
    fails at once with :class:`DatasetUnavailableError` (a ``ConnectionError``) naming the offline alternatives.
    Returns a ``datasets.Dataset`` (or ``IterableDataset`` when ``streaming``).
    """
    from datasets import load_dataset

    split = canonical_split(split)
    if dataset == "embedded":
        ds = load_embedded(split)
        return ds.to_iterable_dataset() if streaming else ds
    if dataset not in DATASET_KINDS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASET_KINDS}")
    if path is not None and os.path.exists(path):
        return _load_local(dataset, path, split, streaming, text_column)
    spec = dict(HUB_DEFAULTS[dataset])
    if path is not None:
        spec = {"path": path}
    if data_files is not None:
        spec["data_files"] = data_files
    if revision is not None:
        spec["revision"] = revision
    if isinstance(spec.get("data_files"), str):
        spec["data_files"] = spec["data_files"].format(split=split)
    hub_split = split
    if "data_files" in spec:
        hub_split = "train"  # a data_files pattern already selects the split; datasets names it "train"
    hub_id = spec.pop("path")
    described = hub_id if "data_files" not in spec else f"{hub_id} files {spec['data_files']}"
    _check_hub_reachable(dataset, described, path)
    try:
        ds = load_dataset(hub_id, name, split=hub_split, streaming=streaming, **spec)
    except ConnectionError:  # offline mode and not in the datasets cache (datasets raises ConnectionError)
        reason = "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and the datasets cache does not hold it"
        raise DatasetUnavailableError(_unavailable_message(dataset, described, path, reason)) from None
    return normalise_rows(ds, dataset, text_column)


class DatasetUnavailableError(ConnectionError):
    """A Hub dataset that cannot be reached (offline mode, no network); the message lists the offline
    alternatives."""


def _unavailable_message(dataset: str, described: str, path: str | None, reason: str) -> str:
    flag, folder = OFFLINE_CORPORA[dataset]
    missing = f" (--dataset_path {path!r} is not a local file or folder)" if path is not None else ""
    return (
        f"dataset {dataset!r} is on the Hugging Face Hub ({described}){missing} and cannot be reached: {reason}. "
        f"Offline alternatives: local files, --dataset_path DIR (a folder with train/ and validation/ sub-folders or "
        f"train.jsonl/validation.jsonl files: parquet, json(l), txt or tex; or one file); a stand-in corpus built "
        f"without the Hub, `python -m training.corpora --out corpora/ {flag}`, then --dataset_path corpora/{folder}; "
        f"or --dataset embedded (the books shipped in training/data)."
    )


def _check_hub_reachable(dataset: str, described: str, path: str | None, timeout: float = 5.0) -> None:
    """Fail at once, with the offline alternatives, when the Hub cannot be reached: ``datasets`` would otherwise
    retry five times with back-off (about 30 s) and end in a long traceback.

    Offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) is left to ``datasets``, which may find the dataset in
    its cache; otherwise one TCP connection to the Hub endpoint (``HF_ENDPOINT``, or the HTTPS proxy when one is set)
    must open within ``timeout`` seconds."""
    import socket
    import urllib.parse
    import urllib.request

    import datasets.config
    from huggingface_hub import constants

    if datasets.config.HF_HUB_OFFLINE or constants.HF_HUB_OFFLINE:
        return
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        reason = f"no connection to {url.hostname}:{port} ({e.strerror or e})"
        raise DatasetUnavailableError(_unavailable_message(dataset, described, path, reason)) from None


# --------------------------------------------------------------------------------------------------------------------
# GitHub: one document per repository, files in directory order
# --------------------------------------------------------------------------------------------------------------------
def directory_order(root: str | os.PathLike) -> list[Path]:
    """Files under ``root`` in directory order: depth first, a directory's files (sorted by name) before its
    sub-directories (sorted by name). Skips symlinks and ``SKIP_DIRS``."""
    root = Path(root)
    out: list[Path] = []

    def visit(d: Path):
        try:
            entries = sorted(d.iterdir(), key=lambda e: e.name)
        except OSError:
            return
        files = [e for e in entries if e.is_file() and not e.is_symlink()]
        dirs = [e for e in entries if e.is_dir() and not e.is_symlink() and e.name not in SKIP_DIRS]
        out.extend(files)
        for sub in dirs:
            visit(sub)

    visit(root)
    return out


def _is_text(data: bytes) -> bool:
    return b"\x00" not in data[:8192]


def repository_document(
    root: str | os.PathLike,
    repo_name: str | None = None,
    suffixes: Sequence[str] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> dict:
    """One GitHub-style document for the repository at ``root``: every text file in :func:`directory_order`, each
    preceded by a header line ``<|file|> repo_name/relative/path``. Binary files (a NUL byte), files over
    ``max_file_bytes`` and files whose name does not end with one of ``suffixes`` (when given) are skipped.
    Returns ``{"repo_name", "text", "n_files"}`` (the field style of ``codeparrot/github-code``)."""
    root = Path(root)
    repo_name = repo_name or root.name
    parts, n_files = [], 0
    for f in directory_order(root):
        if suffixes is not None and not f.name.endswith(tuple(suffixes)):
            continue
        try:
            if f.stat().st_size > max_file_bytes:
                continue
            data = f.read_bytes()
        except OSError:
            continue
        if not _is_text(data):
            continue
        rel = f.relative_to(root).as_posix()
        parts.append(f"{FILE_HEADER} {repo_name}/{rel}\n{data.decode('utf-8', errors='replace')}")
        n_files += 1
    text = "\n".join(parts)
    return {"repo_name": repo_name, "text": text, "n_files": n_files}


def build_repository_documents(parent: str | os.PathLike, suffixes: Sequence[str] | None = None) -> Iterator[dict]:
    """One :func:`repository_document` per sub-folder of ``parent`` (sorted), skipping repositories with no files."""
    for d in sorted(Path(parent).iterdir(), key=lambda e: e.name):
        if d.is_dir() and not d.is_symlink() and d.name not in SKIP_DIRS:
            doc = repository_document(d, d.name, suffixes=suffixes)
            if doc["n_files"]:
                yield doc


def _path_key(path: str) -> tuple:
    """Sort key reproducing :func:`directory_order` on relative paths: in each directory, files before sub-folders,
    each group by name."""
    parts = path.split("/")
    return tuple((1, p) for p in parts[:-1]) + ((0, parts[-1]),)


def join_repository_files(repo_name: str, files: Iterable[tuple[str, str]]) -> dict:
    """A repository document from ``(path, code)`` pairs, sorted into directory order (same text as
    :func:`repository_document` gives for the same files on disk)."""
    files = sorted(files, key=lambda pc: _path_key(pc[0]))
    text = "\n".join(f"{FILE_HEADER} {repo_name}/{path}\n{code}" for path, code in files)
    return {"repo_name": repo_name, "text": text, "n_files": len(files)}


def group_rows_by_repository(ds, code_column: str = "code"):
    """GitHub file rows (``repo_name``, ``path``, ``code_column``) -> one document per repository.

    For a ``datasets.Dataset`` all rows of a repository are grouped wherever they are; for a streaming
    ``IterableDataset`` consecutive rows of the same repository are grouped (Hub dumps list a repository's files
    together), so memory stays bounded by one repository."""
    from datasets import Dataset as HFDataset
    from datasets import IterableDataset as HFIterable

    if isinstance(ds, HFIterable):

        def gen():
            for repo, rows in itertools.groupby(ds, key=lambda r: r["repo_name"]):
                yield join_repository_files(repo, ((r["path"], r[code_column]) for r in rows))

        return HFIterable.from_generator(gen)
    groups: dict[str, list[tuple[str, str]]] = {}
    for repo, path, code in zip(ds["repo_name"], ds["path"], ds[code_column]):
        groups.setdefault(repo, []).append((path, code))
    return HFDataset.from_list([join_repository_files(repo, groups[repo]) for repo in sorted(groups)])


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------------------
def load_tokenizer(name_or_path: str = DEFAULT_TOKENIZER, trust_remote_code: bool = False):
    """A fast tokenizer: a shipped one by name (``training/tokenizers/<name>``: ``mistral-v1-32k``, the 32,000-piece
    SentencePiece BPE with byte fallback, Apache-2.0), else a local folder or Hub id via ``AutoTokenizer``.
    A missing pad token is set to the EOS token (padding is masked out of the loss and attention anyway).

    ``trust_remote_code`` is False unless asked for: a model folder written by this package carries its modeling code
    and an ``auto_map``, and without an explicit answer ``AutoTokenizer`` stops to ask whether to run that code
    (in a terminal it waits for the answer) although the tokenizer itself needs none."""
    from transformers import AutoTokenizer

    shipped = SHIPPED_TOKENIZERS_DIR / name_or_path
    path = str(shipped) if shipped.is_dir() else name_or_path
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return add_bos_when_encoding(tok)


def add_bos_when_encoding(tok):
    """Make ``tok(text)`` start with BOS, as every training document does ([`encode_document`]), so that a saved
    tokenizer prompts the model (``pipeline``, ``generate`` from a user's ``tok(prompt)``) the way it was trained. Only
    a fast tokenizer that has a BOS token and does not add it already is changed (its post-processor: BOS before each
    sequence, nothing after: a prompt is continued, not ended)."""
    bos = tok.bos_token
    backend = getattr(tok, "backend_tokenizer", None)
    if bos is None or backend is None:
        return tok
    ids = tok("a")["input_ids"]
    if ids and ids[0] == tok.bos_token_id:
        return tok
    from tokenizers import processors

    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.bos_token_id)]
    )
    return tok


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE (``tokenizers``; lossless, any UTF-8) with ``<s>``, ``</s>``, ``<pad>``, ``<unk>``
    (ids 0-3) on ``texts``; returns a ``PreTrainedTokenizerFast`` that ``save_pretrained``/``AutoTokenizer``
    round-trip. Texts are fed in 64 KB pieces so that book-length documents train in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def pieces():
        for text in texts:
            for i in range(0, len(text), 1 << 16):
                yield text[i : i + (1 << 16)]

    tok.train_from_iterator(pieces(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    return add_bos_when_encoding(fast)


def encode_document(tokenizer, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
    """``[bos] + tokens(text) + [eos]``: the document's token ids. Long texts are encoded in one call (fast
    tokenizers handle megabytes); BOS marks the document start, EOS its end."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if add_eos and tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return ids


# --------------------------------------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Segment:
    """Tokens ``ids`` (at most L) of document ``doc`` starting at token ``start``; ``doc_start`` iff ``start == 0``."""

    doc: int
    index: int
    start: int
    ids: list[int]

    @property
    def doc_start(self) -> bool:
        return self.start == 0


def document_segments(ids: Sequence[int], seq_len: int, doc: int = 0, min_len: int = 2) -> list[Segment]:
    """Cut a tokenized document into consecutive segments of ``seq_len`` tokens (the last may be shorter).

    Concatenating the segments gives ``ids`` back exactly: no token is lost or duplicated. A document shorter than
    ``min_len`` tokens (no next-token target at all) gives no segment."""
    if seq_len < 1:
        raise ValueError("seq_len must be positive")
    if len(ids) < min_len:
        return []
    return [Segment(doc, i, s, list(ids[s : s + seq_len])) for i, s in enumerate(range(0, len(ids), seq_len))]


def stream_order(stream_lengths: Sequence[int], per_device_batch: int, num_processes: int = 1) -> list[tuple]:
    """Global row order for streaming: a list of ``(stream, step)`` so that, after the Trainer/accelerate split
    (batches of ``per_device_batch`` consecutive rows; batch ``k`` goes to process ``k % num_processes``), row ``r``
    of process ``p``'s ``t``-th batch is step ``t`` of stream ``p * per_device_batch + r``.

    ``len(stream_lengths)`` must equal ``per_device_batch * num_processes``; every stream contributes its first
    ``min(stream_lengths)`` steps (the tails beyond the shortest stream are dropped)."""
    num_streams = per_device_batch * num_processes
    if len(stream_lengths) != num_streams:
        raise ValueError(f"need {num_streams} streams, got {len(stream_lengths)}")
    steps = min(stream_lengths) if stream_lengths else 0
    # Global batch k = t * P + p holds streams p*B .. p*B+B-1 at step t, i.e. all streams in order for each step.
    return [(s, t) for t in range(steps) for s in range(num_streams)]


def assign_streams(doc_lengths: Sequence[int], num_streams: int) -> list[list[int]]:
    """Documents (by index, in their order) dealt to ``num_streams`` streams, each next document to the stream with
    the fewest segments so far (ties: lowest stream), so that the streams end at nearly the same step."""
    heap = [(0, s) for s in range(num_streams)]
    streams: list[list[int]] = [[] for _ in range(num_streams)]
    for d, n in enumerate(doc_lengths):
        total, s = heapq.heappop(heap)
        streams[s].append(d)
        heapq.heappush(heap, (total + n, s))
    return streams


def pad_segment(seg: Segment, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A fixed-length training row: ``input_ids`` padded with ``pad_id`` on the right, ``attention_mask`` 1 on real
    tokens, ``labels`` = ids with -100 on padding, ``doc_start`` (bool)."""
    n = len(seg.ids)
    ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    ids[:n] = torch.tensor(seg.ids, dtype=torch.long)
    mask = torch.zeros(seq_len, dtype=torch.long)
    mask[:n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "doc_start": torch.tensor(seg.doc_start)}


def tokenize_documents(tokenizer, texts: Iterable[str], max_docs: int | None = None) -> list[list[int]]:
    return [encode_document(tokenizer, t) for t in itertools.islice(texts, max_docs)]


class SegmentDataset(Dataset):
    """Map-style dataset of the L-token segments of tokenized documents.

    ``order="document"`` lists each document's segments in order, documents one after another (shuffle it with the
    Trainer's sampler for BST/Slide training, which needs no state across segments). ``order="stream"`` arranges
    rows with :func:`stream_order` for ``per_device_batch`` x ``num_processes`` streams, to be read sequentially
    (XL/BRecT: each batch row continues the previous batch's row, ``doc_start`` marks resets). ``max_segments``
    keeps only the first rows (e.g. a quick validation subset)."""

    def __init__(
        self,
        docs: Sequence[Sequence[int]],
        seq_len: int,
        pad_id: int,
        order: str = "document",
        per_device_batch: int = 1,
        num_processes: int = 1,
        max_segments: int | None = None,
    ):
        self.seq_len, self.pad_id, self.order = seq_len, pad_id, order
        per_doc = [document_segments(ids, seq_len, doc=d) for d, ids in enumerate(docs)]
        if order == "document":
            self.segments = [s for segs in per_doc for s in segs]
        elif order == "stream":
            streams = assign_streams([len(s) for s in per_doc], per_device_batch * num_processes)
            flat = [[seg for d in docs_ for seg in per_doc[d]] for docs_ in streams]
            order_ = stream_order([len(f) for f in flat], per_device_batch, num_processes)
            self.segments = [flat[s][t] for s, t in order_]
        else:
            raise ValueError(f"order must be 'document' or 'stream', not {order!r}")
        if max_segments is not None:
            self.segments = self.segments[:max_segments]

    def __len__(self):
        return len(self.segments)

    def __getitem__(self, i):
        return pad_segment(self.segments[i], self.seq_len, self.pad_id)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


class StreamingSegmentDataset(IterableDataset):
    """Iterable segments of documents read lazily (Hub streaming): documents are tokenized as they arrive.

    ``order="document"``: segments in document order through a seeded shuffle buffer of ``shuffle_buffer`` rows
    (0: no shuffle). ``order="stream"``: ``per_device_batch * num_processes`` streams are filled with the next
    document whenever one ends, and rows come out in :func:`stream_order`'s layout (each step, all streams); it ends
    when the documents run out for a stream. Each process reads the whole stream; accelerate keeps its own rows."""

    def __init__(
        self,
        texts: Callable[[], Iterable[str]],
        tokenizer,
        seq_len: int,
        order: str = "document",
        per_device_batch: int = 1,
        num_processes: int = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
        max_docs: int | None = None,
    ):
        self.texts, self.tokenizer, self.seq_len, self.order = texts, tokenizer, seq_len, order
        self.num_streams = per_device_batch * num_processes
        self.shuffle_buffer, self.seed, self.max_docs = shuffle_buffer, seed, max_docs
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def _segments(self) -> Iterator[Segment]:
        for d, text in enumerate(itertools.islice(self.texts(), self.max_docs)):
            yield from document_segments(encode_document(self.tokenizer, text), self.seq_len, doc=d)

    def _rows(self) -> Iterator[Segment]:
        if self.order == "document":
            if self.shuffle_buffer <= 1:
                yield from self._segments()
                return
            rng = torch.Generator().manual_seed(self.seed + self.epoch)
            buf: list[Segment] = []
            for seg in self._segments():
                buf.append(seg)
                if len(buf) >= self.shuffle_buffer:
                    j = int(torch.randint(len(buf), (1,), generator=rng))
                    buf[j], buf[-1] = buf[-1], buf[j]
                    yield buf.pop()
            while buf:
                j = int(torch.randint(len(buf), (1,), generator=rng))
                buf[j], buf[-1] = buf[-1], buf[j]
                yield buf.pop()
            return
        docs = iter(self.texts()) if self.max_docs is None else itertools.islice(self.texts(), self.max_docs)
        counter = itertools.count()
        queues: list[Iterator[Segment]] = [iter(()) for _ in range(self.num_streams)]

        def next_doc():
            for text in docs:
                segs = document_segments(encode_document(self.tokenizer, text), self.seq_len, doc=next(counter))
                if segs:
                    return iter(segs)
            return None

        while True:
            step = []
            for s in range(self.num_streams):
                seg = next(queues[s], None)
                if seg is None:
                    q = next_doc()
                    if q is None:
                        return
                    queues[s] = q
                    seg = next(q)
                step.append(seg)
            yield from step

    def __iter__(self):
        pad_id = self.tokenizer.pad_token_id
        for seg in self._rows():
            yield pad_segment(seg, self.seq_len, pad_id)


def collate_segments(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Stack rows of :func:`pad_segment` into a batch."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def texts_of(ds) -> Iterator[str]:
    """The ``text`` column of a (streaming or not) ``datasets`` dataset, row by row."""
    for row in ds:
        yield row["text"]


def save_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> int:
    """Write rows as JSON lines (``.gz`` suffix: gzip); returns the number of rows."""
    import gzip

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
