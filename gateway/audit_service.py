"""AuditService: what compliance officers call to query, read, verify and export records.

It runs in the officers' process (`officers.py`), so reading and parsing large records
never competes with chat streams for the gateway's event loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from finsieve.auth import caller
from finsieve.policy.schema import _ID as RULE_ID
from finsieve.policy.schema import ACTIONS
from finsieve.v1 import audit_pb2, audit_pb2_grpc, chat_pb2

from .access import record
from .anchors import Anchor, AnchorError, read_anchor
from .audit import AuditLog, Cursor, Filters, id_hash, stored
from .audit_verify import verify
from .keys import TENANT_RE
from .sensitive import canonical_value, value_hash

MAX_PAGE = 1000
MAX_ANCHORS = 10_000
EXPORT_PAGE = 500
# The largest record seq or audit id an officer may name: the largest integer JSON carries
# exactly (far past any chain's length).
MAX_SEQ = 2**53 - 1
FINISH_REASONS = tuple(n.removeprefix("FINISH_REASON_")
                       for n in chat_pb2.FinishReason.DESCRIPTOR.values_by_name
                       if n != "FINISH_REASON_UNSPECIFIED")
# A value an officer types with this many digits or more (a card number has 13 to 19) is
# recorded in its access record by its keyed hash, never as typed: an id of the right
# syntax can still be a card number, and no typed value may put one in the trail.
HASHED_FROM_DIGITS = 13
TYPED = ("tenant", "rule_id", "audit_id", "record_seq")  # typed by officers, checked by syntax


async def abort_invalid(context: grpc.aio.ServicerContext, field: str, message: str) -> None:
    """INVALID_ARGUMENT with a google.rpc.BadRequest naming the field."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=f"{field}: {message}",
                               details=[detail])
    await context.abort_with_status(rpc_status.to_status(status))


def typed(key: bytes, body: dict[str, Any], hashes: set[str]) -> dict[str, Any]:
    """`body` as an access record holds what an officer typed (see `AuditService._read`):
    a value of a TYPED field that could be a card number becomes its keyed hash (added to
    `hashes`). Times are the server's own checks' business; user, request id and match are
    keyed hashes already."""
    out: dict[str, Any] = {}
    for k, v in body.items():
        if isinstance(v, dict):
            v = typed(key, v, hashes)
        elif k in TYPED and sum(c.isdigit() for c in str(v)) >= HASHED_FROM_DIGITS:
            h = value_hash(key, str(v))
            hashes.add(h)
            v = f"[hash:{h}]"
        out[k] = v
    return out


def _record(rec: dict) -> audit_pb2.AuditRecord:
    return audit_pb2.AuditRecord(seq=rec["seq"], json=stored(rec))


