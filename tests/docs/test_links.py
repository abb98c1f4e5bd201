"""Every markdown link in the README, CONTRIBUTING.md, CHANGELOG.md and docs/ stays inside the repository
and names something that exists: a tracked path, and for a `#fragment` into a markdown file, one of its
headings. No URL schemes (http, https, mailto, ...), no absolute paths, no `..` that climbs out of the
repository. Paths in code count too: a command or path in code runs from the repository root, so a `../`
there leaves it (the README once ran `kascade sim azure:../shared/...` and architecture.md named
`../shared/DESIGN.md`, a folder only the developers' machines have).

Data flow: the markdown files -> `links()` (fenced code and inline code removed, then inline links,
images and reference definitions) -> `problems()` (one sentence per bad link) -> the test asserts none.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
AUTOLINK = re.compile(r"<((?:[a-z][a-z0-9+.-]*:|www\.)[^>\s]+)>", re.I)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
CODE_UP = re.compile(r"(?<![\w.])\.\./[\w.-][^\s`'\")]*")


def markdown_files() -> list[Path]:
    """The files a reader follows links in: README, CONTRIBUTING, CHANGELOG and everything under docs/."""
    top = [REPO / n for n in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md") if (REPO / n).exists()]
    return top + sorted((REPO / "docs").rglob("*.md"))


def links(text: str) -> list[str]:
    """Link targets in `text`, code excluded."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return INLINE.findall(prose) + REFDEF.findall(prose) + AUTOLINK.findall(prose)


def code_paths_up(text: str) -> list[str]:
    """`../...` paths inside fenced or inline code: they leave the repository from its root."""
    code = [m.group(0) for m in FENCE.finditer(text)] + INLINE_CODE.findall(FENCE.sub("", text))
    return [p for c in code for p in CODE_UP.findall(c)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def problems(md: Path, text: str, root: Path = REPO) -> list[str]:
    """One sentence per link in `text` (the content of `md`) that leaves `root` or names nothing there."""
    out = []
    for target in links(text):
        where = f"{md.relative_to(root)}: link {target!r}"
        if SCHEME.match(target) or target.startswith("www."):
            out.append(f"{where} leaves the repository (a URL); link a file in the repository instead")
            continue
        if target.startswith("/"):
            out.append(f"{where} is an absolute path; use a path relative to {md.relative_to(root)}")
            continue
        path, _, fragment = target.partition("#")
        path = path.split("?", 1)[0]
        dest = (md.parent / path).resolve() if path else md
        if not dest.is_relative_to(root.resolve()):
            out.append(f"{where} points outside the repository")
        elif not dest.exists():
            out.append(f"{where} names a file that does not exist")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{where}: {dest.name} has no heading with the anchor #{fragment}")
    out += [f"{md.relative_to(root)}: code path {p!r} leaves the repository (commands run from its root)"
            for p in code_paths_up(text)]
    return out


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_stays_in_the_repository_and_resolves(md: Path) -> None:
    assert problems(md, md.read_text(encoding="utf-8")) == []


def test_the_check_finds_each_kind_of_bad_link(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## Some `code` section\n")
    md = tmp_path / "docs" / "a.md"
    text = ("[ok](b.md) [ok](b.md#some-code-section) [ok](#here) ![img](b.md)\n# Here\n"
            "`[in code](https://example.com)`\n```\n[fenced](../../outside.md)\n```\n"
            "[web](https://example.com) [mail](mailto:a@b.c) [abs](/etc/passwd) [up](../../shared/DESIGN.md)\n"
            "[gone](missing.md) [anchor](b.md#nowhere)\n[ref]: http://example.com\n<https://example.org>\n"
            "The design is `../shared/DESIGN.md`.\n```bash\nkascade sim azure:../shared/t.csv\n```\n")
    md.write_text(text)
    got = problems(md, text, root=tmp_path)
    assert len(got) == 11, got
    for needle in ("'https://example.com' leaves", "'mailto:a@b.c' leaves", "'/etc/passwd' is an absolute",
                   "'../../shared/DESIGN.md' points outside", "'missing.md' names a file that does not exist",
                   "no heading with the anchor #nowhere", "'http://example.com' leaves", "'https://example.org' leaves",
                   "code path '../shared/DESIGN.md'", "code path '../shared/t.csv'", "code path '../../outside.md'"):
        assert any(needle in g for g in got), (needle, got)
