"""The design document lives in the repository (issue 39 item 1): every "docs/design.md §N" the
project cites names a section of docs/design.md, nothing cites the old design file outside the
repository, and docs/design.md links only to files (and headings) that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
#: where the project cites the design (README.md and every text file under these folders)
SCANNED = ("normexport", "plugins", "tools", "tests", "models", "docs", "README.md")

#: "docs/design.md §7", "docs/design.md §8, §10", "docs/design.md §5 and §7"
CITATION = re.compile(r"docs/design\.md\s*§\s*(\d+)((?:\s*(?:,|/|and|&)\s*§\s*\d+)*)")
MORE = re.compile(r"§\s*(\d+)")
#: the old citation: the upper-case name without the path (before "§N", or with ".md"), or a path outside the repository
#: (the patterns are split so that this file does not match them itself)
STALE = (re.compile(r"\b" + "DES" + r"IGN(?:\.md)?\b"), re.compile("shared/" + "design", re.IGNORECASE))
SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text_files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
            continue
        for p in sorted(path.rglob("*")):
            rel = p.relative_to(ROOT).parts
            if not p.is_file() or any(part in ("__pycache__", "build") or part.startswith(".") for part in rel):
                continue
            data = p.read_bytes()
            if b"\0" in data[:8192]:
                continue  # binary
            yield p


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def sections() -> set[int]:
    return {int(n) for n in SECTION.findall(_read(DOC))}


def cited(text: str) -> list[int]:
    """The section numbers of every "docs/design.md §N" in `text` (with the "§M" that follow it)."""
    out = []
    for m in CITATION.finditer(text):
        out.append(int(m.group(1)))
        out += [int(n) for n in MORE.findall(m.group(2))]
    return out


def test_design_has_the_numbered_sections():
    assert sections() == set(range(1, 17)), "docs/design.md keeps sections §1..§16 (the code cites them by number)"


def test_every_citation_names_a_section():
    have = sections()
    bad, count = [], 0
    for p in _text_files():
        for n in cited(_read(p)):
            count += 1
            if n not in have:
                bad.append(f"{p.relative_to(ROOT)}: docs/design.md §{n}")
    assert count > 0, "no citation of docs/design.md found: the scan is broken"
    assert not bad, f"citations of sections docs/design.md does not have: {bad}"


def test_the_design_cites_its_own_sections():
    have = sections()
    text = _read(DOC)
    assert not sorted({int(n) for n in MORE.findall(text)} - have)


def test_no_citation_of_a_design_outside_the_repository():
    bad = []
    for p in _text_files():
        for i, line in enumerate(_read(p).splitlines(), 1):
            if any(s.search(line) for s in STALE):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, "cite docs/design.md §N, not the old design file:\n" + "\n".join(bad)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in _read(md).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6} (.*)$", line)
        if fenced or not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for target in LINK.findall(_read(md)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if root not in dest.parents and dest != root:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return bad


def test_design_links_resolve():
    assert LINK.findall(_read(DOC)), "docs/design.md has no links: the scan is broken"
    assert not broken_links(DOC)


def test_readme_links_the_design():
    assert "(docs/design.md)" in _read(ROOT / "README.md")


def test_a_planted_citation_fails(tmp_path):
    """The checks above catch what they are for (a section that does not exist, the old citation,
    a broken link)."""
    assert cited("see docs/design.md §" + "99") == [99] and 99 not in sections()
    assert cited("(docs/design.md §8, §10)") == [8, 10]
    assert any(s.search("(" + "DES" + "IGN §7)") for s in STALE)
    root = tmp_path.resolve()
    (root / "docs").mkdir()
    doc = root / "docs" / "d.md"
    doc.write_text("[x](nowhere.md) [y](d.md#no-such-heading) [z](d.md#a-heading) [w](#a-heading) [v](../../out.md)\n\n"
                   "## A heading\n")
    assert broken_links(doc, root) == ["nowhere.md: no such file", "d.md#no-such-heading: no heading #no-such-heading in "
                                       "docs/d.md", "../../out.md: outside the repository"]
