"""Rule packs: YAML files under a directory, read with line numbers and checked field by field.

Every problem is reported as `file:line: rule-id: field: reason`, all of them at once, so a
rule author fixes a pack in one pass.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import yaml

from .normalize import normalize_pattern
from .sources import DEFAULT_LIMITS, PackLimits, SourceProblem, compose, read_pack
from .validators import VALIDATORS

KINDS = ("literal", "regex")
SCOPES = ("input", "output", "both")
ACTIONS = ("block", "redact", "rewrite", "halt")
EDITS = ("redact", "rewrite")  # the actions whose matches are replaced by `replacement`
SEVERITIES = ("low", "medium", "high", "critical")
# How the audit trail stores what a rule matched: as is, masked (plus a keyed hash an officer
# can search by), or as the keyed hash alone. Redacted identifiers are masked by default.
AUDIT_MODES = ("keep", "mask", "hash")
REGEX_FLAGS = regex.IGNORECASE | regex.UNICODE
_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
_DEFINITION_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_UNBOUNDED = 1 << 30
# A regex, definitions expanded: its length and how deep its groups nest (the `regex` and
# `re` parsers recurse once per level), and how deep definitions may use definitions.
MAX_REGEX_CHARS = 8192
MAX_REGEX_DEPTH = 32
MAX_DEFINITION_DEPTH = 16
# The longest match a rule may look for, in normalized characters: a literal's length, a
# regex's max_span. Per token the matcher's work grows with it: the automaton walks a
# literal's failure links at each character it reads (a periodic 4,001-character literal
# cost 1.8 ms a token on the decode loop that every stream shares; 513 characters: 78 us;
# 257: 23), and a regex match rejected by its validators is searched again from the next
# character, each search as long as the span (a run of digits that Luhn rejects, 1,000
# characters: 70 ms in the token that ends it; 256: 4 ms).
MAX_SPAN = 256
# Regex patterns in a pack. While an answer streams, each regex that may begin at a new
# character is searched after every token (~5 us a search): 1,000 regexes able to begin at
# any letter cost 5.6 ms a token of every stream.
MAX_REGEXES = 256
# Literal patterns that may end at one place: a pattern and the others that end it ("x",
# "xx", … each add a match at every character of "xxxx…": 256 of them, 9 ms a token).
MAX_NESTED = 16
# \G: a backslash that no backslash escapes (an odd run of them) before a G
_SEARCH_START_ANCHOR = re.compile(r"(?<!\\)(?:\\\\)*\\G")


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

    def __post_init__(self) -> None:
        # Ids, field names and values quoted here come from the pack: a problem stays short.
        for name, limit in (("rule_id", 100), ("field", 100), ("reason", 500)):
            value = getattr(self, name)
            if len(value) > limit:
                object.__setattr__(self, name, value[:limit] + "…")

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule_id or '-'}: {self.field}: {self.reason}"


class PackError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def load_rules(directory: Path, limits: PackLimits = DEFAULT_LIMITS) -> list[Rule]:
    """Every enabled rule of every *.yaml under directory; raises PackError listing all problems.
    The files are untrusted: see sources.py for the bounds on reading them."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PackError([Problem(str(directory), 0, "", "rules", "not a directory")])
    rules: list[Rule] = []
    files, unreadable = read_pack(directory, limits)
    problems = [_problem(e) for e in unreadable]
    seen: dict[str, str] = {}
    regexes, too_many = 0, False
    for name, text in files:
        try:
            file_rules, file_problems = _load_file(name, text, limits)
        except (RecursionError, MemoryError) as e:  # a bound this module missed: still a rejection
            file_rules, file_problems = [], [Problem(name, 0, "", "file", f"too complex to load ({e!r})")]
        problems += file_problems
        for rule, rule_id, line in file_rules:  # invalid rules too: report every duplicate
            if rule_id in seen:
                problems.append(Problem(name, line, rule_id, "id",
                                        f"duplicate id (first defined at {seen[rule_id]})"))
                continue
            if rule_id:
                seen[rule_id] = f"{name}:{line}"
            if rule is not None:
                rules.append(rule)
                regexes += len(rule.patterns) if rule.kind == "regex" else 0
                if regexes > MAX_REGEXES and not too_many:
                    too_many = True
                    problems.append(Problem(name, line, rule_id, "patterns",
                                            f"the pack has more than {MAX_REGEXES} regex patterns"))
    problems += _nested_literals(rules)
    if problems:
        raise PackError(sorted(problems, key=lambda p: (p.file, p.line)))
    return rules


