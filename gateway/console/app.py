"""The console's pages: an ASGI app (Starlette) rendering server-side templates (Jinja2).

Every page needs a live officer session (`sessions.py`); every page view and export is an
access record written before anything is read, so a trail that cannot be written shows
nothing (503). GET never changes anything but that record; decisions, holds, login and
logout are POSTs, each with the session's CSRF token. An officer reads its own tenant's
records unless its key has the all-tenants grant, which also shows everyone's reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime as dt
import gc
import io
import json
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import jinja2
import structlog
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from finsieve.auth import CheckUnavailable, Unauthenticated
from finsieve.config import Settings
from finsieve.display import cell, visible
from finsieve.policy.reload import PolicyHolder
from finsieve.policy.schema import ACTIONS
from finsieve.policy.sources import PackLimits
from finsieve.valkey import ERRORS

from ..access import stamped
from ..audit import AuditError, AuditLog, Filters, index_key, parse, record_key, stored
from ..audit_service import FINISH_REASONS, MAX_SEQ, typed
from ..keys import KeyStore
from ..rules import GatewayPolicy
from . import conversation, holds, package, rescan, reviews, rulebook, trail
from .chain import status_of
from .forms import (
    PAGE_SIZES,
    SEARCH_FIELDS,
    Form,
    cursor,
    page_size,
    parse_time,
    search_filters,
    tenant_scope,
    time_range,
)
from .forms import typed_values as form_of
from .http_guard import Guard
from .sessions import LOGIN_COOKIE, ROLE, SESSION_COOKIE, Session, Sessions, cookie_header

log = structlog.get_logger(__name__)
# The trail, the key store or Redis cannot be read or written: the page says so (503).
TRAIL_DOWN: tuple[type[Exception], ...] = (AuditError, CheckUnavailable, *ERRORS)

HERE = Path(__file__).parent
FLAGGED_ACTIONS = ACTIONS  # a conversation any rule acted in is flagged for review
QUEUE_PAGE = 100
HISTORY_PAGE = 100
PAGE_BYTES = 256 << 20  # record bytes one page of the console reads (10,000 rows: ~30 MB)
LOGIN_FORM_S = 900
CSV_COLUMNS = ("seq", "audit_id", "time", "tenant", "user", "request_id", "rules", "finish_reason",
               "cache_hit", "review")


@dataclass
class Console:
    settings: Settings
    audit: AuditLog
    keys: KeyStore
    sessions: Sessions
    anchor_dir: Path
    rules: PolicyHolder[GatewayPolicy] | None

    def protect(self, text: str, hashes: set[str]) -> str:
        """Text an officer types that the trail will hold, masked as the rules say."""
        return self.rules.current.sensitive.text(text, hashes) if self.rules else text

    def deadline(self) -> float:
        return time.monotonic() + self.settings.console_query_s


class Problem(Exception):
    """A page that cannot be shown: status and what the officer is told."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def iso(ms: int | None) -> str:
    if not ms:
        return ""
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def environment() -> jinja2.Environment:
    # Records are JSON from the trail: a field a record lacks renders empty.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["iso"] = iso
    env.filters["visible"] = visible
    return env


def build(console: Console) -> Starlette:
    pages = Pages(console, environment())
    routes = [
        Route("/", pages.home),
        Route("/login", pages.login_form, methods=["GET"]),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/search", pages.search, methods=["GET"]),
        Route("/export.csv", pages.export_csv, methods=["GET"]),
        Route("/export.jsonl", pages.export_jsonl, methods=["GET"]),
        Route("/conversation/{audit_id}", pages.conversation, methods=["GET"]),
        Route("/conversation/{audit_id}/review", pages.review, methods=["POST"]),
        Route("/queue", pages.queue, methods=["GET"]),
        Route("/rules", pages.rules, methods=["GET"]),
        Route("/history", pages.history, methods=["GET"]),
        Route("/holds", pages.holds, methods=["GET"]),
        Route("/holds", pages.place_hold, methods=["POST"]),
        Route("/holds/{seq}/release", pages.release_hold, methods=["POST"]),
        Route("/package", pages.package_form, methods=["GET"]),
        Route("/package.zip", pages.package_zip, methods=["GET"]),
        Route("/rescan", pages.rescan_form, methods=["GET"]),
        Route("/rescan", pages.rescan, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: pages.http_error,
                                                       Exception: pages.crash})
    app.add_middleware(Guard, max_body=console.settings.rules_max_bytes + (64 << 10),
                       read_timeout_s=console.settings.http_read_timeout_s)
    return app


