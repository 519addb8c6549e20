"""What the client commands share: credential flags, one authenticated call, durations."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from finsieve.app.client import Credentials, resolve_credentials, transport_credentials

OFFICERS_TARGET = "127.0.0.1:50053"
Call = Callable[[Any], Awaitable[int]]


def add_credential_args(p: argparse.ArgumentParser, target: str, role: str) -> None:
    p.add_argument("--target", default=target, metavar="HOST:PORT")
    p.add_argument("--key-file", default="", metavar="FILE",
                   help=f"file holding an {role} API key (else FINSIEVE_API_KEY, else for a "
                   f"loopback target <state dir>/keys/{role}.key)")
    p.add_argument("--state-dir", default=os.environ.get("FINSIEVE_STATE_DIR", ".finsieve"),
                   metavar="DIR", help="where a local `serve` keeps its development keys")
    p.add_argument("--tls-ca", default="", metavar="PEM",
                   help="connect with TLS, verifying the server against this CA")
    p.add_argument("--tls-cert", default="", metavar="PEM", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", metavar="PEM", help="its private key")
    p.set_defaults(credential_role=role)


def credentials(args: argparse.Namespace) -> Credentials:
    return resolve_credentials(args.target, args.credential_role, key_file=args.key_file,
                               state_dir=args.state_dir, tls_ca=args.tls_ca,
                               tls_cert=args.tls_cert, tls_key=args.tls_key)


def transport(args: argparse.Namespace) -> Credentials:
    return transport_credentials(args.tls_ca, args.tls_cert, args.tls_key)


def call(args: argparse.Namespace, prog: str, stub_class: type, fn: Call) -> int:
    """Run fn(stub) on an authenticated channel; a gRPC error is one line, exit 1."""
    creds = credentials(args)

    async def run() -> int:
        async with creds.channel(args.target) as channel:
            return await fn(stub_class(channel))

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        print(f"{prog}: {args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def duration_s(text: str) -> int:
    """90s, 30m, 12h, 90d as seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].isdigit() and int(text[:-1]) > 0:
        return int(text[:-1]) * units[text[-1]]
    raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 3600s, 30m, 12h, 90d")
