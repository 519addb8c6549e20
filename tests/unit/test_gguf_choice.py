"""Which model directories run on llama.cpp (the CPU's fast path): one holding a GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.loader import gguf_of
from finsieve.errors import ModelLoadError


def test_a_directory_without_a_gguf_file_runs_the_float_weights(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert gguf_of(tmp_path) is None


def test_a_directory_with_one_gguf_file_runs_it(tmp_path: Path) -> None:
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"")
    assert gguf_of(tmp_path) == tmp_path / "model.Q4_1.gguf"


def test_two_gguf_files_are_refused_by_name(tmp_path: Path) -> None:
    """Which one ran would depend on the order a directory lists them."""
    for name in ("a.Q4_1.gguf", "b.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"2 GGUF files \(a\.Q4_1\.gguf, b\.Q8_0\.gguf\)"):
        gguf_of(tmp_path)