def _nested_literals(rules: list[Rule]) -> list[Problem]:
    """A problem for each rule with a literal where more than MAX_NESTED matches end: the
    literals that end it, it included, each once per rule that holds it (each rule's match
    is its own)."""
    owners = Counter(p for r in rules if r.kind == "literal" for p in set(r.patterns))
    lengths = sorted({len(p) for p in owners})
    problems = []
    for r in rules:
        for p in r.patterns if r.kind == "literal" else ():
            ends = sum(owners.get(p[len(p) - n :], 0) for n in lengths if n <= len(p))
            if ends > MAX_NESTED:
                file, _, line = r.source.rpartition(":")
                problems.append(Problem(file, int(line), r.id, "patterns",
                                        f"{_show(p)}: {ends} matches end where it ends (it and "
                                        "the literals that end it, once per rule that holds "
                                        f"each; at most {MAX_NESTED})"))
                break
    return problems


# -- one file ---------------------------------------------------------------------------


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _problem(e: SourceProblem) -> Problem:
    return Problem(e.path, e.line, "", e.field, e.reason)


def _show(text: str, limit: int = 60) -> str:
    """A pattern quoted in a message, shortened: reasons are logged and stored."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


def _load_file(name: str, text: str,
               limits: PackLimits) -> tuple[list[tuple[Rule | None, str, int]], list[Problem]]:
    try:
        # A file without aliases weighs about its size: aliases may not inflate it past what
        # the whole pack may hold.
        doc = compose(text, name, limits.max_bytes)
    except SourceProblem as e:
        return [], [_problem(e)]
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
    raw_definitions: dict[str, tuple[str, int]] = {}
    if "definitions" in top:
        defs = _mapping(top["definitions"][1], name, "", "definitions", problems) or {}
        for key, (_, node) in defs.items():
            value = _scalar(node)
            if not isinstance(value, str) or not value:
                problems.append(Problem(name, _line(node), "", f"definitions.{key}",
                                        "must be a non-empty regex fragment"))
            else:
                raw_definitions[key] = (value, _line(node))
    definitions = _Definitions(raw_definitions, name, problems)
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


def _rule(node: yaml.Node, file: str, definitions: _Definitions,
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
    if action in EDITS and not replacement:
        problem("replacement", f"missing: action {action} needs the text that replaces a match")
    validators = strings("validators") or []
    for v in validators:
        if v not in VALIDATORS:
            problem("validators", f"unknown validator {v!r} (expected one of {', '.join(VALIDATORS)})")
    if validators and kind == "literal":
        problem("validators", "only regex rules take validators")
    max_span = get("max_span", int)
    if max_span is not None and not 0 < max_span <= MAX_SPAN:
        problem("max_span", f"must be a positive number of characters, at most {MAX_SPAN}")
    locales = strings("locales") or []
    enabled = get("enabled", bool, True)
    message = get("message", str, "")

    compiled: list[str] = []
    if kind == "literal":
        for p in patterns:
            norm = normalize_pattern(p)
            if p.strip() and not norm:
                problem("patterns", f"{p!r} is empty once normalized")
            elif len(norm) > MAX_SPAN:
                problem("patterns", f"{_show(p)} normalizes to {len(norm)} characters "
                        f"(at most {MAX_SPAN})")
            compiled.append(norm)
        if max_span is None:
            max_span = max((len(p) for p in compiled), default=0)
    elif kind == "regex":
        widths = []
        for p in patterns:
            expanded, why = definitions.expand(p)
            why = why or _regex_too_deep(expanded)
            if why:
                problem("patterns", f"{_show(p)} {why}")
                continue
            try:
                reverse = regex.compile(expanded, REGEX_FLAGS).flags & regex.REVERSE
            except (regex.error, RecursionError, MemoryError, OverflowError, ValueError) as e:
                problem("patterns", f"{_show(p)} does not compile: {e}")
                continue
            if reverse:  # the streaming matcher searches forwards from where a match may start
                problem("patterns", f"{_show(p)} searches backwards ((?r)): not supported")
                continue
            if _SEARCH_START_ANCHOR.search(expanded):
                # A search starts wherever the matcher resumes (after each token, past a
                # match), so the anchor would match or not by how the answer was cut.
                problem("patterns", f"{_show(p)} anchors where a search starts (\\G): "
                        "not supported (a stream is searched from many places)")
                continue
            compiled.append(expanded)
            widths.append(_max_width(expanded))
        if widths and max_span is None:
            if None in widths:
                problem("max_span", "required: a pattern can match text of unbounded length "
                        "(give the longest match to look for, in characters)")
            else:
                max_span = max(w for w in widths if w is not None)
                if max_span > MAX_SPAN:
                    problem("max_span", f"required: a pattern can match up to {max_span} "
                            f"characters, more than {MAX_SPAN} (give the longest match to "
                            f"look for, at most {MAX_SPAN})")
    if len(problems) > start or not enabled:
        return None, rule_id
    return Rule(
        id=rule_id, description=description, kind=kind, patterns=tuple(compiled), scope=scope,
        action=action, replacement=replacement, validators=tuple(validators),
        max_span=int(max_span or 0), severity=severity, locales=tuple(locales), message=message,
        source=f"{file}:{_line(node)}", audit=audit,
    ), rule_id


class _Definitions:
    """A file's `definitions`, each expanded once. One that uses itself (directly or not),
    nests deeper than MAX_DEFINITION_DEPTH or grows past MAX_REGEX_CHARS is a problem at its
    own line, and never built: lengths are added up before any text is."""

    def __init__(self, raw: dict[str, tuple[str, int]], file: str, problems: list[Problem]) -> None:
        self.raw = raw
        self.expanded: dict[str, str] = {}
        self.bad: dict[str, str] = {}  # name -> why
        for name in raw:
            self._resolve(name, ())
        problems += [Problem(file, raw[name][1], "", f"definitions.{name}", why)
                     for name, why in self.bad.items()]

    def expand(self, pattern: str) -> tuple[str, str]:
        """The pattern with every ${name} expanded, or ("", why not)."""
        if why := self._check_refs(pattern):
            return "", why
        return _DEFINITION_REF.sub(lambda m: f"(?:{self.expanded[m.group(1)]})", pattern), ""

    def _resolve(self, name: str, stack: tuple[str, ...]) -> None:
        if name in self.expanded or name in self.bad:
            return
        if name in stack:  # every definition on the cycle is at fault
            cycle = (*stack[stack.index(name):], name)
            for member in cycle[:-1]:
                self.bad[member] = f"uses itself ({' -> '.join(cycle)})"
            return
        if len(stack) >= MAX_DEFINITION_DEPTH:
            self.bad[name] = f"definitions use definitions more than {MAX_DEFINITION_DEPTH} deep"
            return
        value = self.raw[name][0]
        for ref in dict.fromkeys(_DEFINITION_REF.findall(value)):
            if ref in self.raw:
                self._resolve(ref, (*stack, name))
            if name in self.bad:  # on a cycle through ref
                return
        if why := self._check_refs(value):
            self.bad[name] = why
        else:
            self.expanded[name] = _DEFINITION_REF.sub(
                lambda m: f"(?:{self.expanded[m.group(1)]})", value)

    def _check_refs(self, text: str) -> str:
        """Why text cannot be expanded (an unknown or bad definition, too long), or ""."""
        length = len(text)
        for m in _DEFINITION_REF.finditer(text):
            ref = m.group(1)
            if ref not in self.expanded:
                return (f"uses definition ${{{ref}}}, which is invalid" if ref in self.raw
                        else f"uses undefined definition ${{{ref}}}")
            length += len(self.expanded[ref]) + 4 - len(m.group(0))
        if length > MAX_REGEX_CHARS:
            return f"expands to {length} characters (at most {MAX_REGEX_CHARS})"
        return ""


def _regex_too_deep(pattern: str) -> str:
    """Why a regex is refused before compiling (its groups nest too deep), or ""."""
    depth = deepest = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    if deepest > MAX_REGEX_DEPTH:
        return f"nests groups {deepest} deep (at most {MAX_REGEX_DEPTH})"
    return ""


def _max_width(pattern: str) -> int | None:
    """Longest text the pattern can match, or None when unbounded or not computable."""
    try:
        _, high = re._parser.parse(pattern).getwidth()  # type: ignore[attr-defined]
    except Exception:  # `regex`-only syntax: the author must give max_span
        return None
    return None if high >= _UNBOUNDED else high
