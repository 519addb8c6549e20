"""AuditService: what compliance officers call to query, read, verify and export records."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from finsieve.auth import caller
from finsieve.v1 import audit_pb2, audit_pb2_grpc

from .access import record
from .audit import AuditLog, Filters

MAX_PAGE = 1000


async def abort_invalid(context: grpc.aio.ServicerContext, field: str, message: str) -> None:
    """INVALID_ARGUMENT with a google.rpc.BadRequest naming the field."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=f"{field}: {message}",
                               details=[detail])
    await context.abort_with_status(rpc_status.to_status(status))


def _record(rec: dict) -> audit_pb2.AuditRecord:
    return audit_pb2.AuditRecord(seq=rec["seq"], json=json.dumps(rec, ensure_ascii=False, sort_keys=True))


class AuditService(audit_pb2_grpc.AuditServiceServicer):
    def __init__(self, log: AuditLog) -> None:
        self.log = log

    async def _filters(self, q: audit_pb2.AuditQuery, context: grpc.aio.ServicerContext) -> Filters:
        if q.since_ms < 0:
            await abort_invalid(context, "since_ms", "must not be negative")
        if q.until_ms and q.until_ms < q.since_ms:
            await abort_invalid(context, "until_ms", "must not be before since_ms")
        officer, tenant = caller(), q.tenant
        if not officer.all_tenants:  # an officer reads its own tenant's records only
            if tenant and tenant != officer.tenant:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "permission denied")
            tenant = officer.tenant
        return Filters(q.since_ms, q.until_ms, tenant, q.user, q.rule_id, q.action,
                       q.finish_reason.upper().removeprefix("FINISH_REASON_"), q.request_id)

    async def _read(self, context: grpc.aio.ServicerContext, event: str, tenant: str,
                    details: dict) -> None:
        """Every officer read is an audit record before anything is read."""
        await record(self.log, context, "access", caller(),
                     {"event": event, "tenant": tenant, **details})

    async def Query(self, request: audit_pb2.AuditQuery,
                    context: grpc.aio.ServicerContext) -> audit_pb2.AuditPage:
        filters = await self._filters(request, context)
        if not 0 <= request.page_size <= MAX_PAGE:
            await abort_invalid(context, "page_size", f"must be between 1 and {MAX_PAGE} (0 = 50)")
        offset = 0
        if request.page_token:
            if not request.page_token.isdigit():
                await abort_invalid(context, "page_token", "not a token from a previous page")
            offset = int(request.page_token)
        await self._read(context, "audit_query", filters.tenant, {"filters": asdict(filters)})
        records, next_offset = await self.log.query(filters, request.page_size or 50, offset)
        return audit_pb2.AuditPage(records=[_record(r) for r in records],
                                   next_page_token="" if next_offset is None else str(next_offset))

    async def Get(self, request: audit_pb2.AuditGetRequest,
                  context: grpc.aio.ServicerContext) -> audit_pb2.AuditRecord:
        officer = caller()
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
        if request.until_ms and request.until_ms < request.since_ms:
            await abort_invalid(context, "until_ms", "must not be before since_ms")
        await self._read(context, "audit_verify", "", {"since_ms": request.since_ms,
                                                       "until_ms": request.until_ms})
        v = await self.log.verify(request.since_ms, request.until_ms)
        return audit_pb2.AuditVerifyResult(ok=v.ok, checked=v.checked, first_bad_seq=v.first_bad_seq,
                                           reason=v.reason)

    async def Export(self, request: audit_pb2.AuditQuery,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[audit_pb2.AuditRecord]:
        filters = await self._filters(request, context)
        await self._read(context, "audit_export", filters.tenant, {"filters": asdict(filters)})
        async for rec in self.log.export(filters):
            yield _record(rec)
