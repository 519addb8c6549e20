"""Rule packs: YAML files under a directory, read with line numbers and checked field by field.

Every problem is reported as `file:line: rule-id: field: reason`, all of them at once, so a
rule author fixes a pack in one pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import yaml

from .normalize import normalize_pattern
from .validators import VALIDATORS

KINDS = ("literal", "regex")
SCOPES = ("input", "output", "both")
ACTIONS = ("block", "redact", "rewrite", "halt")
SEVERITIES = ("low", "medium", "high", "critical")
# How the audit trail stores what a rule matched: as is, masked (plus a keyed hash an officer
# can search by), or as the keyed hash alone. Redacted identifiers are masked by default.
AUDIT_MODES = ("keep", "mask", "hash")
REGEX_FLAGS = regex.IGNORECASE | regex.UNICODE
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
_DEFINITION_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Rule:
    id: str
    description: str
    kind: str
    patterns: tuple[str, ...]  # literals normalized; regexes with definitions expanded
    scope: str
    action: str
    replacement: str
    validators: tuple[str, ...]
    max_span: int  # longest match in normalized characters (literals: longest pattern)
    severity: str
    locales: tuple[str, ...]
    message: str
    source: str  # "file:line" of the rule, for messages
    audit: str = "keep"  # one of AUDIT_MODES

    @property
    def applies_to_output(self) -> bool:
        return self.scope in ("output", "both")

    @property
    def applies_to_input(self) -> bool:
        return self.scope in ("input", "both")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    rule_id: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule_id or '-'}: {self.field}: {self.reason}"


class PackError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def load_rules(directory: Path) -> list[Rule]:
    """Every enabled rule of every *.yaml under directory; raises PackError listing all problems."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PackError([Problem(str(directory), 0, "", "rules", "not a directory")])
    rules: list[Rule] = []
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for path in sorted(directory.rglob("*.yaml")):
        file_rules, file_problems = _load_file(path)
        problems += file_problems
        for rule, rule_id, line in file_rules:  # invalid rules too: report every duplicate
            if rule_id in seen:
                problems.append(Problem(str(path), line, rule_id, "id",
                                        f"duplicate id (first defined at {seen[rule_id]})"))
                continue
            if rule_id:
                seen[rule_id] = f"{path}:{line}"
            if rule is not None:
                rules.append(rule)
    if problems:
        raise PackError(sorted(problems, key=lambda p: (p.file, p.line)))
    return rules


# -- one file ---------------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _load_file(path: Path) -> tuple[list[tuple[Rule | None, str, int]], list[Problem]]:
    name = str(path)
    try:
        doc = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else 0
        reason = f"{getattr(e, 'problem', None) or e}"
        return [], [Problem(name, line, "", "yaml", f"not valid YAML: {reason}")]
    except (OSError, UnicodeDecodeError) as e:
        return [], [Problem(name, 0, "", "file", f"cannot read: {e}")]
    if doc is None:
        return [], []
    problems: list[Problem] = []
    top = _mapping(doc, name, "", "(file)", problems)
    if top is None:
        return [], problems
    for key, (node, _) in top.items():
        if key not in ("rules", "definitions", "pack"):
            problems.append(Problem(name, _line(node), "", key,
                                    "unknown top-level key (expected rules, definitions, pack)"))
    definitions: dict[str, str] = {}
    if "definitions" in top:
        defs = _mapping(top["definitions"][1], name, "", "definitions", problems) or {}
        for key, (_, node) in defs.items():
            value = _scalar(node)
            if not isinstance(value, str) or not value:
                problems.append(Problem(name, _line(node), "", f"definitions.{key}",
                                        "must be a non-empty regex fragment"))
            else:
                definitions[key] = value
    rules: list[tuple[Rule | None, str, int]] = []
    if "rules" not in top:
        problems.append(Problem(name, _line(doc), "", "rules", "missing: a list of rules"))
        return rules, problems
    rules_node = top["rules"][1]
    if not isinstance(rules_node, yaml.SequenceNode):
        problems.append(Problem(name, _line(rules_node), "", "rules", "must be a list of rules"))
        return rules, problems
    for rule_node in rules_node.value:
        rule, rule_id = _rule(rule_node, name, definitions, problems)
        rules.append((rule, rule_id, _line(rule_node)))
    return rules, problems


def _mapping(node: yaml.Node, file: str, rule_id: str, field: str,
             problems: list[Problem]) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
    if not isinstance(node, yaml.MappingNode):
        problems.append(Problem(file, _line(node), rule_id, field, "must be a mapping"))
        return None
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = str(_scalar(key_node))
        if key in out:
            problems.append(Problem(file, _line(key_node), rule_id, key, "duplicate key"))
        out[key] = (key_node, value_node)
    return out


