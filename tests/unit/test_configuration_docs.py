"""docs/configuration.md is what the generator makes of `Settings` today, and every test
the docs cite as evidence exists."""

from __future__ import annotations

import dataclasses
import difflib
import re

from finsieve.app.settings_doc import REGENERATE, render, rows
from finsieve.config import Settings

from support.paths import REPO

CONFIGURATION = REPO / "docs" / "configuration.md"
# `tests/integration/test_pci.py::test_no_card_number_reaches_redis`, optionally with a
# class (`::TestX::test_y`) and a parametrization (`[case]`).
TEST_REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:::(\w+))?(?:\[[^\]\s]*\])?")


def _doc_pages() -> list:
    return [REPO / "README.md", REPO / "SECURITY.md", *sorted((REPO / "docs").glob("*.md"))]


def test_configuration_page_is_the_generators_output() -> None:
    expected = render()
    actual = CONFIGURATION.read_text() if CONFIGURATION.exists() else ""
    if actual != expected:
        diff = "\n".join(list(difflib.unified_diff(
            actual.splitlines(), expected.splitlines(), "docs/configuration.md (checked in)",
            "generated from Settings", lineterm="", n=1))[:40])
        raise AssertionError(f"docs/configuration.md differs from Settings; regenerate it with\n"
                             f"  {REGENERATE}\n{diff}")


def test_every_setting_has_a_row_with_its_variable_and_help() -> None:
    page = CONFIGURATION.read_text()
    names = [f.name for f in dataclasses.fields(Settings)]
    assert [r.name for r in rows()] == names
    for f in dataclasses.fields(Settings):
        assert f.metadata["help"].strip(), f"Settings.{f.name} has no help text"
        assert f"| `{Settings.env_name(f.name)}` |" in page, f"{f.name} has no row"


def test_serve_flags_are_listed_beside_their_settings() -> None:
    by_name = {r.name: r for r in rows()}
    # A sample the CLI is known to map: a renamed flag or a lost mapping shows here.
    assert by_name["engines"].flags == ("--engine",)
    assert by_name["compile"].flags == ("--compile", "--no-compile")
    assert "--no-rules" in by_name["rules"].flags
    assert by_name["redis_url"].flags == ()  # a password never goes on a command line


def test_every_test_the_docs_cite_exists() -> None:
    cited = 0
    missing = []
    for page in _doc_pages():
        if not page.exists():
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in TEST_REFERENCE.finditer(line):
                cited += 1
                path, first, second = m.group(1), m.group(2), m.group(3)
                where = f"{page.relative_to(REPO)}:{n}: {m.group(0)}"
                source = REPO / path
                if not source.is_file():
                    missing.append(f"{where}: no file {path}")
                    continue
                text = source.read_text()
                names = [first, second] if second else [first]
                kinds = ["class", "def"] if second else ["def"]
                for name, kind in zip(names, kinds, strict=True):
                    if not re.search(rf"^\s*(?:async\s+)?{kind}\s+{name}\b", text, re.M):
                        missing.append(f"{where}: no `{kind} {name}` in {path}")
    assert not missing, "the docs cite tests that do not exist:\n" + "\n".join(missing)
    assert cited >= 10, f"docs/security.md should cite the tests that hold its promises ({cited})"


# A metric as the code declares it: Counter("finsieve_rollbacks", ...).
_METRIC_DEFINITION = re.compile(r"\b(?:Counter|Histogram|Gauge|Summary)\(\s*\"(finsieve_\w+)\"")
_METRIC_NAME = re.compile(r"\bfinsieve_[a-z_]+\b")
_EXPOSITION_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _code_metrics() -> set[str]:
    return {m for folder in ("finsieve", "engine", "gateway")
            for path in (REPO / folder).rglob("*.py")
            for m in _METRIC_DEFINITION.findall(path.read_text())}


def test_the_metrics_the_docs_name_are_the_codes() -> None:
    code = _code_metrics()
    assert len(code) >= 20, code  # the pattern still finds the definitions
    named = {}
    for page in _doc_pages():
        if page.exists():
            for name in _METRIC_NAME.findall(page.read_text()):
                base = next((name[: -len(s)] for s in _EXPOSITION_SUFFIXES
                             if name.endswith(s) and name[: -len(s)] in code), name)
                named.setdefault(base, page.name)
    unknown = {n: p for n, p in named.items() if n not in code}
    assert not unknown, f"metrics the docs name that the code does not define: {unknown}"
    operations = (REPO / "docs" / "operations.md").read_text()
    undocumented = sorted(m for m in code if m not in operations)
    assert not undocumented, f"metrics docs/operations.md does not list: {undocumented}"
