"""Every command the docs show is executed here, as a reader would type it.

The convention the pages follow is support/doc_commands.py's docstring. Pages run in
scratch copies of the checkout (symlinks to this one; their own rules/, docs/, bench/,
finsieve/v1/ and state directory with the prepared model) against real servers on free
loopback ports: one shared by the pages whose server is a plain `finsieve serve &` (a
server start costs the suite seconds), or a page's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from finsieve.app.client import wait_ready

from support.doc_commands import PLACEHOLDER, Command, Page, match_output, read_page
from support.paths import REPO
from support.servers import free_port

# The docs: README.md first (its `finsieve serve &` starts the shared server), the other pages
# at the top, docs/, and each top-level folder's README (rules/README.md, the rule authors').
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (
    *REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("[!.]*/README.md"))
    if p.name != "README.md" or p.parent != REPO)]
# The default ports a page writes literally; each page gets free ports in their place.
DEFAULT_PORTS = (50051, 50052, 50053, 9464)
_PORT = re.compile(r"(?<!\d)(50051|50052|50053|9464)(?!\d)")
_FINSIEVE = r"(?:\bfinsieve|python -m finsieve\.app\.cli)"
# Client commands and the default port each reaches when it names no --target.
_CLIENT = re.compile(_FINSIEVE + r"\s+(chat|audit\s+\w+|keys\s+\w+|limits\s+\w+)\b")
_SERVE = re.compile(_FINSIEVE + r"\s+serve\b")
# `make X` runs after `make setup` in CI and here; -o keeps make from reinstalling the venv
# because pyproject.toml is newer than the stamp (a developer's edit).
_MAKE = re.compile(r"^make\b", re.M)
COMMAND_TIMEOUT_S = 180
SERVER_READY_S = 120
# A page whose server is this (output redirected or not; metrics on 9464 or not: the shared
# server serves them) shares the test's one; any other serve gets a place of its own.
PLAIN_SERVE = "finsieve serve &"
_PLAIN_SERVE = re.compile(
    r"finsieve serve(?:\s+--metrics-port[ =]9464)?(?:\s+(?:[12]?>>?|&>)\s*\S+|\s+2>&1)*\s*&")


def _pages() -> list[Page]:
    return [read_page(REPO / name, name) for name in PAGES if (REPO / name).exists()]


def _runnable() -> list[Page]:
    return [p for p in _pages() if any(c.mode == "run" for c in p.commands)]


def test_pages_follow_the_command_convention() -> None:
    problems = [problem for page in _pages() for problem in page.problems]
    for page in _pages():
        for c in page.commands:
            problems += [f"{c.where}: {p}" for p in _placeholder_problems(page, c)]
    assert not problems, ("see the convention in tests/support/doc_commands.py:\n"
                          + "\n".join(problems))


def _placeholder_problems(page: Page, command: Command) -> list[str]:
    """A placeholder in a command must be captured by an earlier command's shown output."""
    captured: set[str] = set()
    for c in page.commands:
        if c is command:
            missing = set(PLACEHOLDER.findall(c.text)) - captured
            return [f"placeholder <{name}> is captured by no earlier shown output"
                    for name in sorted(missing)]
        for line in c.expected:
            captured.update(PLACEHOLDER.findall(line))
    return []


def test_ci_commands_are_run_by_ci() -> None:
    ci = {line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()}
    declared = [c for page in _pages() for c in page.commands if c.mode == "ci"]
    missing = [f"{c.where}: {c.text}" for c in declared if c.text.strip() not in ci]
    assert not missing, "declared `ci` but not a line of .ci/run:\n" + "\n".join(missing)


def test_parse_only_commands_are_well_formed(tmp_path: Path) -> None:
    checkout = _scratch_checkout(tmp_path)
    env = _environment({p: free_port() for p in DEFAULT_PORTS})
    failures = []
    for page in _pages():
        for c in page.commands:
            if c.mode == "parse-only" and (why := _malformed(c, checkout, env)):
                failures.append(f"{c.where}: {c.text}\n  {why}")
    assert not failures, "\n".join(failures)


def _finsieve_refuses(argv: list[str]) -> str:
    """'' if finsieve's own parser accepts argv (in this process: no start-up to pay)."""
    from finsieve.app.cli import _parser

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(argv)
    except SystemExit as e:
        return "" if e.code == 0 else errors.getvalue().strip()[-600:]
    return ""


