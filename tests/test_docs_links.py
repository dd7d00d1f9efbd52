"""Every relative link in README.md and notes/**/*.md points to a file that exists in the repository,
and every #anchor into a Markdown file to one of its headings. Links inside code (fenced blocks and
`inline code`) are text, not links, and are skipped; so are links with a scheme (https:, mailto:)."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); <target> may hold spaces.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text):
    """The lines outside fenced code blocks, with their line numbers."""
    in_fence = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if in_fence is None:
                in_fence = fence.group(1)
            elif fence.group(1) == in_fence:
                in_fence = None
            continue
        if in_fence is None:
            yield number, line


def links(text):
    """(line number, target) of every link in a Markdown text."""
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_DEFINITION, HTML_LINK):
            for match in pattern.finditer(line):
                yield number, match.group(1).strip("<>")


def slug(heading):
    """GitHub's anchor for a heading: link syntax and code marks dropped, lower case, punctuation
    removed, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return "".join(c for c in heading if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(text):
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeated headings."""
    seen, found = {}, set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path, root):
    """'line: target (why)' for every link of one Markdown file that does not resolve."""
    path, root = Path(path), Path(root).resolve()
    text = path.read_text(encoding="utf-8")
    broken = []
    for number, target in links(text):
        if SCHEME.match(target):
            continue  # https:, mailto:, ...: not a file of this repository
        file_part, _, anchor = target.partition("#")
        if not file_part:
            resolved = path.resolve()
        else:
            resolved = (path.parent / file_part.split("?")[0]).resolve()
            if not resolved.is_relative_to(root):
                broken.append(f"{number}: {target} (outside the repository)")
                continue
            if not resolved.exists():
                broken.append(f"{number}: {target} (no such file)")
                continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{number}: {target} (no heading with that anchor)")
    return broken


def documents():
    return [ROOT / "README.md"] + sorted((ROOT / "notes").rglob("*.md"))


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path, ROOT) == []


def test_the_documents_are_found_and_link_to_each_other():
    names = {str(p.relative_to(ROOT)) for p in documents()}
    assert {"README.md", os.path.join("notes", "README.md"), os.path.join("notes", "08-strategies.md")} <= names
    readme = {target for _, target in links((ROOT / "README.md").read_text(encoding="utf-8"))}
    assert "notes/README.md" in readme


def test_the_checker_finds_what_is_broken(tmp_path):
    """The checker itself: a missing file, a missing anchor and a link out of the repository are
    reported; links in code, external links and good links are not."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("# A title, with `code` – and more\n\n## Twice\n\n## Twice\n")
    (tmp_path / "README.md").write_text(
        "[good](notes/a.md) [anchor](notes/a.md#a-title-with-code--and-more) [again](notes/a.md#twice-1)\n"
        "[web](https://example.com/missing.md) `[code](notes/missing.md)`\n"
        "```\n[fenced](notes/missing.md)\n```\n"
        "[missing](notes/missing.md) and ![image](notes/missing.png)\n"
        "[bad anchor](notes/a.md#nope) [self](#nowhere)\n"
        "[out](../outside.md)\n"
        "[ref]: notes/gone.md\n")
    (tmp_path.parent / "outside.md").write_text("# out\n")
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "6: notes/missing.md (no such file)",
        "6: notes/missing.png (no such file)",
        "7: notes/a.md#nope (no heading with that anchor)",
        "7: #nowhere (no heading with that anchor)",
        "8: ../outside.md (outside the repository)",
        "9: notes/gone.md (no such file)",
    ]
