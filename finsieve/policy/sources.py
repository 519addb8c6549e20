"""Reading a rule pack's files as untrusted input: regular files only, bounded size, bounded
YAML (nesting depth, and alias expansion measured on the node graph, never built).

A rules directory may be a Kubernetes ConfigMap mount: the visible `x.yaml` are symlinks to
`..data/x.yaml`, `..data` a symlink to a hidden timestamped directory. Names that begin with
a dot are skipped (so each file is read once) and symlinked directories are not followed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from finsieve.config import Settings

MAX_FILES = 1000
MAX_YAML_DEPTH = 32  # mappings and sequences inside each other, aliases followed


@dataclass(frozen=True)
class PackLimits:
    """The settings that bound loading and matching a pack (FINSIEVE_RULES_MAX_BYTES, …)."""

    max_bytes: int = 4 * 1024 * 1024  # all files of the pack together
    regex_timeout_s: float = 0.02  # one regex search in the matcher; expiry counts as a match
    mask_work_limit: int = 250  # one exact token mask's work units (masks.py); 0: unbounded

    @classmethod
    def of(cls, settings: Settings) -> PackLimits:
        return cls(settings.rules_max_bytes, settings.regex_timeout_ms / 1000,
                   settings.mask_work_limit)


DEFAULT_LIMITS = PackLimits()


class SourceProblem(Exception):
    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.line, self.field, self.reason = path, line, field, reason


def read_pack(directory: Path, limits: PackLimits) -> tuple[list[tuple[str, str]], list[SourceProblem]]:
    """(name, text) of every *.yaml of the pack, in name order, and the files that cannot be."""
    files: list[tuple[str, str]] = []
    problems: list[SourceProblem] = []
    budget = limits.max_bytes
    seen: set[str] = set()
    paths = _yaml_paths(directory)
    if len(paths) > MAX_FILES:
        return [], [SourceProblem(str(directory), 0, "rules",
                                  f"more than {MAX_FILES} *.yaml files ({len(paths)})")]
    for path in paths:
        name = str(path)
        try:
            real = os.path.realpath(path)
            if real in seen:  # two names of one file
                continue
            seen.add(real)
            data = _read_regular(path, budget)
        except SourceProblem as e:
            problems.append(e)
            continue
        except OSError as e:
            problems.append(SourceProblem(name, 0, "file", f"cannot read: {e.strerror or e}"))
            continue
        if len(data) > budget:
            problems.append(SourceProblem(
                name, 0, "file", f"the pack's files exceed {limits.max_bytes} bytes together "
                "(FINSIEVE_RULES_MAX_BYTES)"))
            break
        budget -= len(data)
        try:
            files.append((name, data.decode("utf-8")))
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            problems.append(SourceProblem(name, line, "file", f"not UTF-8 (byte {e.start})"))
    return files, problems


def _yaml_paths(directory: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(directory):  # symlinked directories are not entered
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(root, n) for n in names if n.endswith(".yaml") and not n.startswith(".")]
    return sorted(out)


def _read_regular(path: Path, budget: int) -> bytes:
    """At most budget + 1 bytes of a regular file; a FIFO or device is refused unopened."""
    name = str(path)
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise SourceProblem(name, 0, "file", "not a regular file (a FIFO, device or directory)")
    # O_NONBLOCK: if it was swapped for a FIFO since the stat, opening it does not hang.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceProblem(name, 0, "file", "not a regular file (a FIFO, device or directory)")
        chunks, left = [], budget + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- YAML ------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting deeper than MAX_YAML_DEPTH (the composer
    recurses once per level: without this, deep nesting raises RecursionError)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def compose(text: str, name: str, max_weight: int) -> yaml.Node | None:
    """The document's node graph (aliases shared, not copied). Raises SourceProblem when it
    is not YAML, too deep, or would expand (aliases followed) past max_weight: one per node
    plus one per character of every scalar."""
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters at once
        try:
            doc = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as e:
        raise SourceProblem(name, text.count("\n", 0, e.position) + 1, "yaml",
                            f"not valid YAML: character U+{e.character:04X} is not allowed") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        reason = f"{getattr(e, 'problem', None) or e}"
        raise SourceProblem(name, mark.line + 1 if mark else 0, "yaml",
                            f"not valid YAML: {reason}") from None
    if doc is not None:
        _Expansion(name, max_weight).measure(doc)
    return doc


class _Expansion:
    """Size and depth of a node graph once every alias is expanded, computed once per node."""

    def __init__(self, name: str, max_weight: int) -> None:
        self.name, self.max_weight = name, max_weight
        self.known: dict[int, tuple[int, int]] = {}  # id(node) -> (weight, height)
        self.open: set[int] = set()  # nodes being measured: reaching one again is a cycle

    def measure(self, node: yaml.Node, depth: int = 0) -> tuple[int, int]:
        key = id(node)
        if key in self.open:
            self._fail(node, "an alias refers to a node that contains it")
        if key not in self.known:
            if depth > MAX_YAML_DEPTH:
                self._fail(node, f"nested deeper than {MAX_YAML_DEPTH} levels once aliases are expanded")
            weight, height = 1, 0
            if isinstance(node, yaml.ScalarNode):
                weight += len(node.value)
            else:
                self.open.add(key)
                children = (node.value if isinstance(node, yaml.SequenceNode)
                            else [n for pair in node.value for n in pair])
                for child in children:
                    w, h = self.measure(child, depth + 1)
                    weight, height = weight + w, max(height, h + 1)
                    if weight > self.max_weight:
                        self._fail(node, f"expands to more than {self.max_weight} nodes and "
                                   "characters once aliases are expanded")
                self.open.discard(key)
            self.known[key] = (weight, height)
        weight, height = self.known[key]
        if depth + height > MAX_YAML_DEPTH:
            self._fail(node, f"nested deeper than {MAX_YAML_DEPTH} levels once aliases are expanded")
        return weight, height

    def _fail(self, node: yaml.Node, reason: str) -> None:
        raise SourceProblem(self.name, node.start_mark.line + 1, "yaml", reason)
