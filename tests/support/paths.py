"""Where the tests find the repository and the model `make setup` prepared."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The converted default model is prepared once by `make setup` and shared by all tests.
MODEL_STATE = REPO / ".finsieve"
