"""The documentation's links hold: every relative link in README.md and docs/*.md names a file that exists and, for a
``#anchor`` into a Markdown file, a heading that file has (by GitHub's anchor rule); and the README's contents list
names every ``##`` section, in order; each figure of the tables is in one place only (a guide's, or the README's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title"; the text may hold code (``[`x`](y)``).
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a `#` there is a shell comment, a `[x](y)` is code)."""
    lines: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text (code, links and emphasis reduced to their words),
    lowercased, punctuation other than hyphens and underscores removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()  # inline HTML
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def headings(path: Path) -> list[tuple[int, str]]:
    """(level, text) of each ATX heading outside code blocks."""
    found: list[tuple[int, str]] = []
    for line in prose_lines(path):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            found.append((len(m.group(1)), m.group(2)))
    return found


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the file's headings; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, text in headings(path):
        base = github_anchor(text)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(path: Path) -> list[str]:
    """The target of every link and image outside code."""
    found: list[str] = []
    for line in prose_lines(path):
        # A code span's text is not a link, but a link's text may be a code span: blank the spans, keep the rest.
        line = INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), line)
        found.extend(m.group(1) for m in LINK.finditer(line))
    return found


def test_github_anchor_rule() -> None:
    assert github_anchor("SGLang, the actors' engine") == "sglang-the-actors-engine"
    assert github_anchor("Real tasks: datasets, graders, evaluation") == "real-tasks-datasets-graders-evaluation"
    assert github_anchor("`task`") == "task"
    assert github_anchor("5. Aggregation (`learner.loss_type`, default `dapo`)") == (
        "5-aggregation-learnerloss_type-default-dapo"
    )
    assert github_anchor("The learner under torchrun") == "the-learner-under-torchrun"
    assert github_anchor("A — B") == "a--b"  # the dash goes, both spaces stay


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken: list[str] = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.relative_to(ROOT)} has no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_docs_have_links_to_check() -> None:
    readme_links = links(ROOT / "README.md")
    assert any(t.startswith("docs/operations.md#") for t in readme_links)
    assert any(t.startswith("#") for t in readme_links)


def contents_list(path: Path) -> list[str]:
    """The anchors of the top-level items of the list that follows the line ``**Contents**``."""
    lines = prose_lines(path)
    start = lines.index("**Contents**") + 1
    while not lines[start].strip():
        start += 1
    items: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            break
        m = re.match(r"^[-*] \[[^\]]*\]\(#([^)]+)\)", line)
        if m:
            items.append(m.group(1))
    return items


@pytest.mark.parametrize("name", ["README.md", "docs/operations.md"])
def test_contents_list_names_every_section(name: str) -> None:
    path = ROOT / name
    sections = [github_anchor(text) for level, text in headings(path) if level == 2]
    assert sections, f"{name} has no ## sections"
    assert contents_list(path) == sections, f"{name}: the contents list and the ## sections differ"


def table_rows(path: Path) -> list[str]:
    """The body rows of every Markdown table outside code: not its header, not the line under it."""
    rows: list[str] = []
    previous = ""
    for line in prose_lines(path):
        is_row = line.startswith("|")
        if is_row and previous.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            rows.append(line.strip())
        previous = line if is_row else ""
    return rows


def test_every_figure_is_told_in_one_place() -> None:
    """A figure told twice is told wrong once, sooner or later: each table row holding a figure is in one file only,
    and once there."""
    seen: dict[str, list[str]] = {}
    for doc in DOCS:
        for row in table_rows(doc):
            if re.search(r"\d", row):
                seen.setdefault(row, []).append(str(doc.relative_to(ROOT)))
    twice = {row[:100]: where for row, where in seen.items() if len(where) > 1}
    assert not twice, twice
