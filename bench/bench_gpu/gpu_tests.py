"""Phase `tests` (only when named): the GPU tests (`make test-gpu`'s, marker `gpu`) on this
machine, with the benchmark's tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import Namespace

from .harness import REPO

GPU_TESTS = "tests/integration/test_gpu.py"


def phase_tests(args: Namespace) -> dict:
    env = {**os.environ, "FINSIEVE_TEST_TOKENIZER": args.tokenizer, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           GPU_TESTS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.tests_timeout)
    print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
    return {"returncode": proc.returncode, "summary": proc.stdout.strip().splitlines()[-1:]}