def _malformed(c: Command, checkout: Path, env: dict[str, str]) -> str:
    """'' if the command's program accepts its arguments, else why not. A finsieve command is
    parsed by finsieve's own parser (an unknown flag fails); `make X` by `make -n X`; any
    other program must answer `--help`."""
    words = shlex.split(c.foreground_text.split("|")[0], comments=True)
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        words.pop(0)  # VAR=value before the program
    if not words:
        return "no program"
    if Path(words[0]).name == "finsieve":
        return _finsieve_refuses(words[1:])
    make = ["make", "-n", "-o", ".venv/.installed", *words[1:]]
    argv = make if words[0] == "make" else [*words, "--help"]
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    return "" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-600:]}"


@dataclass
class Place:
    """Where commands run: a scratch checkout, its ports and environment, and the background
    commands started there (stopped when the place is done)."""

    checkout: Path
    ports: dict[int, int]
    env: dict[str, str]
    background: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    server_log: Path | None = None  # where the `finsieve serve &` running here logs

    @classmethod
    def new(cls, tmp: Path, shared: bool = False) -> Place:
        ports = {p: free_port() for p in DEFAULT_PORTS}
        env = _environment(ports)
        if shared:  # its one server serves metrics, for the pages that show them
            env["FINSIEVE_METRICS_PORT"] = str(ports[9464])
        return cls(_scratch_checkout(tmp), ports, env)

    def close(self) -> None:
        for proc, _ in self.background:
            _stop(proc)


@pytest.fixture(scope="module")
def shared_place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Place]:
    """The place of every page that starts no server of its own: one server for them all,
    started by the first that needs it."""
    place = Place.new(tmp_path_factory.mktemp("doc-commands"), shared=True)
    yield place
    place.close()


@pytest.mark.parametrize("page", [p.name for p in _runnable()])
def test_page_commands_run(page: str, tmp_path: Path, shared_place: Place) -> None:
    (doc,) = [p for p in _pages() if p.name == page]
    commands = [c for c in doc.commands if c.mode == "run"]
    serves = [c for c in commands if c.background and _SERVE.search(c.text)]
    if any(not _PLAIN_SERVE.fullmatch(c.text.strip()) for c in serves):
        place = Place.new(tmp_path)  # a server of the page's own making, in its own checkout
        try:
            PageRun(doc, place).run(commands)
        finally:
            place.close()
        return
    if shared_place.server_log:  # the page's plain `finsieve serve &` is running already
        commands = [c for c in commands if c not in serves]
    elif not serves and any(_CLIENT.search(c.text) for c in commands):
        commands.insert(0, Command("(the test's own server)", 0, PLAIN_SERVE))
    try:
        PageRun(doc, shared_place).run(commands)
    finally:
        _restore_rules(shared_place)


