"""The benchmark's phases by name, in the order a run takes them."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable

from .device import phase_device
from .gpu_tests import phase_tests
from .hf_batch import phase_hf_batch
from .hf_generate import phase_hf_generate
from .inprocess import phase_inprocess
from .model import phase_model
from .profile import phase_profile
from .serve import phase_serve

PHASES: dict[str, Callable[[Namespace], dict]] = {
    "tests": phase_tests, "device": phase_device, "model": phase_model,
    "inprocess": phase_inprocess, "hf_batch": phase_hf_batch, "serve": phase_serve,
    "hf_generate": phase_hf_generate, "profile": phase_profile}
WHEN_NAMED = ("tests", "profile")  # run only when --phases names them
DEFAULT_PHASES = [p for p in PHASES if p not in WHEN_NAMED]
