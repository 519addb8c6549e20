"""What officers type into the console, checked field by field: every problem is shown next
to its field, named, and nothing unchecked reaches a query, an index key or the trail.

The domains are the AuditService's (`audit_service.py`): the same values are valid on both
ports. Times are typed as UTC (`2026-03-01`, `2026-03-01T09:30`, as a datetime-local input
sends them). User and request ids, and a known identifier, are searched by their keyed
hash, as the trail indexes them; the access record holds the hashes, never the values.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

from finsieve.auth import Principal
from finsieve.policy.schema import _ID as RULE_ID
from finsieve.policy.schema import ACTIONS

from ..audit import Filters, id_hash
from ..audit_service import FINISH_REASONS, MAX_SEQ
from ..keys import TENANT_RE
from ..sensitive import canonical_value, value_hash
from .trail import Back

MAX_CHARS = 256  # any one typed value
PAGE_SIZES = (50, 100, 500, 1000, 10000)
DEFAULT_PAGE = 100
SEARCH_FIELDS = ("since", "until", "tenant", "user", "rule", "action", "finish_reason",
                 "request_id", "audit_id", "match")


@dataclass
class Form:
    values: dict[str, str]  # as typed, to show again
    errors: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> str:
        return self.values.get(name, "")


def typed_values(params: Mapping[str, str], names: tuple[str, ...]) -> Form:
    form = Form({n: params.get(n, "").strip() for n in names})
    for name, value in form.values.items():
        if len(value) > MAX_CHARS:
            form.errors[name] = f"at most {MAX_CHARS} characters"
            form.values[name] = value[:MAX_CHARS]
    return form


def parse_time(text: str, end: bool = False) -> int | None:
    """Unix milliseconds of a UTC date, or date and time; with `end`, the last millisecond
    of the day, minute or second typed. None if it is neither."""
    for fmt, span in (("%Y-%m-%dT%H:%M:%S", 1000), ("%Y-%m-%dT%H:%M", 60_000),
                      ("%Y-%m-%d %H:%M", 60_000), ("%Y-%m-%d", 86_400_000)):
        try:
            when = dt.datetime.strptime(text, fmt).replace(tzinfo=dt.UTC)
        except ValueError:
            continue
        return int(when.timestamp() * 1000) + (span - 1 if end else 0)
    return None


def time_range(form: Form) -> tuple[int, int]:
    """since and until (0: open) of a form, until inclusive; errors recorded on it."""
    out = []
    for name in ("since", "until"):
        text, ms = form.get(name), 0
        if text:
            parsed = parse_time(text, end=name == "until")
            if parsed is None or parsed <= 0:
                form.errors.setdefault(name, "a UTC date (2026-03-01) or date and time "
                                             "(2026-03-01T09:30)")
            else:
                ms = parsed
        out.append(ms)
    since, until = out
    if until and since and until < since:
        form.errors.setdefault("until", "must not be before since")
    return since, until


def tenant_scope(form: Form, officer: Principal) -> str:
    """The tenant a read covers: the officer's own unless granted all tenants."""
    tenant = form.get("tenant")
    if tenant and not TENANT_RE.match(tenant):
        form.errors.setdefault("tenant", "1-64 letters, digits, '.', '_' or '-'")
        return officer.tenant if not officer.all_tenants else ""
    if not officer.all_tenants:
        if tenant and tenant != officer.tenant:
            form.errors.setdefault("tenant", "you may read your own tenant's records only")
        return officer.tenant
    return tenant


def search_filters(form: Form, officer: Principal, key: bytes) -> Filters:
    """The filters of a search form (errors recorded on the form)."""
    since, until = time_range(form)
    tenant = tenant_scope(form, officer)
    rule = form.get("rule")
    if rule and not RULE_ID.match(rule):
        form.errors.setdefault("rule", "a rule id: 1-100 lowercase letters, digits, '.', '_' or '-'")
    action = form.get("action").lower()
    if action and action not in ACTIONS:
        form.errors.setdefault("action", f"one of {', '.join(ACTIONS)}")
    finish = form.get("finish_reason").upper()
    if finish and finish not in FINISH_REASONS:
        form.errors.setdefault("finish_reason", f"one of {', '.join(FINISH_REASONS)}")
    audit_id = form.get("audit_id")
    if audit_id and not (audit_id.isascii() and audit_id.isdigit() and audit_id[0] != "0"
                         and len(audit_id) <= len(str(MAX_SEQ)) and int(audit_id) <= MAX_SEQ):
        form.errors.setdefault("audit_id", f"the digits of an audit id (1 to {MAX_SEQ})")
    match = form.get("match")
    if match and not canonical_value(match):
        form.errors.setdefault("match", "has no letter or digit to look for")
    user, request_id = form.get("user"), form.get("request_id")
    return Filters(since, until, tenant, id_hash(key, "user", user) if user else "", rule, action,
                   finish, id_hash(key, "request_id", request_id) if request_id else "",
                   audit_id, value_hash(key, match) if match else "")


def page_size(form: Form) -> int:
    text = form.get("page_size")
    if not text:
        return DEFAULT_PAGE
    if not text.isdigit() or int(text) not in PAGE_SIZES:
        form.errors.setdefault("page_size", f"one of {', '.join(map(str, PAGE_SIZES))}")
        return DEFAULT_PAGE
    return int(text)


def cursor(form: Form) -> Back | None:
    text = form.get("after")
    if not text:
        return None
    back = Back.parse(text)
    if back is None:
        form.errors.setdefault("after", "not a link from a previous page")
    return back
