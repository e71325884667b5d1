"""README.md and docs/*.md point at things that exist: every relative link (file and #anchor)
resolves, and every prose reference to a section ('the README's "Speed" section') names a
heading that is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _without_code_blocks(path: Path) -> str:
    return re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.S | re.M)


def _prose(path: Path) -> str:
    """The page without its code blocks and inline code (examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", _without_code_blocks(path))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (MyST's ``myst_heading_anchors`` makes the same)."""
    text = re.sub(r"<[^>]+>", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = _without_code_blocks(path)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)]


def links(path: Path) -> list[str]:
    """Relative link targets of ``path`` (``[text](target)``, images too)."""
    found = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _prose(path))
    return [t for t in found if not re.match(r"[a-zA-Z][\w+.-]*:", t)]


def _target(page: Path, link: str) -> tuple[Path, str]:
    path, _, anchor = link.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


def _broken_links(page: Path) -> list[str]:
    broken = []
    for link in links(page):
        target, anchor = _target(page, link)
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in map(slug, headings(target)):
            broken.append(f"{link}: no heading with the anchor #{anchor} in {target.name}")
    return broken


#: 'the README's "Speed" section', 'workers.md's "Options"', 'docs/reports.md "The page"'
_SECTION_REFERENCE = re.compile(r"\b(README|[\w/.-]+\.md)(?:'s)? [\"“]([^\"”\n]+)[\"”]")


def _broken_section_references(page: Path) -> list[str]:
    broken = []
    for name, title in _SECTION_REFERENCE.findall(_prose(page)):
        name = "README.md" if name == "README" else name
        candidates = [
            p for p in (page.parent / name, ROOT / name, ROOT / "docs" / name) if p.exists()
        ]
        if not candidates:
            broken.append(f'{name} "{title}": no such file')
        elif not any(slug(title) in map(slug, headings(p)) for p in candidates):
            broken.append(f'{name} "{title}": no such section')
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert _broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_section_named_in_prose_exists(page):
    assert _broken_section_references(page) == []


def test_the_checks_find_what_is_broken(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## The `x` command\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md#a-section) [ok](other.md#the-x-command) [ok](#here) [ok](https://example.invalid/x) `[code](nope.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#no-such) ![img](nope.png)\n"
        'See other.md\'s "A section" and other.md\'s "Fast where users run" table.\n'
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#no-such: no heading with the anchor #no-such in other.md",
        "nope.png: no such file",
    ]
    assert _broken_section_references(page) == ['other.md "Fast where users run": no such section']
    assert slug("Cluster memory reports") == "cluster-memory-reports"
    assert slug("The `/dask-rmm` page (HTML)") == "the-dask-rmm-page-html"
