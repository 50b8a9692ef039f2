"""README.md and docs/*.md: every relative link resolves, and the README stays a front door.

The README holds what a newcomer needs first and links every page under docs/; the rest lives in those
pages. A link whose file (or heading anchor) is gone fails here, as does a README that grows back past
16 KB.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_BYTES = 16 * 1024

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)  # fenced code blocks
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(page: Path) -> str:
    """The page without code, where brackets and parentheses are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", page.read_text()))


def _targets(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
        slug = re.sub(r"[^\w\- ]", "", text.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _targets(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _targets(README)}
    unlinked = [p.relative_to(ROOT).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"README.md's 'Where to read next' should link {unlinked}"


def test_the_readme_stays_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move the detail to a page under docs/ and link it"
    )


def test_each_docs_page_opens_with_a_title_and_what_it_covers() -> None:
    for page in DOCS:
        lines = page.read_text().split("\n")
        assert lines[0].startswith("# ") and not lines[1].strip() and lines[2].strip(), (
            f"{page.relative_to(ROOT)} should open with '# Title', a blank line and a sentence on what it covers"
        )


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# T\n\n[ok](page.md), [gone](missing.md), [anchor](#t), [bad](#nope), `[code](x.md)`\n")
    assert _targets(page) == ["page.md", "missing.md", "#t", "#nope"]
    assert _anchors(page) == {"t"}
