"""The documentation reads as one: the layout it shows is the package's, each chapter leads to
the next, and the transforms' table lists every transform."""

from __future__ import annotations

import re
from pathlib import Path

import accelfn as af
from accelfn.step import TransformBase

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHAPTERS = sorted(DOCS.glob("[0-9][0-9]-*.md"))
#: the package's own files, not concepts
OWN = {"__init__.py", "__main__.py", "__pycache__", "py.typed", "_version.py"}


def test_the_layout_in_the_concepts_chapter_is_the_package() -> None:
    """Every folder and module docs/01's tree names exists in accelfn/, and every top-level
    entry of accelfn/ is in the tree."""
    text = (DOCS / "01-concepts.md").read_text()
    tree = re.search(r"## Where each concept lives.*?```text\n(.*?)```", text, re.S).group(1)
    named = set(re.findall(r"(?:^|\s{2,})([a-z_]+(?:/|\.py))(?=\s)", tree, re.M))
    entries = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "accelfn").iterdir() if p.name not in OWN}
    assert named == entries, (sorted(named - entries), sorted(entries - named))


def test_each_chapter_ends_with_a_link_to_the_next_and_the_readme_lists_them_in_order() -> None:
    """Chapter N's last line is "Next: [...](N+1-....md)."; the README's reading order names
    every chapter, in order."""
    assert [c.name[:2] for c in CHAPTERS] == [f"{i:02d}" for i in range(1, len(CHAPTERS) + 1)]
    for chapter, following in zip(CHAPTERS, CHAPTERS[1:]):
        last = chapter.read_text().rstrip().splitlines()[-1]
        assert re.fullmatch(rf"Next: \[[^\]]+\]\({re.escape(following.name)}\)(.*)\.", last), (chapter.name, last)
    readme = (ROOT / "README.md").read_text()
    order = re.findall(r"\(docs/(\d\d-[a-z0-9-]+\.md)\)", readme.split("## Documentation", 1)[1].split("Examples:")[0])
    assert order == [c.name for c in CHAPTERS]


def test_the_transforms_table_lists_every_transform() -> None:
    """docs/03's table has a row for every transform record accelfn exports, with its verb."""
    text = (DOCS / "03-transforms.md").read_text()
    rows = {m.group(2): m.group(1) for m in re.finditer(r"^\| `([a-z_]+)\(.*?\| `([A-Za-z]+)` \|", text, re.M)}
    records = {name for name in af.__all__ if isinstance(getattr(af, name), type)
               and issubclass(getattr(af, name), TransformBase)}
    assert set(rows) == records, sorted(records ^ set(rows))
    for record, verb in rows.items():
        assert getattr(af, record).verb == verb
