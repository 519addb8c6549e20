"""The type checker (mypy, configured in pyproject.toml) is clean on finsieve/, engine/ and
gateway/: CI runs `make test`, so the check that `make lint` makes runs here too."""

from __future__ import annotations

import subprocess
import sys

from support.paths import REPO


def test_mypy_finds_no_type_errors():
    # Its cache (.mypy_cache, ignored by git) makes a second run take seconds; a clean
    # clone's first takes about a minute of one core.
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout
