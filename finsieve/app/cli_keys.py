"""`finsieve keys create|list|revoke` and `finsieve limits show|set`: the AdminService."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import json
import sys
import time
from pathlib import Path

from finsieve.app.cli_rpc import OFFICERS_TARGET, add_credential_args, call, duration_s
from finsieve.config import Settings
from finsieve.display import cell, write_csv
from finsieve.errors import ConfigError
from finsieve.v1 import admin_pb2, admin_pb2_grpc

KEY_COLUMNS = ("key_id", "tenant", "role", "name", "all_tenants", "created", "expires", "revoked")


def add_commands(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="create, list and revoke API keys (an admin key)")
    k_sub = k.add_subparsers(required=True, metavar="ACTION")
    create = k_sub.add_parser("create", help="issue a key: printed alone on stdout's first line, once")
    add_credential_args(create, OFFICERS_TARGET, "admin")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", required=True, choices=["app", "officer", "admin"])
    create.add_argument("--name", default="")
    create.add_argument("--expires", type=duration_s, default=0, metavar="DURATION",
                        help="e.g. 90d, 12h (default: never)")
    create.add_argument("--all-tenants", action="store_true",
                        help="officer or admin key acting on every tenant")
    create.add_argument("--direct", action="store_true",
                        help="break glass: write to FINSIEVE_REDIS_URL with the keys secret "
                        "file instead of calling a gateway (first admin key; audited)")
    create.set_defaults(run=_create)
    ls = k_sub.add_parser("list", help="keys, oldest first (never the keys themselves)")
    add_credential_args(ls, OFFICERS_TARGET, "admin")
    ls.add_argument("--tenant", default="")
    ls.add_argument("--all", dest="include_revoked", action="store_true", help="with revoked keys")
    ls.add_argument("--format", choices=["table", "jsonl", "csv"], default="table")
    ls.set_defaults(run=_list)
    rv = k_sub.add_parser("revoke", help="revoke a key by id (every gateway within FINSIEVE_KEY_CACHE_S)")
    add_credential_args(rv, OFFICERS_TARGET, "admin")
    rv.add_argument("key_id")
    rv.set_defaults(run=_revoke)

    lim = sub.add_parser("limits", help="show or set a tenant's limits (an admin key)")
    l_sub = lim.add_subparsers(required=True, metavar="ACTION")
    show = l_sub.add_parser("show", help="the limits in force for a tenant")
    add_credential_args(show, OFFICERS_TARGET, "admin")
    show.add_argument("tenant")
    show.set_defaults(run=_limits_show)
    st = l_sub.add_parser("set", help="override limits for a tenant (0 = unlimited)")
    add_credential_args(st, OFFICERS_TARGET, "admin")
    st.add_argument("tenant")
    st.add_argument("--requests-per-s", type=float)
    st.add_argument("--tokens-per-min", type=int)
    st.add_argument("--concurrent-streams", type=int)
    st.set_defaults(run=_limits_set)


def _when(ms: int) -> str:
    if not ms:
        return ""
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


def _created(key: str, info: admin_pb2.KeyInfo) -> int:
    print(key, flush=True)
    print(f"created key {info.key_id}: tenant {cell(info.tenant)}, role {info.role}, expires "
          f"{_when(info.expires_ms) or 'never'}{', all tenants' if info.all_tenants else ''}",
          file=sys.stderr)
    return 0


def _create(args: argparse.Namespace) -> int:
    if args.direct:
        return asyncio.run(_create_direct(args))

    async def fn(stub) -> int:
        reply = await stub.CreateKey(admin_pb2.CreateKeyRequest(
            tenant=args.tenant, role=args.role, name=args.name, expires_in_s=args.expires,
            all_tenants=args.all_tenants))
        return _created(reply.key, reply.info)

    return call(args, "finsieve keys", admin_pb2_grpc.AdminServiceStub, fn)


async def _create_direct(args: argparse.Namespace) -> int:
    """The first admin key of a deployment on an external Redis, where no admin key exists
    yet to call the AdminService with. Needs what a gateway needs: the Redis URL, the keys
    secret and the audit key (existing files: this never makes new ones)."""
    from finsieve.secretfiles import read_secret
    from finsieve.valkey import connect
    from gateway.admin_service import key_event
    from gateway.audit import AuditLog
    from gateway.keys import KeyStore, new_key_problem

    settings = Settings.load({"state_dir": args.state_dir})
    if not settings.redis_url:
        raise ConfigError("--direct: set FINSIEVE_REDIS_URL or FINSIEVE_REDIS_URL_FILE (with the "
                          "embedded default, use the development admin key instead)")
    if problem := new_key_problem(args.tenant, args.role, args.name, args.expires, args.all_tenants):
        raise ConfigError(f"--{problem[0].replace('_', '-')}: {problem[1]}")
    keys_secret = read_secret(Path(settings.keys_secret_file or settings.state_path / "keys.secret"),
                              "FINSIEVE_KEYS_SECRET_FILE")
    audit_key = read_secret(Path(settings.audit_key_file or settings.state_path / "audit.key"),
                            "FINSIEVE_AUDIT_KEY_FILE")
    client = await connect(settings.redis_url)
    try:
        keys = KeyStore(client, keys_secret)
        expires_ms = int(time.time() * 1000) + args.expires * 1000 if args.expires else 0
        by = f"cli --direct ({getpass.getuser()})"
        key, info = await keys.create(args.tenant, args.role, args.name, expires_ms,
                                      args.all_tenants, created_by=by)
        # Acknowledged as a gateway's are (WAIT or WAITAOF); no spool: nothing runs later to
        # restore from it, and a refused record revokes the key.
        audit = AuditLog(client, audit_key, wait_replicas=settings.audit_wait_replicas,
                         waitaof_local=settings.audit_waitaof_local,
                         wait_timeout_ms=settings.audit_wait_timeout_ms)
        try:
            await audit.append("admin", {**key_event("key_created", info), "by": by})
        except BaseException:
            await keys.revoke(info.key_id)  # no usable key without its record
            raise
        finally:
            await audit.aclose()
    finally:
        await client.aclose()
    return _created(key, admin_pb2.KeyInfo(**info.__dict__))


def _list(args: argparse.Namespace) -> int:
    async def fn(stub) -> int:
        token, rows = "", []
        while True:
            page = await stub.ListKeys(admin_pb2.ListKeysRequest(
                tenant=args.tenant, include_revoked=args.include_revoked, page_size=1000,
                page_token=token))
            rows += [{"key_id": k.key_id, "tenant": k.tenant, "role": k.role, "name": k.name,
                      "all_tenants": k.all_tenants, "created": _when(k.created_ms),
                      "expires": _when(k.expires_ms), "revoked": _when(k.revoked_ms)}
                     for k in page.keys]
            if not (token := page.next_page_token):
                break
        if args.format == "jsonl":
            for r in rows:
                print(json.dumps(r, ensure_ascii=False))
        elif args.format == "csv":
            write_csv(sys.stdout, KEY_COLUMNS, rows)
        else:
            print_table(KEY_COLUMNS, rows)
        return 0

    return call(args, "finsieve keys", admin_pb2_grpc.AdminServiceStub, fn)


def print_table(columns: tuple[str, ...], rows: list[dict]) -> None:
    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    for row in [list(columns), *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _revoke(args: argparse.Namespace) -> int:
    async def fn(stub) -> int:
        info = await stub.RevokeKey(admin_pb2.RevokeKeyRequest(key_id=args.key_id))
        print(f"revoked key {info.key_id} (tenant {cell(info.tenant)}, role {info.role}) at "
              f"{_when(info.revoked_ms)}")
        return 0

    return call(args, "finsieve keys", admin_pb2_grpc.AdminServiceStub, fn)


def _print_limits(limits: admin_pb2.TenantLimits) -> None:
    print(f"tenant {cell(limits.tenant)}: requests_per_s {limits.requests_per_s:g}, "
          f"tokens_per_min {limits.tokens_per_min}, concurrent_streams "
          f"{limits.concurrent_streams} (0 = unlimited)")


def _limits_show(args: argparse.Namespace) -> int:
    async def fn(stub) -> int:
        _print_limits(await stub.GetTenantLimits(
            admin_pb2.GetTenantLimitsRequest(tenant=args.tenant)))
        return 0

    return call(args, "finsieve limits", admin_pb2_grpc.AdminServiceStub, fn)


def _limits_set(args: argparse.Namespace) -> int:
    values = {k: getattr(args, k) for k in ("requests_per_s", "tokens_per_min", "concurrent_streams")
              if getattr(args, k) is not None}

    async def fn(stub) -> int:
        _print_limits(await stub.SetTenantLimits(
            admin_pb2.TenantLimits(tenant=args.tenant, **values)))
        return 0

    return call(args, "finsieve limits", admin_pb2_grpc.AdminServiceStub, fn)
