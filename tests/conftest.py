"""The suite's fixtures: real servers (subprocesses on loopback), the real default model, a
real Valkey, test certificates. Helpers live in tests/support/."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch's CPU threads (OpenMP) spin at each of a step's hundreds of barriers by default. On
# this suite's 2-core machines a thread that spins keeps a core from the one it waits for
# whenever anything else runs: the client, a server's gateway threads, another server, a CI
# neighbour. One busy process beside the in-process engine made a decode step 3.6x slower
# (10 tokens: 1.16 s -> 4.18 s), 0.2 -> 2.0 s a token beside a neighbour's test run; waiting
# passively, 1.3 s idle and 1.9 s beside the busy process. Set before torch is imported,
# here and in every server the tests start (they inherit the environment); the same
# threads compute the same results either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Asserts in the helpers (tests/support/) report their operands as the tests' own do.
pytest.register_assert_rewrite("support")

from support.paths import MODEL_STATE  # noqa: E402  (after the thread policy above)
from support.servers import (  # noqa: E402
    CANARY,
    SESSION_LIMITS,
    TIGHT_ENV,
    Server,
    TightServer,
    free_port,
    start_server,
)


@pytest.fixture
def valkey(tmp_path: Path):
    """A real valkey-server of its own (appendfsync always), for one test."""
    from finsieve.valkey import EmbeddedValkey

    server = EmbeddedValkey(tmp_path / "valkey", appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.loader import default_model_dir

    return default_model_dir(MODEL_STATE)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    """One full server (gateway + engine + embedded Valkey, and the officers' console) for
    the session."""
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "limits.yaml").write_text(SESSION_LIMITS)
    srv = start_server(tmp, "--model", str(default_model_dir), "--metrics-port", str(free_port()),
                       "--limits-file", str(tmp / "limits.yaml"),
                       "--http-port", str(free_port()), console=True,
                       env={"FINSIEVE_HTTP_READ_TIMEOUT_S": "10"})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine(default_model_dir: Path):
    """The same model in-process, for non-streamed reference decodes."""
    import torch

    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model

    device = torch.device("cpu")
    model = load_model(str(default_model_dir), MODEL_STATE, device)
    return LLMEngine(model, EngineLimits(max_batch=8, max_context=2048, default_max_tokens=256), device)


@pytest.fixture(scope="session")
def float32_engine(default_model_dir: Path):
    """The same model on the float32 path (FINSIEVE_CPU_BACKEND=float32: the engine's own
    forward, the reference the llama.cpp path is compared with)."""
    import torch

    from engine.engine import EngineLimits, LLMEngine
    from engine.loader import load_model

    device = torch.device("cpu")
    model = load_model(str(default_model_dir), MODEL_STATE, device, "float32")
    return LLMEngine(model, EngineLimits(max_batch=8, max_context=2048, default_max_tokens=256), device)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1, a client certificate for Bank A's mobile
    app, and one from a CA the server does not trust."""
    d = tmp_path_factory.mktemp("certs")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    def new_key_and(*args: str) -> list[str]:
        return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", *args]

    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *new_key_and("-keyout", f"{ca}.key", "-out", f"{ca}.pem"),
                "-days", "2", "-subj", f"/CN={ca}")
    for name, subject, san, ca in [
            ("server", "/CN=localhost", "DNS:localhost,IP:127.0.0.1", "ca"),
            ("client", "/O=Bank A/CN=mobile-app", "URI:spiffe://bank-a/mobile", "ca"),
            ("stranger", "/O=Bank A/CN=mobile-app", "URI:spiffe://bank-a/mobile", "other-ca")]:
        openssl("req", *new_key_and("-keyout", f"{name}.key", "-out", f"{name}.csr"),
                "-subj", subject)
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return d


@pytest.fixture(scope="session")
def tight_server(tmp_path_factory: pytest.TempPathFactory,
                 default_model_dir: Path) -> Iterator[TightServer]:
    tmp = tmp_path_factory.mktemp("tight")
    rules = tmp / "rules"
    rules.mkdir()
    (rules / "canary.yaml").write_text(CANARY)
    metrics = free_port()
    secret = tmp / "engine.secret"  # its engine's secret: tests call the engine as a gateway
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    srv = start_server(tmp, "--model", str(default_model_dir), "--rules", str(rules),
                       "--luts", str(tmp / "luts"), "--metrics-port", str(metrics),
                       "--http-port", str(free_port()),
                       env={**TIGHT_ENV, "FINSIEVE_ENGINE_SECRET_FILE": str(secret)})
    yield TightServer(srv, rules, f"http://127.0.0.1:{metrics}/metrics")
    srv.stop()


@pytest.fixture(scope="session")
def console_trail(server: Server) -> dict[str, str]:
    """Real requests on the session server for the console's tests, from a user of their
    own: an answer whose promised returns the rules stopped (a rollback), and a message
    holding a card number (redacted). Their audit ids, by name."""
    from support.console import answered

    return answered(server)


@pytest.fixture
def chromium():
    """Debian's Chromium (`make chromium` installs it), driven by Playwright: nothing
    downloads a browser; each launch gets a fresh temporary profile (--user-data-dir). Per
    test: Playwright's sync API holds an event loop while it runs, and other tests call
    asyncio.run."""
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    from playwright.sync_api import sync_playwright

    from support.browser import CHROMIUM, CHROMIUM_FLAGS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()
