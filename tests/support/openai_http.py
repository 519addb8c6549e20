"""Clients of a real server's OpenAI-compatible endpoint: the official `openai` library,
`curl -N`, httpx, and raw sockets for what no well-behaved client sends."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from urllib.parse import urlsplit

from finsieve.app.client import Credentials
from finsieve.v1 import admin_pb2, admin_pb2_grpc, audit_pb2, audit_pb2_grpc

from support.servers import dev_key

MODEL = "SmolLM2-135M-Instruct"


def client(base_url: str, key: str, **kw):
    """The official client, without its retries: a refusal is what the test looks at."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120, **kw)


def async_client(base_url: str, key: str):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def issue_key(audit_target: str, tenant: str, role: str = "app") -> str:
    """A key issued through the AdminService with the server's development admin key."""
    async def go():
        async with Credentials(dev_key(audit_target, "admin")).channel(audit_target) as ch:
            return await admin_pb2_grpc.AdminServiceStub(ch).CreateKey(
                admin_pb2.CreateKeyRequest(tenant=tenant, role=role))
    return asyncio.run(go()).key


def records(audit_target: str, request_id: str, wait_for_final: bool = True) -> list[dict]:
    """A request's audit records, read as an officer; waits (bounded) for its final record,
    which the gateway writes after the client has its answer."""
    async def query() -> list[dict]:
        async with Credentials(dev_key(audit_target, "officer")).channel(audit_target) as ch:
            page = await audit_pb2_grpc.AuditServiceStub(ch).Query(
                audit_pb2.AuditQuery(request_id=request_id, page_size=100))
        return [json.loads(r.json) for r in page.records]

    for _ in range(200):
        found = asyncio.run(query())
        if not wait_for_final or any(r["type"] == "request" for r in found):
            return found
        time.sleep(0.05)
    raise AssertionError(f"no final audit record for {request_id}: {found}")


def curl_stream(base_url: str, key: str, body: dict, *extra: str) -> list[dict | str]:
    """`curl -N` streaming a completion: each SSE data field, parsed ([DONE] as the string)."""
    out = subprocess.run(
        ["curl", "-sN", "--max-time", "120", f"{base_url}/chat/completions", "-H",
         f"Authorization: Bearer {key}", "-H", "Content-Type: application/json", "-d",
         json.dumps(body), *extra], capture_output=True, text=True, timeout=150, check=True).stdout
    return sse_data(out)


def sse_data(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def address(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def raw_exchange(base_url: str, data: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(address(base_url), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def parse_raw(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of a raw HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body
