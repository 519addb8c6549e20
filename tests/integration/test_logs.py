"""Log lines from processes sharing one stderr stay whole: a JSON record a line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
import sys
from finsieve import logs
import structlog
logs.configure("json", "info")
log = structlog.get_logger("t")
for i in range(3000):
    log.info("rule pack loaded", version=sys.argv[1], i=i)
"""


def test_processes_sharing_stderr_never_splice_two_records_into_one_line(tmp_path):
    """Four processes log to one file at once, unbuffered as the images run them
    (PYTHONUNBUFFERED=1): every line is one JSON record, and none is lost."""
    out = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with out.open("w") as f:
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(n)], stderr=f, env=env)
                 for n in range(4)]
        for p in procs:
            assert p.wait(timeout=120) == 0
    lines = out.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # a spliced line fails here
    assert len(records) == 4 * 3000
