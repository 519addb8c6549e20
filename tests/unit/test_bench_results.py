"""The run histories in bench/results/ and the plots drawn from them: every JSON parses and
says where it came from, `bench/plot.py` draws docs/img/ again byte for byte, and the
benchmarks page shows every plot."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from support.paths import REPO

RESULTS = REPO / "bench" / "results"
IMG = REPO / "docs" / "img"
PAGE = REPO / "docs" / "benchmarks.md"
PROVENANCE = ("bench", "date", "commit", "machine", "command", "conditions", "source")
HISTORIES = sorted(RESULTS.rglob("*.json"))


def plot_module() -> ModuleType:
    """bench/plot.py, loaded from its file (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_plot", REPO / "bench" / "plot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_run_histories() -> None:
    assert len(HISTORIES) >= 10, HISTORIES


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_run_history_parses_and_states_its_provenance(path: Path) -> None:
    doc = json.loads(path.read_text())
    provenance = doc.get("provenance")
    assert isinstance(provenance, dict), f"{path}: no 'provenance' object"
    missing = [key for key in PROVENANCE if key not in provenance]
    assert not missing, f"{path}: provenance lacks {missing} (unknown values are null, not left out)"
    bench = provenance["bench"]
    assert (REPO / "bench" / f"{bench}.py").is_file() or (REPO / "bench" / bench).is_dir(), \
        f"{path}: provenance names a bench that does not exist: {bench!r}"
    assert provenance["date"] is None or re.fullmatch(r"\d{4}-\d{2}-\d{2}", provenance["date"]), path
    commit = provenance["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit), f"{path}: commit {commit!r}"
    for key in ("machine", "command", "conditions"):
        assert provenance[key] is None or (isinstance(provenance[key], str) and provenance[key].strip()), \
            f"{path}: provenance {key!r} is neither null nor text"
    assert isinstance(provenance["source"], str) and provenance["source"].strip(), path
    assert set(doc) - {"provenance"}, f"{path}: provenance and no figures"


def test_plot_draws_the_checked_in_images_byte_for_byte(tmp_path: Path) -> None:
    written = plot_module().draw(RESULTS, tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in IMG.glob("*.svg")), \
        "docs/img/ holds other plots than bench/plot.py draws: run `make plots` and commit docs/img/"
    for name in names:
        assert (tmp_path / name).read_bytes() == (IMG / name).read_bytes(), \
            f"docs/img/{name} differs from what bench/plot.py draws from bench/results/: run `make plots`"


def test_the_benchmarks_page_shows_every_plot() -> None:
    page = PAGE.read_text()
    for svg in sorted(IMG.glob("*.svg")):
        assert f"](img/{svg.name})" in page, f"docs/benchmarks.md does not show img/{svg.name}"
