"""docs/configuration.md, generated from `Settings`: `python -m finsieve.app.settings_doc`.

Every field of `finsieve.config.Settings` with its environment variable, its `finsieve
serve` flag, its type, its default and its help text, so the page can never drift from the
code (tests/unit/test_configuration_docs.py compares the checked-in page with this output).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin, get_type_hints

from finsieve.config import Settings

REGENERATE = "make docs  (or: python -m finsieve.app.settings_doc > docs/configuration.md)"

# Settings declares its fields in runs that belong together; each group starts at the field
# named here and takes every field up to the next group's first. A field added inside a run
# joins that run's group; a group whose first field is renamed or removed stops generation.
GROUPS: tuple[tuple[str, str, str], ...] = (
    ("role", "Processes and listeners",
     "What a process serves and where it listens (see docs/operations.md: processes and roles)."),
    ("model", "Model and rules", "The model an engine serves and the rule packs it enforces."),
    ("state_dir", "State, Redis and the response cache",
     "Where state lives, which Redis or Valkey holds the audit trail and the cache, and retention."),
    ("allow_insecure", "TLS and engine identity",
     "Transport security on every listener, and how engines and gateways recognise each other."),
    ("keys_secret_file", "API keys and tenants' limits",
     "Stored key hashes, how long a verified key is trusted, and the default per-tenant limits."),
    ("audit_anchor_interval_s", "Audit durability and the officers' port",
     "When an audit record counts as written, anchoring, and what the officers' port allows."),
    ("device", "Engine", "Batching, prefill and the device; CUDA-only settings say so."),
    ("max_tokens_limit", "Requests", "What one request may ask for, and shutdown."),
    ("max_messages", "Bounds",
     "What one client, one connection or one rule pack can cost; beyond a bound the client gets "
     "`RESOURCE_EXHAUSTED` or `INVALID_ARGUMENT` and nothing else is affected."),
    ("metrics_port", "Metrics and logs", "Prometheus metrics and structured logs."),
)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    env: str
    flags: tuple[str, ...]
    type: str
    default: str
    help: str


def serve_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """Settings field -> the `finsieve serve` flags that set it (e.g. --no-compile too)."""
    serve = _subparser(parser, "serve")
    flags: dict[str, list[str]] = {}
    for action in serve._actions:
        if action.dest in Settings.__dataclass_fields__:
            long = [o for o in action.option_strings if o.startswith("--")]
            flags.setdefault(action.dest, []).extend(long)
    return {name: tuple(opts) for name, opts in flags.items()}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise LookupError(f"no `{name}` command in the finsieve parser")


def type_name(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(f"`{c}`" for c in get_args(hint))
    if hint == tuple[str, ...]:
        return "list (comma-separated)"
    return {bool: "bool", int: "int", float: "float", str: "string"}[hint]


def default_text(value: Any) -> str:
    """The default as one would write it in the environment variable (no default holds `|`)."""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value in ("", ()):
        return "(empty)"
    if isinstance(value, tuple):
        return "`" + ",".join(value) + "`"
    return f"`{value}`"


def rows() -> list[Row]:
    from finsieve.app.cli import _parser

    flags = serve_flags(_parser())
    hints = get_type_hints(Settings)
    return [
        Row(f.name, Settings.env_name(f.name), flags.get(f.name, ()), type_name(hints[f.name]),
            default_text(f.default), f.metadata["help"])
        for f in dataclasses.fields(Settings)
    ]


def grouped(all_rows: list[Row]) -> Iterator[tuple[str, str, list[Row]]]:
    names = [r.name for r in all_rows]
    starts = []
    for first, title, _ in GROUPS:
        if first not in names:
            raise LookupError(f"settings_doc.GROUPS: group {title!r} starts at {first!r}, "
                              "which Settings no longer has")
        starts.append(names.index(first))
    if starts != sorted(starts) or starts[0] != 0:
        raise LookupError("settings_doc.GROUPS: groups must start in Settings' field order, "
                          f"the first at {names[0]!r}")
    ends = [*starts[1:], len(names)]
    for (_, title, intro), start, end in zip(GROUPS, starts, ends, strict=True):
        yield title, intro, all_rows[start:end]


def _cell(text: str) -> str:
    """Text as one Markdown table cell: `<state dir>` must not read as an HTML tag."""
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("|", "\\|").replace("\n", " "))


def render() -> str:
    all_rows = rows()
    out = [
        "<!-- Generated by `python -m finsieve.app.settings_doc` from finsieve/config.py's "
        "Settings: do not edit. Regenerate with `make docs`. -->",
        "",
        "# Configuration reference",
        "",
        "For operators and platform teams setting finsieve up. Every setting of `finsieve serve`, "
        "generated from `finsieve.config.Settings`; docs/operations.md says how they fit together.",
        "",
        "Each setting is read, in increasing precedence, from its default, its `FINSIEVE_*` "
        "environment variable, and its `finsieve serve` flag (where it has one). A bad value "
        "stops start-up with a message naming the variable or flag. A list is comma-separated "
        "in its variable, and its flag may be repeated. A bool reads `true`/`false` "
        "(also `1`/`0`, `yes`/`no`, `on`/`off`).",
        "",
        f"{len(all_rows)} settings in {len(GROUPS)} groups:",
        "",
    ]
    groups = list(grouped(all_rows))
    out += [f"- [{title}](#{_anchor(title)}) ({len(group)})" for title, _, group in groups]
    for title, intro, group in groups:
        out += ["", f"## {title}", "", intro, "",
                "| variable | flag | type | default | meaning |", "|---|---|---|---|---|"]
        for r in group:
            flag = " ".join(f"`{f}`" for f in r.flags) or "–"
            out.append(f"| `{r.env}` | {flag} | {r.type} | {r.default} | {_cell(r.help)} |")
    return "\n".join(out) + "\n"


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, spaces to dashes, punctuation dropped."""
    kept = (c for c in title.lower() if c.isalnum() or c in " -_")
    return "".join(kept).replace(" ", "-")


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
