"""Data pipeline: loaders, GitHub directory-order builder, tokenizers, segment packing and streaming order."""

import json
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, SequentialSampler

from training import data as D


os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


# ---------------------------------------------------------------------------------------------------- segments
@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), seq_len=st.integers(1, 64))
def test_document_segments_lose_and_duplicate_nothing(n, seq_len):
    ids = list(range(1000, 1000 + n))
    segs = D.document_segments(ids, seq_len, doc=3)
    if n < 2:
        assert segs == []
        return
    assert [t for s in segs for t in s.ids] == ids
    assert all(len(s.ids) == seq_len for s in segs[:-1]) and 1 <= len(segs[-1].ids) <= seq_len
    assert [s.index for s in segs] == list(range(len(segs)))
    assert [s.doc_start for s in segs] == [True] + [False] * (len(segs) - 1)
    assert all(s.doc == 3 for s in segs)


def _random_docs(seed, n_docs=9, max_len=200):
    rng = random.Random(seed)
    # Distinct token values per document so that any misplacement is visible.
    return [[d * 10000 + i for i in range(rng.randint(2, max_len))] for d in range(n_docs)]


def _rows_to_docs(rows):
    """Rebuild documents from padded rows of one ordered stream: doc_start opens a new document."""
    docs = []
    for r in rows:
        ids = r["input_ids"][r["attention_mask"].bool()].tolist()
        if r["doc_start"]:
            docs.append([])
        docs[-1].extend(ids)
    return docs


def test_segment_dataset_document_order_roundtrip():
    docs = _random_docs(0)
    ds = D.SegmentDataset(docs, seq_len=16, pad_id=-1)
    rows = [ds[i] for i in range(len(ds))]
    assert _rows_to_docs(rows) == docs
    assert ds.num_tokens == sum(map(len, docs))
    for r in rows:
        assert r["input_ids"].shape == (16,)
        pad = r["attention_mask"] == 0
        assert (r["labels"][pad] == -100).all() and (r["labels"][~pad] == r["input_ids"][~pad]).all()
        assert (r["input_ids"][pad] == -1).all()
        # padding only at the end
        n = int(r["attention_mask"].sum())
        assert r["attention_mask"][:n].all()
    batch = D.collate_segments(rows[:3])
    assert batch["input_ids"].shape == (3, 16) and batch["doc_start"].dtype == torch.bool


def _process_batches(n_rows, per_device_batch, num_processes, process_index):
    """The row indices each batch of ``process_index`` gets under accelerate's batch sharding (the Trainer's DDP
    data path for map-style datasets with a sequential sampler)."""
    from accelerate.data_loader import BatchSamplerShard

    sampler = BatchSampler(SequentialSampler(range(n_rows)), per_device_batch, drop_last=False)
    shard = BatchSamplerShard(
        sampler, num_processes=num_processes, process_index=process_index, split_batches=False, even_batches=False
    )
    return list(shard)


@pytest.mark.parametrize("per_device_batch,num_processes", [(1, 1), (3, 1), (2, 2), (2, 3)])
def test_stream_order_gives_each_batch_row_its_documents_in_order(per_device_batch, num_processes):
    docs = _random_docs(1, n_docs=17, max_len=120)
    seq_len = 10
    ds = D.SegmentDataset(
        docs, seq_len, pad_id=0, order="stream", per_device_batch=per_device_batch, num_processes=num_processes
    )
    seen = []
    for p in range(num_processes):
        batches = _process_batches(len(ds), per_device_batch, num_processes, p)
        assert all(len(b) == per_device_batch for b in batches)
        for r in range(per_device_batch):
            rows = [ds[b[r]] for b in batches]
            assert rows[0]["doc_start"], "every stream starts with a document start"
            rebuilt = _rows_to_docs(rows)
            for k, doc in enumerate(rebuilt):
                d = doc[0] // 10000
                # each document's tokens in order; only the stream's last document may be cut short
                if k < len(rebuilt) - 1:
                    assert doc == docs[d]
                else:
                    assert doc == docs[d][: len(doc)]
                seen.append(d)
    assert len(seen) == len(set(seen)), "a document appeared in two streams"
    # balanced dealing: the dropped tails are at most one long document per stream
    total = sum(map(len, docs))
    longest = max(map(len, docs))
    assert ds.num_tokens >= total - per_device_batch * num_processes * (longest + seq_len)


