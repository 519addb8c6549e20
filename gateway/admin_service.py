"""AdminService: `admin` keys create, list and revoke keys and set tenants' limits.

An admin acts on its own tenant; only an all-tenants admin acts on others or grants the
all-tenants privilege. Every call is an audit record first (see access.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import grpc

from finsieve.auth import Principal, caller
from finsieve.v1 import admin_pb2, admin_pb2_grpc

from .access import record
from .audit import AuditLog
from .audit_service import abort_invalid
from .keys import KEY_ID_RE, TENANT_RE, KeyInfo, KeyStore, new_key_problem
from .limits import FIELDS, Limiter, TenantLimits, checked

MAX_PAGE = 1000
DENIED = "permission denied"


def key_info(info: KeyInfo) -> admin_pb2.KeyInfo:
    return admin_pb2.KeyInfo(**asdict(info))


def key_event(event: str, info: KeyInfo) -> dict:
    """What an audit record says about a key: everything but the key itself."""
    return {"event": event, "key_id": info.key_id, "tenant": info.tenant, "role": info.role,
            "name": info.name, "expires_ms": info.expires_ms, "all_tenants": info.all_tenants}


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, keys: KeyStore, limiter: Limiter, audit: AuditLog) -> None:
        self.keys = keys
        self.limiter = limiter
        self.audit = audit

    async def _tenant(self, admin: Principal, tenant: str,
                      context: grpc.aio.ServicerContext) -> str:
        """The tenant a call acts on (empty: the admin's own), checked and permitted."""
        tenant = tenant or admin.tenant
        if not TENANT_RE.match(tenant):
            await abort_invalid(context, "tenant", "1-64 letters, digits, '.', '_' or '-'")
        if not admin.may_see(tenant):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED)
        return tenant

    async def CreateKey(self, request: admin_pb2.CreateKeyRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.CreateKeyResponse:
        admin = caller()
        tenant = request.tenant or admin.tenant
        if problem := new_key_problem(tenant, request.role, request.name, request.expires_in_s,
                                      request.all_tenants):
            await abort_invalid(context, *problem)
        tenant = await self._tenant(admin, tenant, context)
        if request.all_tenants and not admin.all_tenants:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED)
        expires_ms = (int(time.time() * 1000) + request.expires_in_s * 1000
                      if request.expires_in_s else 0)
        key, info = await self.keys.create(tenant, request.role, request.name, expires_ms,
                                           request.all_tenants, created_by=admin.key_id)
        try:
            await record(self.audit, context, "admin", admin, key_event("key_created", info))
        except BaseException:
            await self.keys.revoke(info.key_id)  # no usable key without its record
            raise
        return admin_pb2.CreateKeyResponse(key=key, info=key_info(info))

    async def ListKeys(self, request: admin_pb2.ListKeysRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.ListKeysResponse:
        admin = caller()
        if not 0 <= request.page_size <= MAX_PAGE:
            await abort_invalid(context, "page_size", f"must be between 1 and {MAX_PAGE} (0 = 100)")
        if request.page_token and not request.page_token.isdigit():
            await abort_invalid(context, "page_token", "not a token from a previous page")
        tenant = request.tenant
        if tenant or not admin.all_tenants:
            tenant = await self._tenant(admin, tenant, context)
        await record(self.audit, context, "admin", admin,
                     {"event": "keys_listed", "tenant": tenant,
                      "include_revoked": request.include_revoked})
        keys, next_offset = await self.keys.list(tenant, request.include_revoked,
                                                 int(request.page_token or 0),
                                                 request.page_size or 100)
        return admin_pb2.ListKeysResponse(
            keys=[key_info(k) for k in keys],
            next_page_token="" if next_offset is None else str(next_offset))

    async def RevokeKey(self, request: admin_pb2.RevokeKeyRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.KeyInfo:
        admin = caller()
        if not KEY_ID_RE.match(request.key_id):
            await abort_invalid(context, "key_id", "16 hexadecimal digits (see `keys list`)")
        info = await self.keys.get(request.key_id)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"key_id: no key {request.key_id}")
        # A key that reaches every tenant is revoked only by an admin who does too.
        if not admin.may_see(info.tenant) or (info.all_tenants and not admin.all_tenants):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED)
        await record(self.audit, context, "admin", admin, key_event("key_revoked", info))
        return key_info(await self.keys.revoke(request.key_id) or info)

    async def SetTenantLimits(self, request: admin_pb2.TenantLimits,
                              context: grpc.aio.ServicerContext) -> admin_pb2.TenantLimits:
        admin = caller()
        tenant = await self._tenant(admin, request.tenant, context)
        values = {}
        for name in FIELDS:
            if request.HasField(name):
                try:
                    values[name] = checked(name, getattr(request, name))
                except ValueError as e:
                    await abort_invalid(context, name, str(e))
        if not values:
            await abort_invalid(context, "requests_per_s", "set at least one limit")
        await record(self.audit, context, "admin", admin,
                     {"event": "tenant_limits_set", "tenant": tenant, "limits": values})
        return _limits(tenant, await self.limiter.set_overrides(tenant, values))

    async def GetTenantLimits(self, request: admin_pb2.GetTenantLimitsRequest,
                              context: grpc.aio.ServicerContext) -> admin_pb2.TenantLimits:
        admin = caller()
        tenant = await self._tenant(admin, request.tenant, context)
        await record(self.audit, context, "admin", admin,
                     {"event": "tenant_limits_read", "tenant": tenant})
        return _limits(tenant, await self.limiter.limits(tenant))


def _limits(tenant: str, limits: TenantLimits) -> admin_pb2.TenantLimits:
    return admin_pb2.TenantLimits(tenant=tenant, **asdict(limits))
