"""README.md and the docs it leads to: the README stays short and starts with the two
commands, and no relative link in the pages points at a file or #anchor that is not there.

Anchors follow GitHub's rules for headings (the text as rendered, lower-cased, punctuation
but `-` and `_` dropped, each space a `-`, a repeated heading `-1`, `-2`, ...), so a link
that works here works on GitHub. Pure file reading: no subprocess, no network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.paths import REPO

README_MAX_BYTES = 15_000
# The pages whose links are checked: the root pages (README, SECURITY, CHANGELOG), docs/, and
# each folder's README (rules/README.md, the rule authors' guide, among them). A page that is
# missing is caught where it is linked from.
PAGES = sorted({*(p.name for p in REPO.glob("*.md")),
                *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
                *(f"{p.parent.name}/README.md" for p in REPO.glob("*/README.md")
                  if not p.parent.name.startswith("."))})

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the target has no spaces (or is in <...>).
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not m.group(2).strip():
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, line))
    return out


def _fences(text: str) -> list[tuple[str, list[str]]]:
    """(info string, body lines) of every fenced code block, in order."""
    blocks: list[tuple[str, list[str]]] = []
    fence, body, info = "", [], ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not m.group(2).strip():
                blocks.append((info, body))
                fence = ""
            else:
                body.append(line)
        elif m:
            fence, info, body = m.group(1), m.group(2).strip(), []
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger on the rendered text)."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML is not text
    text = text.replace("*", "").replace("~~", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every #fragment the rendered page has: its headings' slugs (repeats numbered as
    GitHub numbers them) and explicit <a id|name> anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and reference definition in the prose
    (not in code blocks, not in inline code)."""
    out: list[tuple[int, str]] = []
    for number, line in _prose_lines(text):
        line = _INLINE_CODE.sub("", line)
        targets = [t.strip("<>") for t in _LINK.findall(line)]
        if m := _REF_DEF.match(line):
            targets.append(m.group(1))
        out += [(number, t) for t in targets]
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Why each relative link of the page (a file under root) does not resolve; [] when
    every one does."""
    problems: list[str] = []
    text = page.read_text(encoding="utf-8")
    for number, target in links(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # https:, mailto:: not a file of this repository
        path_part, _, fragment = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        dest = (page.parent / path_part).resolve() if path_part else page
        if root.resolve() not in (dest, *dest.parents):
            problems.append(f"{where}: points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if not fragment:
            continue
        if dest.suffix == ".md":
            if fragment not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading or anchor #{fragment} in {dest.name}")
        elif not (dest.is_file() and re.fullmatch(r"L\d+(?:-L\d+)?", fragment)):
            problems.append(f"{where}: #{fragment} is not a line anchor of a file")
    return problems


def _commands(body: list[str]) -> list[str]:
    """A shell block's commands: `$ ` prompts stripped, comments and blanks dropped."""
    out = []
    for line in body:
        line = line.removeprefix("$ ").split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


# --- the helpers themselves, on texts whose answer is known ---------------------------------

@pytest.mark.parametrize(("heading", "expected"), [
    ("Rules in the decoder loop", "rules-in-the-decoder-loop"),
    ("The API in brief", "the-api-in-brief"),
    ("`audit verify`: what it checks", "audit-verify-what-it-checks"),
    ("Hold-back, SAR & masks", "hold-back-sar--masks"),
    ("[Unreleased]", "unreleased"),
    ("0.1.0 - 2026-12-04", "010---2026-12-04"),
    ("**Optimistic** decoding (CUDA)", "optimistic-decoding-cuda"),
    ("max_span and `FINSIEVE_MAX_BATCH`", "max_span-and-finsieve_max_batch"),
    ("规则 pack", "规则-pack"),
])
def test_slug_follows_githubs_rules(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_anchors_number_repeats_and_skip_code_blocks() -> None:
    text = "# A\n## Notes\n```sh\n# not a heading\n```\n## Notes\n<a id=\"kept\"></a>\n"
    assert anchors(text) == {"a", "notes", "notes-1", "kept"}


def test_links_are_read_from_prose_only() -> None:
    text = ("See [ops](docs/operations.md#tls) and ![plot](docs/img/p.png).\n"
            "`[not](a-link.md)` and\n```text\n[nor](this.md)\n```\n[ref]: CHANGELOG.md\n")
    assert links(text) == [(1, "docs/operations.md#tls"), (1, "docs/img/p.png"),
                           (6, "CHANGELOG.md")]


def test_each_kind_of_broken_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "glossary.md").write_text("# Glossary\n## Hold-back\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n## Here\n"
        "[a](glossary.md#hold-back) [b](#here) [c](../docs/glossary.md) [d](https://x.org/y)\n"
        "[e](no-such-page.md) [f](glossary.md#no-such-term) [g](../../shared/DESIGN.md)\n"
        "[h](#nowhere)\n", encoding="utf-8")
    problems = broken_links(page, tmp_path)
    assert [p.split(": ")[0] for p in problems] == ["docs/page.md:4"] * 3 + ["docs/page.md:5"]
    assert "no such file" in problems[0]
    assert "no heading or anchor #no-such-term" in problems[1]
    assert "outside the repository" in problems[2]
    assert "#nowhere" in problems[3]


# --- the pages ---------------------------------------------------------------------------------

def test_readme_is_at_most_15000_bytes() -> None:
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move reference material to "
        "docs/ (architecture, operations, configuration, benchmarks)")


def test_the_pages_checked_include_the_readers_pages() -> None:
    assert {"README.md", "rules/README.md", "docs/architecture.md"} <= set(PAGES)


@pytest.mark.parametrize("name", PAGES)
def test_relative_links_resolve(name: str) -> None:
    problems = broken_links(REPO / name)
    assert not problems, "\n".join(problems)


def test_no_page_points_outside_the_repository_to_the_design_notes() -> None:
    offenders = [p for p in PAGES if "shared/DESIGN.md" in (REPO / p).read_text(encoding="utf-8")]
    assert not offenders, f"DESIGN.md is outside the repo; its terms are in docs/glossary.md: {offenders}"


def test_readme_starts_with_the_two_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    before_first_section = text.split("\n## ", 1)[0]
    blocks = _fences(before_first_section)
    assert blocks, "README.md must show its commands before its first section"
    info, body = blocks[0]
    assert info.split()[0] in {"sh", "console"}, f"the first block is {info!r}, not a shell block"
    assert _commands(body) == ["make run", "make test"]


def test_ci_runs_the_readmes_test_command() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    _, body = _fences(text)[0]
    test_command = [c for c in _commands(body) if c.startswith("make test")]
    ci = _commands((REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines())
    assert test_command and test_command[0] in ci, f".ci/run must call {test_command}: {ci}"