def _scalar(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


_FIELDS = {
    "id", "description", "kind", "patterns", "scope", "action", "replacement", "validators",
    "max_span", "severity", "locales", "enabled", "message", "audit",
}


def _rule(node: yaml.Node, file: str, definitions: dict[str, str],
          problems: list[Problem]) -> tuple[Rule | None, str]:
    """The rule (None if it has problems or is disabled) and its id as written."""
    fields = _mapping(node, file, "", "rules[]", problems)
    if fields is None:
        return None, ""
    start = len(problems)
    raw_id = _scalar(fields["id"][1]) if "id" in fields else None
    rule_id = raw_id if isinstance(raw_id, str) else ""

    def problem(field: str, reason: str) -> None:
        line = _line(fields[field][1]) if field in fields else _line(node)
        problems.append(Problem(file, line, rule_id, field, reason))

    def get(field: str, types: type | tuple[type, ...], default: Any = None,
            required: bool = False) -> Any:
        if field not in fields:
            if required:
                problem(field, "missing (required)")
            return default
        value = _scalar(fields[field][1])
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
            problem(field, f"must be a {names}, not {type(value).__name__}")
            return default
        return value

    def choice(field: str, options: tuple[str, ...], default: str | None = None) -> str:
        value = get(field, str, default, required=default is None)
        if value is not None and value not in options:
            problem(field, f"unknown value {value!r} (expected one of {', '.join(options)})")
        return value or ""

    def strings(field: str, required: bool = False) -> list[str] | None:
        """The list, or None when it is missing or not a list of strings (already reported)."""
        value = get(field, list, None, required)
        if value is not None and any(not isinstance(v, str) for v in value):
            problem(field, "must be a list of strings")
            return None
        return value

    for key in fields:
        if key not in _FIELDS:
            problem(key, f"unknown field (expected one of {', '.join(sorted(_FIELDS))})")
    if raw_id is None:
        problem("id", "missing (required)")
    elif not isinstance(raw_id, str) or not _ID.match(raw_id):
        problem("id", "must be lowercase letters, digits, '.', '_' or '-' (at most 100)")
    description = get("description", str, "", required=True)
    kind = choice("kind", KINDS)
    scope = choice("scope", SCOPES, "output")
    action = choice("action", ACTIONS)
    severity = choice("severity", SEVERITIES, "medium")
    audit = choice("audit", AUDIT_MODES, "mask" if action == "redact" else "keep")
    patterns = strings("patterns", required=True)
    if patterns == []:
        problem("patterns", "empty: give at least one pattern")
    patterns = patterns or []
    if any(not p.strip() for p in patterns):
        problem("patterns", "contains an empty pattern")
    replacement = get("replacement", str, "")
    if action in ("redact", "rewrite") and not replacement:
        problem("replacement", f"missing: action {action} needs the text that replaces a match")
    validators = strings("validators") or []
    for v in validators:
        if v not in VALIDATORS:
            problem("validators", f"unknown validator {v!r} (expected one of {', '.join(VALIDATORS)})")
    if validators and kind == "literal":
        problem("validators", "only regex rules take validators")
    max_span = get("max_span", int)
    if max_span is not None and max_span <= 0:
        problem("max_span", "must be a positive number of characters")
    locales = strings("locales") or []
    enabled = get("enabled", bool, True)
    message = get("message", str, "")

    compiled: list[str] = []
    if kind == "literal":
        for p in patterns:
            norm = normalize_pattern(p)
            if p.strip() and not norm:
                problem("patterns", f"{p!r} is empty once normalized")
            compiled.append(norm)
        if max_span is None:
            max_span = max((len(p) for p in compiled), default=0)
    elif kind == "regex":
        widths = []
        for p in patterns:
            expanded, missing = _expand(p, definitions)
            if missing:
                problem("patterns", f"{p!r} uses undefined definition ${{{missing}}}")
                continue
            try:
                regex.compile(expanded, REGEX_FLAGS)
            except regex.error as e:
                problem("patterns", f"{p!r} does not compile: {e}")
                continue
            compiled.append(expanded)
            widths.append(_max_width(expanded))
        if widths and max_span is None:
            if None in widths:
                problem("max_span", "required: a pattern can match text of unbounded length "
                        "(give the longest match to look for, in characters)")
            else:
                max_span = max(w for w in widths if w is not None)
    if len(problems) > start or not enabled:
        return None, rule_id
    return Rule(
        id=rule_id, description=description, kind=kind, patterns=tuple(compiled), scope=scope,
        action=action, replacement=replacement, validators=tuple(validators),
        max_span=int(max_span or 0), severity=severity, locales=tuple(locales), message=message,
        source=f"{file}:{_line(node)}", audit=audit,
    ), rule_id


def _expand(pattern: str, definitions: dict[str, str]) -> tuple[str, str]:
    missing = ""

    def sub(m: re.Match[str]) -> str:
        nonlocal missing
        if m.group(1) not in definitions:
            missing = m.group(1)
            return m.group(0)
        return f"(?:{definitions[m.group(1)]})"

    for _ in range(10):  # definitions may use definitions
        expanded = _DEFINITION_REF.sub(sub, pattern)
        if expanded == pattern or missing:
            break
        pattern = expanded
    return pattern, missing


def _max_width(pattern: str) -> int | None:
    """Longest text the pattern can match, or None when unbounded or not computable."""
    try:
        _, high = re._parser.parse(pattern).getwidth()  # type: ignore[attr-defined]
    except Exception:  # `regex`-only syntax: the author must give max_span
        return None
    return None if high >= _UNBOUNDED else high
