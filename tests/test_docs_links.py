"""The guide stays a guide, and every link in the documents lands: README.md is at most 300 lines,
and each relative markdown link in README.md, BENCHMARKS.md and docs/*.md names a file that exists
and, with a #anchor, a heading of that file (GitHub's slugs)."""

import os
import re
from collections import Counter

from conftest import REPO

DOCUMENTS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(path):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading):
    """GitHub's anchor of a heading: lowercase, punctuation (backticks and quotes too) but hyphens
    and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, found = Counter(), set()
    for _, line in prose(path):
        if heading := re.match(r"#{1,6} (.+)", line):
            base = slug(heading[1])
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def test_readme_is_a_guide():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines: at most 300, the rest belongs in docs/"


def test_every_relative_link_resolves():
    broken = []
    for document in DOCUMENTS:
        for number, line in prose(document):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # not links inside code
                if re.match(r"(https?|mailto):", target):
                    continue
                file, _, anchor = target.partition("#")
                path = (document.parent / file).resolve() if file else document
                where = f"{document.relative_to(REPO)}:{number}: ({target})"
                if not path.exists():
                    broken.append(f"{where}: no file {os.path.relpath(path, REPO)}")
                elif anchor and anchor not in anchors(path):
                    broken.append(f"{where}: no heading #{anchor} in {os.path.relpath(path, REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)