def _restore_rules(place: Place) -> None:
    """Put the shared checkout's rules/ back as the repository has them (a page may have
    edited them), and wait until its server has loaded them again."""
    scratch = place.checkout / "rules"
    if _tree(scratch) == _tree(REPO / "rules"):
        return
    shutil.rmtree(scratch)
    shutil.copytree(REPO / "rules", scratch, ignore=shutil.ignore_patterns("__pycache__"))
    if (log := place.server_log) is None:
        return
    loaded = _loaded_versions(log)
    assert loaded, f"no 'rules loaded' line in {log}"
    first, seen = loaded[0], len(loaded)
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:  # the watchers reload within a second or so
        # Role all: the engine's and the gateway's watchers each log their reload.
        if _loaded_versions(log)[seen:].count(first) >= 2:
            return
        time.sleep(0.1)
    raise AssertionError(f"the shared server did not load rules/ {first} again:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _loaded_versions(log: Path) -> list[str]:
    """The policy versions the server's log says it loaded, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if '"rules loaded"' in line or '"rule pack loaded"' in line:  # at start; reloads
            out.append(json.loads(line)["version"])
    return out


class PageRun:
    """One page's commands, in order, at one place."""

    def __init__(self, page: Page, place: Place) -> None:
        self.page = page
        self.place = place
        self.captured: dict[str, str] = {}

    def run(self, commands: list[Command]) -> None:
        for c in commands:
            self.step(c)

    def step(self, c: Command) -> None:
        text = self.substitute(c)
        if c.background:
            self.start(c, text)
            return
        done = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=self.place.checkout,
                              env=self.place.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
        output = done.stdout + done.stderr
        if done.returncode != c.exit:
            self.fail(c, text, f"exit {done.returncode}, expected {c.exit}", output)
        captured, missing = match_output(c.expected, output, self.captured)
        if missing:
            self.fail(c, text, f"shown output line not found: {missing!r}", output)
        self.captured.update(captured)

    def substitute(self, c: Command) -> str:
        text = c.text
        for name in PLACEHOLDER.findall(text):
            if name not in self.captured:
                self.fail(c, text, f"<{name}> was captured by no earlier output", "")
            text = text.replace(f"<{name}>", self.captured[name])
        ports = self.place.ports
        text = _PORT.sub(lambda m: str(ports[int(m.group(1))]), text)
        text = _MAKE.sub("make -o .venv/.installed", text)
        if "--target" not in text:
            text = _CLIENT.sub(lambda m: f"{m.group(0)} --target {self.default_target(m.group(1))}",
                               text)
        return text

    def default_target(self, command: str) -> str:
        port = self.place.ports[50051] if command == "chat" else self.place.ports[50053]
        return f"127.0.0.1:{port}"

    def start(self, c: Command, text: str) -> None:
        place = self.place
        log = place.checkout / f"background-{len(place.background)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(["bash", "-c", text[:text.rstrip().rindex("&")]],
                                    cwd=place.checkout, env=place.env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        place.background.append((proc, log))
        if not _SERVE.search(text):
            return
        if re.search(r"--role[ =]engine\b", text):
            port = _flag(text, "--engine-port") or place.ports[50052]
            ready = _wait_listening(proc, port)
        else:
            port = _flag(text, "--port") or place.ports[50051]
            ready = proc.poll() is None and asyncio.run(
                wait_ready(f"127.0.0.1:{port}", SERVER_READY_S))
        if not ready:
            self.fail(c, text, f"the server did not come up on port {port}",
                      log.read_text(errors="replace"))
        redirected = re.search(r"(?<![0-9&])>>?\s*([^\s&]+)", text)  # `> serve.log`: its log
        place.server_log = place.checkout / redirected.group(1) if redirected else log

    def fail(self, c: Command, text: str, why: str, output: str) -> None:
        logs = "".join(f"\n--- {log.name} (last 3000 characters)\n"
                       f"{log.read_text(errors='replace')[-3000:]}" for _, log in self.place.background)
        pytest.fail(f"{c.where}: {why}\n$ {text}\n{output[-4000:]}{logs}", pytrace=False)


def _flag(text: str, name: str) -> int:
    m = re.search(rf"{name}[ =](\d+)", text)
    return int(m.group(1)) if m else 0


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)  # polling a port, with a deadline
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group (its shell and what it started), then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _environment(ports: dict[int, int]) -> dict[str, str]:
    """A reader's shell: the venv first on PATH, no FINSIEVE_* of the test run's own, and the
    defaults' ports moved to the page's free ones (for `finsieve serve` without --port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FINSIEVE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.update(FINSIEVE_PORT=str(ports[50051]), FINSIEVE_ENGINE_PORT=str(ports[50052]),
               FINSIEVE_AUDIT_PORT=str(ports[50053]))
    # `make run`'s variables: its port, and a short demo answer (200 tokens cost the suite
    # ~20 s on two cores; the path is the same).
    env.update(PORT=str(ports[50051]), MAX_TOKENS="16")
    return env


def _scratch_checkout(tmp: Path) -> Path:
    """A checkout a page may change: symlinks to this one's entries, but its own rules/,
    docs/, bench/, finsieve/v1/ (make's proto step writes there) and state directory, which
    links the model `make setup` prepared."""
    root = tmp / "checkout"
    root.mkdir()
    own = {"rules", "docs", "bench", ".finsieve", "finsieve", ".pytest_cache", ".hypothesis"}
    for entry in REPO.iterdir():
        if entry.name not in own:
            (root / entry.name).symlink_to(entry)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "rules", root / "rules", ignore=ignore)
    shutil.copytree(REPO / "docs", root / "docs", ignore=ignore)
    # Copied, not linked: a script finds the repository from its own resolved path
    # (bench/plot.py writes docs/img/ there), so a link would lead it back to this checkout.
    shutil.copytree(REPO / "bench", root / "bench", ignore=ignore)
    (root / "finsieve").mkdir()
    for entry in (REPO / "finsieve").iterdir():
        if entry.name == "v1":
            shutil.copytree(entry, root / "finsieve" / "v1", ignore=ignore)
        elif entry.name != "__pycache__":
            (root / "finsieve" / entry.name).symlink_to(entry)
    state = root / ".finsieve"
    state.mkdir(mode=0o700)
    (state / "models").symlink_to(REPO / ".finsieve" / "models")
    return root