Handler = Callable[["Pages", Request, Session], Awaitable[Response]]


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """A page of 10,000 records allocates some 300,000 objects, none of them in a reference
    cycle; as they pile up, the cycle collector walks them again and again (a third of the
    page's CPU time, measured by bench/bench_console.py). It waits until the page is built
    (at most FINSIEVE_CONSOLE_QUERY_S of reading and the rendering); reference counting frees
    everything as always. Pages built at once end with it running again: the first to pause
    it resumes it."""
    paused_here = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused_here:
            gc.enable()


def officer_page(handler: Handler) -> Callable[[Pages, Request], Awaitable[Response]]:
    """A page behind the login: no session, the login form; its problems as a page."""
    async def endpoint(self: Pages, request: Request) -> Response:
        session = None
        try:
            session = await self.session_of(request)
            if session is None:
                return RedirectResponse("/login", 303)
            with cycle_collection_paused():
                return await handler(self, request, session)
        except Problem as p:
            return self.page(request, "error.html", session, status=p.status, message=p.message)
        except TRAIL_DOWN as e:
            log.error("console page refused: the audit trail is unavailable", path=request.url.path,
                      error=type(e).__name__)
            return self.page(request, "error.html", session, status=503,
                             message="The audit trail is unavailable, so nothing was read or changed. "
                                     "Try again shortly.")
    return endpoint


