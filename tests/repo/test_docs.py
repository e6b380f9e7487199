"""The documentation's relative links resolve: every link of README.md, docs/*.md and research/*.md (outside code
blocks) names a file or folder of the repository, and a ``#fragment`` names a heading of the target page (GitHub's
heading anchors). Every ```python block of docs/*.md parses."""

import ast
import re
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("research/*.md")])
CODE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``: lower case, punctuation dropped, spaces to hyphens, ``-1``,
    ``-2`` ... for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", CODE.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text()).replace("\n", " ")
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(target)
    assert not broken, broken


def test_the_user_guide_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    for page in REPO.glob("docs/*.md"):
        assert page.resolve() in linked, page.name


@pytest.mark.parametrize("page", sorted(REPO.glob("docs/*.md")), ids=lambda p: p.name)
def test_docs_python_blocks_parse(page):
    for block in re.findall(r"^```python[ \t]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        ast.parse(block)
