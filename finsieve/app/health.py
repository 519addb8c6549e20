"""`finsieve health`: one question to a listener's gRPC health service (grpc.health.v1).

For container health checks and Kubernetes exec probes: the kubelet's own gRPC probe speaks
no TLS, and every finsieve listener beyond loopback serves TLS. Run inside the container
against its own port, with the pod's CA (and, where the listener requires mTLS, a certificate
it signed). `python -m finsieve.app.health` runs it without loading the rest of the command
(half the CPU time a probe costs).

Exit status: 0 SERVING (with --any-status: any answer at all), 1 anything else (NOT_SERVING,
no answer in time, refused), 2 bad arguments or unreadable certificate files.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from finsieve.app.client import CredentialError, transport_credentials
from finsieve.grpc_server import CHANNEL_OPTIONS

SERVING = health_pb2.HealthCheckResponse.SERVING


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="the listener: public port, an engine's port (default %(default)s)")
    p.add_argument("--service", default="", metavar="NAME",
                   help="a service's own status, e.g. finsieve.v1.Engine (default: the server's)")
    p.add_argument("--tls-ca", default="", metavar="PEM",
                   help="connect with TLS, verifying the server against this CA")
    p.add_argument("--tls-cert", default="", metavar="PEM",
                   help="client certificate, for a listener that requires mTLS")
    p.add_argument("--tls-key", default="", metavar="PEM", help="its private key")
    p.add_argument("--tls-server-name", default="", metavar="NAME",
                   help="the name the server's certificate carries, when --target is an "
                   "address it does not (127.0.0.1 inside a pod)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS",
                   help="give up after this long (default %(default)s)")
    p.add_argument("--any-status", action="store_true",
                   help="exit 0 on any answer, NOT_SERVING too (a liveness probe: the process "
                   "answers while it drains or while the audit trail is down)")


def run(args: argparse.Namespace) -> int:
    try:
        credentials = transport_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except CredentialError as e:
        print(f"finsieve health: {e}", file=sys.stderr)
        return 2
    options = list(CHANNEL_OPTIONS)
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))

    async def check() -> int:
        async with credentials.channel(args.target, options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # types-grpcio-health-checking declares none of the stub's methods (set in __init__)
            reply = await stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
            return reply.status

    try:
        status = asyncio.run(check())
    except grpc.aio.AioRpcError as e:
        # gRPC's own words (e.g. which name the certificate lacks): no secret, and bounded.
        print(f"finsieve health: {args.target}: {e.code().name}: {(e.details() or '')[:300]}",
              file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    if status == SERVING or args.any_status:
        print(name)
        return 0
    print(f"finsieve health: {args.target}: {name}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finsieve health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
