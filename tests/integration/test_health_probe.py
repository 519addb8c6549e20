"""`finsieve health`, the probe of deploy/ (Docker HEALTHCHECK, compose, Kubernetes exec
probes), against a real TLS listener: its exit status is what a kubelet acts on."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc

from finsieve.grpc_server import start_server

PROBE = [sys.executable, "-m", "finsieve.app.health", "--timeout", "5"]


async def probe(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*PROBE, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def tls(certs: Path, client_ca: bool = False) -> grpc.ServerCredentials:
    pair = ((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())
    ca = (certs / "ca.pem").read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=client_ca)


def test_the_probe_exits_0_only_while_the_listener_serves(certs):
    ca = ["--tls-ca", str(certs / "ca.pem")]

    async def main() -> None:
        running = await start_server("127.0.0.1:0", [], credentials=tls(certs))
        target = ["--target", f"127.0.0.1:{running.port}"]
        try:
            # Inside a pod the probe dials 127.0.0.1; the certificate names the service.
            assert await probe(*target, *ca) == (0, "SERVING\n")
            assert (await probe(*target, *ca, "--tls-server-name", "localhost"))[0] == 0
            code, out = await probe(*target, *ca, "--tls-server-name", "engines.finsieve.svc")
            assert code == 1 and "UNAVAILABLE" in out
            code, out = await probe(*target)  # plaintext to a TLS port
            assert code == 1 and "UNAVAILABLE" in out
            await running.set_serving(False)  # draining, or the audit trail refuses records
            code, out = await probe(*target, *ca)
            assert code == 1 and "NOT_SERVING" in out
            assert await probe(*target, *ca, "--any-status") == (0, "NOT_SERVING\n")
        finally:
            await running.server.stop(None)
        code, out = await probe(*target, *ca, "--any-status")  # nothing listens: dead
        assert code == 1 and "UNAVAILABLE" in out

    asyncio.run(main())


def test_a_listener_that_requires_mtls_is_probed_with_a_certificate(certs):
    ca = ["--tls-ca", str(certs / "ca.pem")]
    mine = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]

    async def main() -> None:
        running = await start_server("127.0.0.1:0", [], credentials=tls(certs, client_ca=True))
        target = ["--target", f"127.0.0.1:{running.port}"]
        try:
            assert (await probe(*target, *ca))[0] == 1
            assert await probe(*target, *ca, *mine) == (0, "SERVING\n")
        finally:
            await running.server.stop(None)

    asyncio.run(main())


def test_unreadable_certificate_files_are_a_usage_error(tmp_path):
    async def main() -> None:
        code, out = await probe("--tls-ca", str(tmp_path / "missing.pem"))
        assert code == 2 and "--tls-ca" in out and "cannot read" in out

    asyncio.run(main())
