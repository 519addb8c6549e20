"""Privileged calls leave a trace first: every admin action and officer read is an audit
record (who, what, when; never a key). No record, no action: these calls fail closed."""

from __future__ import annotations

from typing import Any

import grpc
import structlog

from finsieve.auth import Principal

from .audit import AuditError, AuditLog

log = structlog.get_logger(__name__)


async def record(audit: AuditLog, context: grpc.aio.ServicerContext, kind: str, who: Principal,
                 body: dict[str, Any]) -> int:
    """Append an `admin` or `access` record naming the caller; abort UNAVAILABLE if it
    cannot be written. `tenant` in body is the tenant acted on (indexed for queries)."""
    try:
        return await audit.append(kind, {"by": who.key_id, "by_tenant": who.tenant,
                                         "by_role": who.role, **body})
    except AuditError as e:
        log.error("audit trail unavailable; privileged call refused", event=body.get("event"),
                  error=str(e))
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "the audit trail is unavailable; nothing was done")
        raise  # not reached: abort raises
