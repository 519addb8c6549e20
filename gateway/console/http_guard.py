"""What every console response carries and every request is held to, as ASGI middleware
(plain ASGI, so a streamed export is not buffered):

- security headers: a CSP allowing this origin's own files only (no inline script or
  style, no framing, forms posting only here), HSTS, nosniff, no referrer, no caching
  (pages hold conversations), no cross-origin window access;
- a request body of at most `max_body` bytes (a draft rule pack is the largest), counted
  as it arrives, whatever Content-Length says, and whole within `read_timeout_s` (a body
  that stops arriving would hold one of the console's few connections for ever: 408);
- a POST that its browser says came from another site is refused before any handler runs
  (defence in depth: the session cookie is SameSite=Strict and the handlers check the CSRF
  token of every form).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADERS = [
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; form-action 'self'; "
                                 b"base-uri 'none'; object-src 'none'"),
    (b"strict-transport-security", b"max-age=31536000; includeSubDomains"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), payment=()"),
]


async def _refuse(send: Send, status: int, text: str, close: bool = False) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *HEADERS,
                            *([(b"connection", b"close")] if close else [])]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: ASGIApp, max_body: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if scope["method"] == "POST" and not _same_origin(headers, scope):
            await _refuse(send, 403, "refused: this form was sent from another site")
            return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            await _refuse(send, 413, f"refused: a request body of at most {self.max_body} bytes")
            return
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s

        async def bounded() -> Message:
            nonlocal received, complete
            if complete:  # after the body: a wait for the client's disconnect, unbounded
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimedOut from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_body:
                    raise BodyTooLarge
            return message

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        try:
            await self.app(scope, bounded, with_headers)
        except BodyTooLarge:
            await _refuse(send, 413, f"refused: a request body of at most {self.max_body} bytes")
        except BodyTimedOut:
            await _refuse(send, 408, f"refused: the request body did not arrive within "
                          f"{self.read_timeout_s:g} s", close=True)


class BodyTooLarge(Exception):
    pass


class BodyTimedOut(Exception):
    pass


def _same_origin(headers: dict[bytes, bytes], scope: Scope) -> bool:
    """A browser says where a form came from: Fetch Metadata (`Sec-Fetch-Site`, sent by
    current browsers to https and localhost), and Origin (`null` under this console's
    no-referrer policy, so only another origin's name refuses). A client that sends
    neither is no browser, and cannot carry the SameSite=Strict session cookie by accident."""
    site = headers.get(b"sec-fetch-site")
    if site is not None and site != b"same-origin":
        return False
    origin = headers.get(b"origin")
    if origin is None or origin == b"null":
        return True
    return origin == scope.get("scheme", "http").encode() + b"://" + headers.get(b"host", b"")
