"""Unit tests start no process: a test that needs one (a server, a CLI run, workers) belongs
in tests/integration/, where the suite's time for processes is spent and accounted for."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a unit test starts no process: move this test to tests/integration/")


@pytest.fixture(scope="module", autouse=True)
def no_processes() -> Iterator[None]:
    """Module-scoped, so that it is in force before the module's own fixtures are built."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _refuse)
        patch.setattr(os, "fork", _refuse)
        patch.setattr(os, "posix_spawn", _refuse)
        yield