class Pages:
    def __init__(self, console: Console, env: jinja2.Environment) -> None:
        self.c = console
        self.env = env

    # -- plumbing ------------------------------------------------------------------------

    def page(self, request: Request, template: str, session: Session | None, status: int = 200,
             **context: Any) -> HTMLResponse:
        html = self.env.get_template(template).render(
            officer=session.officer if session else None, csrf=session.csrf if session else "",
            path=request.url.path, **context)
        return HTMLResponse(html, status)

    async def session_of(self, request: Request) -> Session | None:
        token = request.cookies.get(SESSION_COOKIE, "")
        return await self.c.sessions.get(token) if token else None

    async def viewed(self, session: Session, event: str, tenant: str, details: dict[str, Any]) -> None:
        """The access record of a page view or export, before anything is read."""
        hashes: set[str] = set()
        body = typed(self.c.audit.key, {"event": event, "tenant": tenant, **details}, hashes)
        if hashes:
            body["match_hashes"] = sorted(hashes)
        await self.c.audit.append("access", stamped("access", session.officer, body))

    async def posted(self, request: Request, session: Session, max_part: int = 64 << 10) -> FormData:
        """A POST's form, its CSRF token checked (403 otherwise)."""
        form = await request.form(max_files=0, max_fields=32, max_part_size=max_part)
        if not session.csrf_ok(str(form.get("csrf", ""))):
            raise Problem(403, "This form has expired or did not come from this console: reload the "
                               "page and send it again.")
        return form

    async def http_error(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {404: "There is no such page.", 405: "This address does not take that method: "
                   "pages are read with GET, and changes are sent by the console's forms."
                   }.get(status, "The request was refused.")
        return self.page(request, "error.html", None, status=status, message=message)

    async def crash(self, request: Request, exc: Exception) -> Response:
        log.exception("console page failed", path=request.url.path)
        return self.page(request, "error.html", None, status=500,
                         message="Something went wrong; it was logged. Nothing was changed.")

    # -- login -----------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse("/search", 303)

    async def login_form(self, request: Request, error: str = "", status: int = 200) -> Response:
        token = secrets.token_urlsafe(32)
        response = self.page(request, "login.html", None, status=status, login_csrf=token, error=error)
        response.headers.append("set-cookie", cookie_header(LOGIN_COOKIE, token, LOGIN_FORM_S))
        return response

    async def login(self, request: Request) -> Response:
        form = await request.form(max_files=0, max_fields=8, max_part_size=4096)
        sent, expected = str(form.get("login_csrf", "")), request.cookies.get(LOGIN_COOKIE, "")
        if not expected or not secrets.compare_digest(sent.encode(), expected.encode()):
            return await self.login_form(request, "The login form expired: enter your key again.", 403)
        try:
            officer = await self.c.keys.verify(str(form.get("key", "")).strip())
        except Unauthenticated as e:
            log.info("console login refused", reason=str(e))
            return await self.login_form(request, "This is not a valid key.", 401)
        except CheckUnavailable:
            return await self.login_form(request, "Keys cannot be checked now; try again shortly.", 503)
        if officer.role != ROLE:
            log.info("console login refused: not an officer key", key_id=officer.key_id,
                     role=officer.role)
            return await self.login_form(request, "This key is not an officer key: the console is for "
                                                  "compliance officers.", 403)
        try:
            await self.c.audit.append("access", stamped("access", officer, {
                "event": "console_login", "tenant": "" if officer.all_tenants else officer.tenant}))
            token, _ = await self.c.sessions.open(officer)
        except TRAIL_DOWN:
            return await self.login_form(request, "The audit trail is unavailable, so no session was "
                                                  "opened; try again shortly.", 503)
        response = RedirectResponse("/search", 303)
        response.headers.append("set-cookie", cookie_header(SESSION_COOKIE, token,
                                                            self.c.settings.console_session_s))
        response.headers.append("set-cookie", cookie_header(LOGIN_COOKIE, "", 0))
        return response

    @officer_page
    async def logout(self, request: Request, session: Session) -> Response:
        await self.posted(request, session)
        await self.c.sessions.close(request.cookies.get(SESSION_COOKIE, ""))
        response = RedirectResponse("/login", 303)
        response.headers.append("set-cookie", cookie_header(SESSION_COOKIE, "", 0))
        return response

    # -- search and exports ------------------------------------------------------------------

    def _search_form(self, request: Request, session: Session) -> tuple[Form, Filters]:
        form = form_of(request.query_params, (*SEARCH_FIELDS, "page_size", "after"))
        return form, search_filters(form, session.officer, self.c.audit.key)

    async def _rows(self, records: list[dict[str, Any]],
                    sealed: dict[int, bool] | None = None) -> list[dict[str, Any]]:
        """Table rows: each record with its review status (and its seal, when `sealed`)."""
        ids = [trail.audit_id_of(r) for r in records]
        decided = await reviews.statuses(self.c.audit, ids)
        return [_row(rec, audit_id, status, (sealed or {}).get(rec["seq"], False))
                for rec, audit_id, status in zip(records, ids, decided, strict=True)]

    @officer_page
    async def search(self, request: Request, session: Session) -> Response:
        form, filters = self._search_form(request, session)
        size, after = page_size(form), cursor(form)
        form.values["page_size"] = str(size)  # shown selected
        result, rows = trail.Page(), []
        if not form.errors:
            await self.viewed(session, "console_search", filters.tenant,
                              {"filters": asdict(filters), "page_size": size,
                               "after": form.get("after")})
            result = await trail.read_page(self.c.audit, [filters.index()], filters, size, after,
                                           self.c.deadline(), PAGE_BYTES, trail.is_request)
            rows = await self._rows(result.records, result.sealed)
        query = {k: v for k, v in form.values.items() if v and k != "after"}
        return self.page(request, "search.html", session, status=400 if form.errors else 200,
                         form=form, rows=rows, result=result, query=query,
                         action_options=[("", "any"), *((a, a) for a in ACTIONS)],
                         finish_options=[("", "any"), *((f, f.lower()) for f in FINISH_REASONS)],
                         size_options=[(str(n), f"{n:,}") for n in PAGE_SIZES])

    async def _export_pages(self, filters: Filters, cut: list[str]) -> AsyncIterator[list[dict[str, Any]]]:
        """The search's records, newest first, a page at a time, bounded in count and time;
        when a bound stops it before the oldest, `cut` says where."""
        left, after = self.c.settings.console_export_max, None
        deadline = time.monotonic() + self.c.settings.console_query_s * 10
        while True:
            page = await trail.read_page(self.c.audit, [filters.index()], filters, min(left, 1000),
                                         after, deadline, PAGE_BYTES, trail.is_request)
            if page.records:
                yield page.records
            left -= len(page.records)
            if page.more is None:
                return
            if left <= 0 or time.monotonic() > deadline:
                cut.append(f"the export stopped at its bound (FINSIEVE_CONSOLE_EXPORT_MAX records, or "
                           f"its time) at {iso(page.more.score)}: export again with until before that")
                return
            after = page.more

    async def _export(self, request: Request, session: Session, fmt: str) -> Response:
        form, filters = self._search_form(request, session)
        if form.errors:
            raise Problem(400, "The search has errors: " + _listed(form.errors))
        await self.viewed(session, "console_export", filters.tenant,
                          {"filters": asdict(filters), "format": fmt})

        async def lines() -> AsyncIterator[bytes]:
            cut: list[str] = []
            if fmt == "csv":
                yield _csv([dict(zip(CSV_COLUMNS, CSV_COLUMNS, strict=True))])
            async for records in self._export_pages(filters, cut):
                if fmt == "csv":
                    yield _csv(_csv_row(r) for r in await self._rows(records))
                else:
                    yield "".join(stored(r) + "\n" for r in records).encode()
            for why in cut:  # never a silent end: the last line says the export is incomplete
                if fmt == "csv":
                    yield _csv([{c: why if c == "seq" else "" for c in CSV_COLUMNS}])
                else:
                    yield json.dumps({"incomplete": why}).encode() + b"\n"

        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        kind = "text/csv; charset=utf-8" if fmt == "csv" else "application/x-ndjson"
        return StreamingResponse(lines(), media_type=kind, headers={
            "content-disposition": f'attachment; filename="finsieve-search-{stamp}.{fmt}"'})

    @officer_page
    async def export_csv(self, request: Request, session: Session) -> Response:
        return await self._export(request, session, "csv")

    @officer_page
    async def export_jsonl(self, request: Request, session: Session) -> Response:
        return await self._export(request, session, "jsonl")

    # -- a conversation and its review ---------------------------------------------------------

    async def _conversation(self, session: Session, audit_id: int) -> dict[str, Any]:
        """The final record of a conversation the officer may see (404 otherwise)."""
        started = await self.c.audit.get(audit_id)
        final = started if started and started.get("type") == trail.REQUEST else None
        if started and final is None:
            members = cast("list[bytes]", await self.c.audit.redis.zrange(
                index_key("audit_id", str(audit_id)), 0, -1))
            seqs = [int(m) for m in members if m.isdigit()]
            for raw in await self.c.audit.redis.mget([record_key(s) for s in seqs]) if seqs else []:
                rec = parse(raw)
                if rec is not None and rec.get("type") == trail.REQUEST:
                    final = rec
        shown = final or started
        if shown is None or shown.get("type") not in (trail.REQUEST, "request_started") \
                or not session.officer.may_see(shown.get("tenant", "")):
            raise Problem(404, f"There is no conversation with audit id {audit_id} that you may read.")
        return shown

    @officer_page
    async def conversation(self, request: Request, session: Session) -> Response:
        audit_id = _seq(request.path_params["audit_id"])
        officer = session.officer
        await self.viewed(session, "console_conversation", "" if officer.all_tenants else officer.tenant,
                          {"audit_id": str(audit_id)})
        rec = await self._conversation(session, audit_id)
        delivered = str(rec.get("delivered", ""))
        notes = conversation.notes_of(rec.get("interventions") or [], "output")
        versions = await rulebook.timeline(self.c.audit)
        try:
            active: list[holds.Hold] | None = [h for h in await holds.holds(self.c.audit)
                                               if h.released is None and h.covers(rec)]
        except AuditError as e:
            log.error("legal holds not readable", error=str(e))
            active = None  # the page says so
        return self.page(
            request, "conversation.html", session, rec=rec, audit_id=audit_id,
            pieces=conversation.pieces(delivered, notes), notes=notes, length=len(delivered),
            input_notes=conversation.notes_of(rec.get("interventions") or [], "input"),
            chain=await status_of(self.c.audit, rec, self.c.anchor_dir),
            history=await reviews.history(self.c.audit, audit_id), decisions=reviews.DECISIONS,
            archived={v.version for v in versions}, holds=active,
            in_force=rulebook.at(versions, rec.get("ts_ms", 0)))

    @officer_page
    async def review(self, request: Request, session: Session) -> Response:
        audit_id = _seq(request.path_params["audit_id"])
        form = await self.posted(request, session)
        decision, comment = str(form.get("decision", "")), str(form.get("comment", "")).strip()
        rec = await self._conversation(session, audit_id)
        if errors := reviews.problems(decision, comment):
            raise Problem(400, "The decision was not recorded: " + _listed(errors))
        await reviews.decide(self.c.audit, session.officer, rec, audit_id, decision, comment,
                             self.c.protect)
        return RedirectResponse(f"/conversation/{audit_id}#reviews", 303)

    @officer_page
    async def queue(self, request: Request, session: Session) -> Response:
        form = form_of(request.query_params, ("since", "until", "tenant", "after"))
        since, until = time_range(form)
        filters = Filters(since, until, tenant_scope(form, session.officer))
        after = cursor(form)
        rows: list[dict[str, Any]] = []
        result = trail.Page()
        if not form.errors:
            await self.viewed(session, "console_queue", filters.tenant, {"filters": asdict(filters)})
            keys = [index_key("action", a) for a in FLAGGED_ACTIONS]
            deadline = self.c.deadline()
            while len(rows) < QUEUE_PAGE:
                result = await trail.read_page(self.c.audit, keys, filters, QUEUE_PAGE - len(rows), after,
                                               deadline, PAGE_BYTES, trail.is_request)
                rows += [r for r in await self._rows(result.records, result.sealed)
                         if r["review"] in reviews.OPEN]
                if result.more is None or result.stopped:
                    break
                after = result.more
        query = {k: v for k, v in form.values.items() if v and k != "after"}
        return self.page(request, "queue.html", session, status=400 if form.errors else 200,
                         form=form, rows=rows, result=result, query=query)

    # -- rules over time -----------------------------------------------------------------------

    @officer_page
    async def rules(self, request: Request, session: Session) -> Response:
        form = form_of(request.query_params, ("since", "until", "on", "version", "a", "b"))
        since, until = time_range(form)
        on = _date(form, "on")
        await self.viewed(session, "console_rules", "" if session.officer.all_tenants
                          else session.officer.tenant, dict(form.values))
        versions = await rulebook.timeline(self.c.audit)
        known = {v.version: v for v in versions}
        for name in ("version", "a", "b"):
            if form.get(name) and form.get(name) not in known:
                form.errors.setdefault(name, "not a policy version this trail recorded")
        ranged = rulebook.in_force(versions, since, until)
        shown = known.get(form.get("version")) or (rulebook.at(versions, on) if on else None)
        shown_rules, shown_problem = await rulebook.rules_of(self.c.audit, shown) if shown else ([], "")
        compared = None
        if known.get(form.get("a")) and known.get(form.get("b")):
            before, p1 = await rulebook.rules_of(self.c.audit, known[form.get("a")])
            after, p2 = await rulebook.rules_of(self.c.audit, known[form.get("b")])
            compared = (rulebook.diff(before, after), p1 or p2)
        rule_ids: set[str] = set()
        for v in ranged:
            rules, _ = await rulebook.rules_of(self.c.audit, v)
            rule_ids |= {r["id"] for r in rules}
        counts = await rulebook.fired(self.c.audit, sorted(rule_ids), since, until, session.officer,
                                      self.c.deadline())
        return self.page(request, "rules.html", session, status=400 if form.errors else 200,
                         form=form, versions=versions, ranged=ranged, shown=shown, on=on,
                         shown_rules=shown_rules, shown_problem=shown_problem, compared=compared,
                         counts=counts, top=max([c.records for c in counts] or [0]),
                         version_options=[(v.version, f"{v.version} (from {iso(v.from_ms)})")
                                          for v in versions])

    # -- who looked at what --------------------------------------------------------------------

    @officer_page
    async def history(self, request: Request, session: Session) -> Response:
        form = form_of(request.query_params, ("since", "until", "reader", "after"))
        since, until = time_range(form)
        officer = session.officer
        reader = form.get("reader") or officer.key_id
        if reader != officer.key_id and not officer.all_tenants:
            form.errors.setdefault("reader", "only an officer granted all tenants sees others' reads")
            reader = officer.key_id
        after = cursor(form)
        result, records = trail.Page(), []
        if not form.errors:
            await self.viewed(session, "console_history", "" if officer.all_tenants else officer.tenant,
                              {"reader": reader})
            key = index_key("kind", "read") if reader == "everyone" else index_key("reader", reader)
            result = await trail.read_page(self.c.audit, [key], Filters(since, until), HISTORY_PAGE, after,
                                           self.c.deadline(), PAGE_BYTES, None, b'"type":"access"')
            records = result.records
        query = {k: v for k, v in form.values.items() if v and k != "after"}
        return self.page(request, "history.html", session, status=400 if form.errors else 200,
                         form=form, records=records, result=result, query=query, reader=reader)

    # -- legal holds -----------------------------------------------------------------------------

    async def _holds(self, session: Session) -> list[holds.Hold]:
        return [h for h in await holds.holds(self.c.audit)
                if session.officer.all_tenants or h.tenant == session.officer.tenant]

    @officer_page
    async def holds(self, request: Request, session: Session) -> Response:
        await self.viewed(session, "console_holds", "" if session.officer.all_tenants
                          else session.officer.tenant, {})
        listed = await self._holds(session)
        return self.page(request, "holds.html", session, holds=listed, form=Form({}),
                         checkpoint=await self.c.audit.checkpoint())

    @officer_page
    async def place_hold(self, request: Request, session: Session) -> Response:
        posted = await self.posted(request, session)
        form = form_of({k: str(v) for k, v in posted.items()}, (*SEARCH_FIELDS, "case"))
        form.values["reason"] = str(posted.get("reason", "")).strip()
        filters = search_filters(form, session.officer, self.c.audit.key)
        form.errors.update(holds.problems(form.get("case"), form.get("reason"), filters.since_ms))
        if form.errors:
            listed = await self._holds(session)
            return self.page(request, "holds.html", session, status=400, holds=listed, form=form,
                             checkpoint=await self.c.audit.checkpoint())
        await holds.place(self.c.audit, session.officer, form.get("case"), form.get("reason"), filters)
        return RedirectResponse("/holds", 303)

    @officer_page
    async def release_hold(self, request: Request, session: Session) -> Response:
        posted = await self.posted(request, session)
        reason = str(posted.get("reason", "")).strip()
        seq = _seq(request.path_params["seq"])
        hold = next((h for h in await self._holds(session) if h.seq == seq and h.released is None), None)
        if hold is None:
            raise Problem(404, f"There is no active hold {seq} that you may release.")
        if not reason or len(reason) > holds.MAX_REASON:
            raise Problem(400, f"The hold was not released: give a reason of 1 to {holds.MAX_REASON} "
                               "characters.")
        await holds.release(self.c.audit, session.officer, hold, reason)
        return RedirectResponse("/holds", 303)

    # -- the regulator package -------------------------------------------------------------------

    @officer_page
    async def package_form(self, request: Request, session: Session) -> Response:
        await self.viewed(session, "console_package_form", "" if session.officer.all_tenants
                          else session.officer.tenant, {})
        return self.page(request, "package.html", session, form=Form({}))

    @officer_page
    async def package_zip(self, request: Request, session: Session) -> Response:
        form = form_of(request.query_params, ("since", "until"))
        since, until = time_range(form)
        if not since:
            form.errors.setdefault("since", "a package needs the start of its range")
        if form.errors:
            return self.page(request, "package.html", session, status=400, form=form)
        officer = session.officer
        scope = "" if officer.all_tenants else officer.tenant
        await self.viewed(session, "console_package", scope, {"since_ms": since, "until_ms": until})
        spool = tempfile.SpooledTemporaryFile(max_size=32 << 20)  # noqa: SIM115 (closed by the stream)
        try:
            built = await package.build(self.c.audit, officer, since, until, self.c.anchor_dir,
                                        self.c.settings.console_export_max,
                                        time.monotonic() + self.c.settings.console_query_s * 10, spool)
            # What was handed over, in the chain: the manifest's digest names the whole package.
            await self.viewed(session, "console_package_built", scope, {
                "first_seq": built.first, "last_seq": built.last, "records": built.records,
                "withheld": built.withheld, "manifest_sha256": built.manifest_sha256})
        except package.PackageRefused as e:
            spool.close()
            form.errors["since"] = str(e)
            return self.page(request, "package.html", session, status=400, form=form)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while data := await asyncio.to_thread(spool.read, 1 << 20):
                    yield data
            finally:
                spool.close()

        return StreamingResponse(chunks(), media_type="application/zip", headers={
            "content-disposition": f'attachment; filename="finsieve-package-{built.first}-{built.last}.zip"'})

    # -- re-scan under a draft pack ----------------------------------------------------------------

    @officer_page
    async def rescan_form(self, request: Request, session: Session) -> Response:
        await self.viewed(session, "console_rescan_form", "" if session.officer.all_tenants
                          else session.officer.tenant, {})
        return self.page(request, "rescan.html", session, form=Form({}), problems=[], result=None)

    @officer_page
    async def rescan(self, request: Request, session: Session) -> Response:
        posted = await self.posted(request, session, self.c.settings.rules_max_bytes + 1)
        form = form_of({k: str(v) for k, v in posted.items() if k != "pack"},
                       ("since", "until", "tenant", "user", "rule", "action"))
        text = str(posted.get("pack", ""))
        filters = search_filters(form, session.officer, self.c.audit.key)
        if not text.strip():
            form.errors["pack"] = "paste the draft rule pack (YAML)"
        draft, problems = (rescan.load_draft(text, PackLimits.of(self.c.settings))
                           if text.strip() else (None, []))
        if form.errors or draft is None:
            return self.page(request, "rescan.html", session, status=400, form=form, problems=problems,
                             result=None, draft=text)
        await self.viewed(session, "console_rescan", filters.tenant, {
            "filters": asdict(filters), "draft_version": draft.version,
            "draft_sha256": rescan.draft_sha256(text)})
        deadline = self.c.deadline()
        page = await trail.read_page(self.c.audit, [filters.index()], filters, rescan.MAX_RECORDS, None,
                                     deadline, PAGE_BYTES, trail.is_request)
        flagged, scanned = await asyncio.to_thread(rescan.scan, draft, page.records, deadline)
        return self.page(request, "rescan.html", session, form=form, problems=[], draft=text,
                         result={"version": draft.version, "rules": len(draft.rules), "scanned": scanned,
                                 "read": len(page.records), "cut": page.stopped or page.more is not None
                                 or scanned < len(page.records), "flagged": flagged})


def _seq(text: str) -> int:
    """A record seq or audit id from a page's address (404 unless 1 to MAX_SEQ)."""
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_SEQ))
            and 0 < int(text) <= MAX_SEQ):
        raise Problem(404, "There is no such record.")
    return int(text)