class AuditService(audit_pb2_grpc.AuditServiceServicer):
    def __init__(self, log: AuditLog, anchor_dir: Path, page_bytes: int = 4 << 20) -> None:
        self.log = log
        self.anchor_dir = anchor_dir
        self.page_bytes = page_bytes

    async def _filters(self, q: audit_pb2.AuditQuery, context: grpc.aio.ServicerContext) -> Filters:
        if q.since_ms < 0:
            await abort_invalid(context, "since_ms", "must not be negative")
        if q.until_ms and q.until_ms < q.since_ms:
            await abort_invalid(context, "until_ms", "must not be before since_ms")
        if q.match and not canonical_value(q.match):
            await abort_invalid(context, "match", "has no letter or digit to look for")
        # The digits of a seq as the trail writes them: no leading zero (which could pad a
        # card number past a range check into an index key name), at most MAX_SEQ.
        if q.audit_id and not (q.audit_id.isascii() and q.audit_id.isdigit()
                               and q.audit_id[0] != "0" and len(q.audit_id) <= len(str(MAX_SEQ))
                               and int(q.audit_id) <= MAX_SEQ):
            await abort_invalid(context, "audit_id", "not an audit id (the digits of Finished.audit_id, "
                                f"1 to {MAX_SEQ})")
        if q.tenant and not TENANT_RE.match(q.tenant):
            await abort_invalid(context, "tenant", "not a tenant id (1-64 letters, digits, '.', '_' or '-')")
        if q.rule_id and not RULE_ID.match(q.rule_id):
            await abort_invalid(context, "rule_id", "not a rule id (1-100 lowercase letters, digits, "
                                "'.', '_' or '-')")
        action = q.action.lower()
        if action and action not in ACTIONS:
            await abort_invalid(context, "action", f"one of {', '.join(ACTIONS)}")
        finish_reason = q.finish_reason.upper().removeprefix("FINISH_REASON_")
        if finish_reason and finish_reason not in FINISH_REASONS:
            await abort_invalid(context, "finish_reason", f"one of {', '.join(FINISH_REASONS)}")
        officer, tenant = caller(), q.tenant
        if not officer.all_tenants:  # an officer reads its own tenant's records only
            if tenant and tenant != officer.tenant:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "permission denied")
            tenant = officer.tenant
        # User and request ids are indexed (and recorded in the access record) by keyed hash.
        user = id_hash(self.log.key, "user", q.user) if q.user else ""
        request_id = id_hash(self.log.key, "request_id", q.request_id) if q.request_id else ""
        return Filters(q.since_ms, q.until_ms, tenant, user, q.rule_id, action, finish_reason,
                       request_id, q.audit_id, value_hash(self.log.key, q.match) if q.match else "")

    async def _read(self, context: grpc.aio.ServicerContext, event: str, tenant: str,
                    details: dict) -> None:
        """Every officer read is an audit record before anything is read. What the officer
        typed is in it, except a value that could be a card number: its keyed hash
        (`[hash:…]`, found by `--match`) stands for it, in the record and in its index keys.
        Reading an index never writes one: only this record's own indexes are written."""
        hashes: set[str] = set()
        body = {"event": event, "tenant": tenant, **details}
        body = typed(self.log.key, body, hashes)
        if hashes:
            body["match_hashes"] = sorted(hashes)
        await record(self.log, context, "access", caller(), body)

    async def Query(self, request: audit_pb2.AuditQuery,
                    context: grpc.aio.ServicerContext) -> audit_pb2.AuditPage:
        filters = await self._filters(request, context)
        if not 0 <= request.page_size <= MAX_PAGE:
            await abort_invalid(context, "page_size", f"must be between 1 and {MAX_PAGE} (0 = 50)")
        cursor = None
        if request.page_token:
            cursor = Cursor.parse(request.page_token)
            if cursor is None:
                await abort_invalid(context, "page_token", "not a token from a previous page")
        await self._read(context, "audit_query", filters.tenant, {"filters": asdict(filters)})
        records, following = await self.log.query(filters, request.page_size or 50, cursor,
                                                  self.page_bytes)
        return audit_pb2.AuditPage(records=[_record(r) for r in records],
                                   next_page_token=following.token() if following else "")

    async def Get(self, request: audit_pb2.AuditGetRequest,
                  context: grpc.aio.ServicerContext) -> audit_pb2.AuditRecord:
        officer = caller()
        if not 0 < request.seq <= MAX_SEQ:
            await abort_invalid(context, "seq", f"not a record seq (1 to {MAX_SEQ})")
        await self._read(context, "audit_get", "" if officer.all_tenants else officer.tenant,
                         {"record_seq": request.seq})
        rec = await self.log.get(request.seq)
        if rec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"seq: no audit record {request.seq}")
        if not officer.may_see(rec.get("tenant", "")):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "permission denied")
        return _record(rec)

    async def Verify(self, request: audit_pb2.AuditVerifyRequest,
                     context: grpc.aio.ServicerContext) -> audit_pb2.AuditVerifyResult:
        # The whole chain, every tenant's records: its counts and index keys are not for an
        # officer of one tenant.
        if not caller().all_tenants:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "permission denied")
        if request.until_ms and request.until_ms < request.since_ms:
            await abort_invalid(context, "until_ms", "must not be before since_ms")
        await self._read(context, "audit_verify", "", {"since_ms": request.since_ms,
                                                       "until_ms": request.until_ms})
        if len(request.anchors) > MAX_ANCHORS:
            await abort_invalid(context, "anchors", f"at most {MAX_ANCHORS} (send the newest)")
        anchors: list[Anchor] = []
        for i, line in enumerate(request.anchors):
            try:
                anchors.append(read_anchor(self.log.key, json.loads(line), f"anchors[{i}]"))
            except AnchorError as e:
                await abort_invalid(context, f"anchors[{i}]", e.reason)
            except ValueError:
                await abort_invalid(context, f"anchors[{i}]", "not JSON")
        v = await verify(self.log, request.since_ms, request.until_ms, anchors, self.anchor_dir)
        a = v.anchor
        return audit_pb2.AuditVerifyResult(
            ok=v.ok, checked=v.checked, first_bad_seq=v.first_bad_seq, reason=v.reason,
            anchor_seq=a.seq if a else 0, anchor_ts_ms=a.ts_ms if a else 0,
            anchor_writer=a.writer if a else "", restored=v.restored)

    async def Export(self, request: audit_pb2.AuditQuery,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[audit_pb2.AuditPage]:
        filters = await self._filters(request, context)
        await self._read(context, "audit_export", filters.tenant, {"filters": asdict(filters)})
        async for page in self.log.export(filters, EXPORT_PAGE, self.page_bytes):
            yield audit_pb2.AuditPage(records=[_record(r) for r in page])