def test_stream_order_layout():
    order = D.stream_order([3, 5, 4, 3], per_device_batch=2, num_processes=2)
    assert order[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)] and order[4:8] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert len(order) == 12
    with pytest.raises(ValueError):
        D.stream_order([1, 2, 3], per_device_batch=2, num_processes=2)


class _CharTokenizer:
    """Minimal tokenizer: one id per character, bos 1, eos 2, pad 0."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 200 for c in text]}


def test_streaming_segment_dataset_stream_order_and_shuffle():
    texts = ["".join(chr(97 + (d + i) % 26) for i in range(n)) for d, n in enumerate([35, 7, 50, 22, 13, 41])]
    tok = _CharTokenizer()
    full = [D.encode_document(tok, t) for t in texts]
    it = D.StreamingSegmentDataset(lambda: iter(texts), tok, seq_len=8, order="stream", per_device_batch=2)
    rows = list(it)
    for r in range(2):
        rebuilt = _rows_to_docs(rows[r::2])
        for doc in rebuilt[:-1]:
            assert doc in full
    plain = list(D.StreamingSegmentDataset(lambda: iter(texts), tok, seq_len=8))
    shuffled = list(D.StreamingSegmentDataset(lambda: iter(texts), tok, seq_len=8, shuffle_buffer=5, seed=1))
    key = [tuple(r["input_ids"].tolist()) for r in plain]
    assert sorted(key) == sorted(tuple(r["input_ids"].tolist()) for r in shuffled) and len(key) == len(shuffled)
    assert _rows_to_docs(plain) == full


# ---------------------------------------------------------------------------------------------------- GitHub
def _make_repo(root):
    files = {
        "setup.py": "print('setup')\n",
        "README.md": "# demo\n",
        "pkg/__init__.py": "",
        "pkg/b.py": "B = 2\n",
        "pkg/a.py": "A = 1\n",
        "pkg/sub/z.py": "Z = 26\n",
        "aaa/first.txt": "in a folder named before the files\n",
        "pkg/__pycache__/a.cpython-311.pyc": "cached",
        ".git/config": "[core]\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "logo.png").write_bytes(b"\x89PNG\x00\x01binary")
    (root / "big.txt").write_text("x" * (D.MAX_FILE_BYTES + 1))
    os.symlink(root / "setup.py", root / "link.py")
    return files


def test_repository_document_directory_order(tmp_path):
    repo = tmp_path / "demo"
    files = _make_repo(repo)
    doc = D.repository_document(repo)
    headers = [line.split(" ", 1)[1] for line in doc["text"].split("\n") if line.startswith(D.FILE_HEADER)]
    # files of a directory (sorted) before its sub-directories (sorted), depth first
    assert headers == [
        "demo/README.md",
        "demo/setup.py",
        "demo/aaa/first.txt",
        "demo/pkg/__init__.py",
        "demo/pkg/a.py",
        "demo/pkg/b.py",
        "demo/pkg/sub/z.py",
    ]
    assert doc["n_files"] == 7 and doc["repo_name"] == "demo"
    assert f"{D.FILE_HEADER} demo/pkg/a.py\n{files['pkg/a.py']}" in doc["text"]
    assert "binary" not in doc["text"] and "cached" not in doc["text"] and "[core]" not in doc["text"]
    # The same document from Hub-style file rows (any row order) as from the folder.
    rows = [(h.split("/", 1)[1], (repo / h.split("/", 1)[1]).read_text()) for h in headers]
    random.Random(0).shuffle(rows)
    assert D.join_repository_files("demo", rows) == doc


def test_group_rows_by_repository_and_local_github_loaders(tmp_path):
    from datasets import Dataset

    rows = [
        {"repo_name": "r2", "path": "src/x.py", "code": "x", "language": "Python", "license": "mit", "size": 1},
        {"repo_name": "r1", "path": "b.py", "code": "b", "language": "Python", "license": "mit", "size": 1},
        {"repo_name": "r2", "path": "a.py", "code": "a", "language": "Python", "license": "mit", "size": 1},
        {"repo_name": "r1", "path": "a/c.py", "code": "c", "language": "Python", "license": "mit", "size": 1},
    ]
    grouped = D.group_rows_by_repository(Dataset.from_list(rows))
    assert grouped["repo_name"] == ["r1", "r2"]
    assert grouped[0]["text"] == f"{D.FILE_HEADER} r1/b.py\nb\n{D.FILE_HEADER} r1/a/c.py\nc"
    assert grouped[1]["text"] == f"{D.FILE_HEADER} r2/a.py\na\n{D.FILE_HEADER} r2/src/x.py\nx"
    # as a local JSONL file through load_documents
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = D.load_documents("github", "train", path=str(path))
    assert docs["text"] == grouped["text"]
    # streaming groups consecutive rows of a repository
    sorted_rows = sorted(rows, key=lambda r: r["repo_name"])
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted_rows))
    streamed = list(D.load_documents("github", "train", path=str(tmp_path / "s.jsonl"), streaming=True))
    assert [d["text"] for d in streamed] == grouped["text"]
    # a folder of repository folders
    repos = tmp_path / "repos"
    _make_repo(repos / "demo")
    (repos / "other").mkdir()
    (repos / "other" / "m.py").write_text("M = 1\n")
    docs = D.load_documents("github", "train", path=str(repos))
    assert docs["repo_name"] == ["demo", "other"] and docs[1]["text"] == f"{D.FILE_HEADER} other/m.py\nM = 1\n"


# ---------------------------------------------------------------------------------------------------- loaders
def test_embedded_corpus_has_pg19_schema_and_splits():
    ds = D.load_documents("embedded", "validation")
    assert dict(ds.features) == dict(D.pg19_features())
    assert ds[0]["short_book_title"] == "Northanger Abbey" and ds[0]["publication_date"] == 1817
    assert ds[0]["url"].startswith("http://www.gutenberg.org/ebooks/")
    assert len(ds[0]["text"]) > 400_000
    assert [r["short_book_title"] for r in D.embedded_books("test")] == ["Persuasion"]
    assert len(D.embedded_books("train")) == 5
    assert (D.EMBEDDED_DIR / "NOTICE").exists()
    with pytest.raises(ValueError):
        D.embedded_books("nope")


def test_local_text_json_and_parquet_loaders(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.tex").write_text("\\begin{theorem} A \\end{theorem}")
    (tmp_path / "train" / "b.tex").write_text("\\begin{proof} B \\end{proof}")
    docs = D.load_documents("arxiv", "train", path=str(tmp_path))
    assert sorted(docs["text"]) == ["\\begin{proof} B \\end{proof}", "\\begin{theorem} A \\end{theorem}"]
    rows = [{"text": "x = y", "meta": json.dumps({"set_name": "arxiv"})}, {"text": "z", "meta": "{}"}]
    D.save_jsonl(rows, tmp_path / "arxiv.jsonl.gz")
    docs = D.load_documents("arxiv", "train", path=str(tmp_path / "arxiv.jsonl.gz"))
    assert docs["text"] == ["x = y", "z"] and "meta" in docs.column_names
    pg = D.load_embedded("test")
    pg.to_parquet(str(tmp_path / "pg.parquet"))
    docs = D.load_documents("pg19", "test", path=str(tmp_path / "pg.parquet"), streaming=True)
    row = next(iter(docs))
    assert row["short_book_title"] == "Persuasion"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(FileNotFoundError):
        D.load_documents("pg19", "train", path=str(tmp_path / "empty"))
    with pytest.raises(ValueError):
        D.load_documents("wiki", "train")


def test_hub_ids_fail_fast_offline():
    with pytest.raises(Exception) as err:
        D.load_documents("pg19", "validation", streaming=True)
    assert "offline" in str(err.value).lower() or "connection" in type(err.value).__name__.lower()


# ---------------------------------------------------------------------------------------------------- tokenizers
def test_trained_bpe_roundtrips_and_saves(tmp_path):
    from transformers import AutoTokenizer

    texts = [r["text"][:60_000] for r in D.embedded_books("train")]
    tok = D.train_bpe_tokenizer(texts, vocab_size=600)
    assert len(tok) == 600
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    sample = "Emma Woodhouse, handsome — 東京\n\tcode = {x: 1}"
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == sample
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(sample, add_special_tokens=False)["input_ids"] == ids
    doc = D.encode_document(again, "abc")
    assert doc[0] == again.bos_token_id and doc[-1] == again.eos_token_id


def test_shipped_32k_tokenizer():
    tok = D.load_tokenizer()
    assert len(tok) == 32000 and tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.pad_token_id is not None
    text = D.embedded_books("test")[0]["text"][:5000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert 3.0 < len(text.encode()) / len(ids) < 5.0
    assert (D.SHIPPED_TOKENIZERS_DIR / D.DEFAULT_TOKENIZER / "NOTICE").exists()


def test_the_tokenizer_of_a_model_folder_loads_without_asking_to_run_its_code(tmp_path):
    """A model folder carries modeling code and an ``auto_map``; loading its tokenizer must not stop to ask whether to
    run that code (in a terminal it waits for an answer), as AutoTokenizer does when trust_remote_code is not given."""
    import subprocess
    import sys

    tok = D.train_bpe_tokenizer(["a tokenizer for a model folder " * 50], vocab_size=280)
    tok.save_pretrained(tmp_path)
    config = {"model_type": "bst", "auto_map": {"AutoConfig": "configuration_bst.BSTConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_bst.py").write_text("raise SystemExit('the folder code ran')\n")
    script = f"from training import data as D; print(len(D.load_tokenizer({str(tmp_path)!r})))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=D.Path(D.__file__).resolve().parents[1], capture_output=True,
        text=True, timeout=120, input="", env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(len(tok))
    assert "Do you wish to run the custom code" not in out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------------- corpora
def test_corpora_assembler_books_and_code_offline(tmp_path):
    import sysconfig

    from training import corpora

    stdlib = sysconfig.get_paths()["stdlib"]
    # A small package root: three stdlib packages and one module, copied so the test is quick and stable.
    import shutil

    root = tmp_path / "lib"
    root.mkdir()
    for pkg in ("json", "email", "urllib"):
        shutil.copytree(f"{stdlib}/{pkg}", root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(f"{stdlib}/this.py", root / "this.py")
    out = tmp_path / "corpora"
    summary = corpora.main(
        ["--out", str(out), "--books", "--code", "--no_download", "--code_root", str(root), "--max_doc_mb", "0.2"]
    )
    assert summary["books"] == {"train": 5, "validation": 1, "test": 1}
    books = D.load_documents("pg19", "validation", path=str(out / "books"))
    assert books[0]["short_book_title"] == "Northanger Abbey"
    docs = []
    for split in ("train", "validation", "test"):
        if summary["github"][split]:
            docs += list(D.load_documents("github", split, path=str(out / "github")))
    names = sorted(d["repo_name"] for d in docs)
    assert "lib/misc" in names and any(n.startswith("lib/email#part") for n in names)  # email > 0.2 MB: split
    json_doc = next(d for d in docs if d["repo_name"] == "lib/json")
    assert json_doc["text"] == D.repository_document(root / "json", "lib/json", suffixes=(".py",))["text"]
    # split parts reassemble into the whole repository document, in order
    parts = sorted(
        (d for d in docs if d["repo_name"].startswith("lib/email#part")),
        key=lambda d: int(d["repo_name"].split("part")[1]),
    )
    whole = D.repository_document(root / "email", "lib/email", suffixes=(".py",))["text"]
    assert "".join(p["text"] for p in parts) == whole
    assert all(len(p["text"].encode()) <= 0.2 * 2**20 or p["n_files"] == 1 for p in parts)


def test_latex_filter_and_gutenberg_splitter(tmp_path):
    from training import corpora

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "paper.tex").write_text("\\begin{theorem}x\\end{theorem}\n" + "%" * 6000)
    (tmp_path / "a" / "short.tex").write_text("\\begin{proof}x\\end{proof}")
    (tmp_path / "a" / "manual.tex").write_text("plain text " * 1000)
    rows = list(corpora.latex_rows([tmp_path]))
    assert [json.loads(r["meta"])["file"] for r in rows] == ["a/paper.tex"]
    body = "word " * 20_000
    text = (
        f"*** START OF THIS PROJECT GUTENBERG EBOOK FIRST BOOK ***\n{body}\n*** END OF THIS PROJECT GUTENBERG EBOOK\n"
        f"junk\n*** START OF THE PROJECT GUTENBERG EBOOK SECOND ***\n{body}x\n"
    )
    books = corpora.split_gutenberg_books(text)
    assert [t for t, _ in books] == ["First Book", "Second"] and books[0][1] == body.strip()
    assert corpora.split_of("abc") == corpora.split_of("abc") in ("train", "validation", "test")