def _listed(errors: dict[str, str]) -> str:
    return "; ".join(f"{field}: {why}" for field, why in errors.items())


def _date(form: Form, name: str) -> int:
    text = form.get(name)
    if not text:
        return 0
    when = parse_time(text, end=True)
    if when is None:
        form.errors.setdefault(name, "a UTC date (2026-03-01) or date and time (2026-03-01T09:30)")
        return 0
    return when


def _row(rec: dict[str, Any], audit_id: int, review: dict[str, Any] | None, sealed: bool) -> dict[str, Any]:
    """A table row, its text made ready here (a page may hold 10,000)."""
    return {"seq": rec["seq"], "audit_id": audit_id, "ts_ms": rec.get("ts_ms", 0),
            "time": iso(rec.get("ts_ms", 0)), "tenant": visible(rec.get("tenant", "")),
            "user": visible(rec.get("user", "")), "request_id": rec.get("request_id", ""),
            "rules": [(str(i.get("rule_id", "")), str(i.get("action", "")))
                      for i in rec.get("interventions") or [] if isinstance(i, dict)],
            "finish_reason": rec.get("finish_reason", ""), "cache_hit": bool(rec.get("cache_hit")),
            "review": str(review.get("decision", "")) if review else "", "sealed": sealed}


def _csv_row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "rules": " ".join(f"{r}:{a}" for r, a in row["rules"]),
            "cache_hit": "yes" if row["cache_hit"] else "no"}


def _csv(rows: Any) -> bytes:
    """Rows of the CSV, every cell neutralized and quoted (finsieve.display)."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    for row in rows:
        writer.writerow([cell(row[c]) for c in CSV_COLUMNS])
    return out.getvalue().encode()
