r"""The commands the docs show, read by the convention below; tests/integration/
test_doc_commands.py executes them. The docs are README.md, the other root pages, docs/*.md
and each folder's README.md.

Fences
  ```sh        every line is a command, run in order; no output shown.
  ```console   `$ command` lines, each followed by its expected output.
  Any other language (text, yaml, json, python, mermaid, ...) is not a command: a synopsis
  such as `finsieve serve [--role all|engine|gateway]` goes in `text`. Fences labelled
  `bash`, `shell`, `zsh`, `shell-session`, or not labelled, are refused, so that no command
  escapes the test unnoticed.

Commands
  One a line; a line ending in `\` continues, a heredoc (`<<'EOF'` ... `EOF`) is one
  command. Lines starting `#` are skipped. Each runs in its own `bash -c` with pipefail, in
  the root of a scratch checkout after `make setup`, `.venv/bin` first on PATH: `cd`, shell
  variables and `export` do not carry to the next line; pass things on in files
  (`... > acme.key`, then `--key-file acme.key`). Each must exit 0, unless its shown output
  ends with a line `(exit N)`. `make X` runs as `make -o .venv/.installed X` (setup is
  done), with MAX_TOKENS=16 for `make run`.

Addresses, state, keys
  Write the defaults: gateway 127.0.0.1:50051, engine 50052, officers' port 50053, metrics
  `--metrics-port 9464`; the test moves each to a free port wherever it appears, and points
  a client command (chat, audit, keys, limits) without `--target` at its default's port.
  The state directory is the default `.finsieve`; a local server's development keys there
  are found by loopback clients, so commands need no key.

Servers
  A command ending in ` &` runs in the background until the page is done (SIGTERM then);
  after a background `finsieve serve` the test waits for its health check. Pages whose only
  server is a plain `finsieve serve &` (output redirected or not, `--metrics-port 9464` or
  not), or that show client commands and no server, share one scratch checkout and one
  server, in page order (README.md first); after each, rules/ is put back and reloaded. A
  page whose serve has other flags or variables gets a checkout and servers of its own.
  Do not rely on timing: a step that needs the server to have seen a change waits for it
  in the open, e.g. until `chat --json` shows the policy version `rules check` printed.

Expected output (console)
  Each non-blank shown line must occur in stdout+stderr, in order, other lines between;
  spaces compare loosely; `...` matches any text, a line `...` marks omitted lines.
  `<lowercase-name>` matches one run of non-space characters and captures it: a later
  command containing it gets the value, a later output showing it must show that value.
  A placeholder no earlier output captured is refused (write real values: `acme`).

Commands the suite does not run: an HTML comment on the line before the fence
  `<!-- commands: ci -->`                 each command is a line of .ci/run (`make test`).
  `<!-- commands: parse-only: REASON -->`  it needs a GPU, other machines, your CA...: the
      test checks it is well-formed (finsieve's parser accepts it; `make -n`; else `--help`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

COMMAND_FENCES = ("sh", "console")
REFUSED_FENCES = ("", "bash", "shell", "zsh", "shell-session", "shellsession")
MODES = ("run", "ci", "parse-only")

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_DECLARATION = re.compile(r"^<!--\s*commands:\s*(ci|parse-only)\s*(?::\s*(.*?))?\s*-->$")
_HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_]\w*)\2")
_EXIT = re.compile(r"^\(exit (\d+)\)$")
PLACEHOLDER = re.compile(r"<([a-z][a-z0-9]*(?:-[a-z0-9]+)*)>")


@dataclass
class Command:
    page: str
    line: int
    text: str
    mode: str = "run"
    expected: list[str] = field(default_factory=list)  # shown output lines (console fences)
    exit: int = 0

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def background(self) -> bool:
        return self.text.rstrip().endswith("&") and not self.text.rstrip().endswith("&&")

    @property
    def foreground_text(self) -> str:
        return self.text.rstrip()[:-1].rstrip() if self.background else self.text


@dataclass
class Page:
    name: str
    commands: list[Command]
    problems: list[str]  # breaches of the convention, each with its page:line


def read_page(path: Path, name: str) -> Page:
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i + 1  # 1-based number of the fence's first content line
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        mode, reason = _declaration(lines, start - 2)
        where = f"{name}:{start - 1}"
        if lang in REFUSED_FENCES:
            problems.append(f"{where}: a fence labelled {lang or 'nothing'!r}: label it sh or "
                            "console if it holds commands, else text (or its language)")
            continue
        if lang not in COMMAND_FENCES:
            if mode != "run":
                problems.append(f"{where}: a commands declaration on a {lang} fence")
            continue
        if mode == "parse-only" and not reason:
            problems.append(f"{where}: parse-only needs a reason: <!-- commands: parse-only: why -->")
        block = _sh_commands(body, name, start) if lang == "sh" else _console_commands(body, name, start)
        for c in block:
            c.mode = mode
        if not block:
            problems.append(f"{where}: a {lang} fence with no command")
        commands += block
    return Page(name, commands, problems)


def _declaration(lines: list[str], before: int) -> tuple[str, str]:
    """The declaration on the line right before a fence (0-based index), if any."""
    if before >= 0:
        m = _DECLARATION.match(lines[before].strip())
        if m:
            return m.group(1), (m.group(2) or "").strip()
    return "run", ""


def _joined(body: list[str], i: int, prompt: str = "") -> tuple[str, int]:
    """The command starting at body[i] (continuations and heredocs joined), and the index
    after it."""
    text = body[i][len(prompt):]
    i += 1
    while text.endswith("\\") and i < len(body):
        nxt = body[i]
        text = text + "\n" + (nxt[2:] if prompt and nxt.startswith("> ") else nxt)
        i += 1
    m = _HEREDOC.search(text)
    if m:
        word, strip = m.group(3), m.group(1) == "-"
        while i < len(body):
            text += "\n" + body[i]
            done = (body[i].strip() if strip else body[i]) == word
            i += 1
            if done:
                break
    return text, i


def _sh_commands(body: list[str], page: str, first: int) -> list[Command]:
    out = []
    i = 0
    while i < len(body):
        if not body[i].strip() or body[i].lstrip().startswith("#"):
            i += 1
            continue
        line = first + i
        text, i = _joined(body, i)
        out.append(Command(page, line, text))
    return out


def _console_commands(body: list[str], page: str, first: int) -> list[Command]:
    out: list[Command] = []
    i = 0
    while i < len(body):
        if body[i].startswith("$ "):
            line = first + i
            text, i = _joined(body, i, "$ ")
            out.append(Command(page, line, text))
            continue
        if out and body[i].strip():
            m = _EXIT.match(body[i].strip())
            if m:
                out[-1].exit = int(m.group(1))
            else:
                out[-1].expected.append(body[i])
        i += 1
    return out


def output_pattern(shown: str, known: dict[str, str] | None = None
                   ) -> tuple[re.Pattern[str], list[str]]:
    """A shown output line as a regex: `...` is any text, `<name>` one run of non-space
    characters (captured; a name already `known` must match its value again), runs of
    spaces one or more. Returns it with the names it captures, in order."""
    known = known or {}
    names: list[str] = []
    parts: list[str] = []
    tokens = re.split(r"(\.\.\.|<[a-z][a-z0-9-]*>|\s+)", shown.strip())
    for n, tok in enumerate(tokens):
        if not tok:
            continue
        if tok == "...":
            parts.append(".*?")
        elif PLACEHOLDER.fullmatch(tok) and tok[1:-1] in known:
            parts.append(re.escape(known[tok[1:-1]]))
        elif PLACEHOLDER.fullmatch(tok):
            names.append(tok[1:-1])
            last = all(not t for t in tokens[n + 1:])
            parts.append(r"(\S+)" if last else r"(\S+?)")
        elif tok.isspace():
            parts.append(r"\s+")
        else:
            parts.append(re.escape(tok))
    return re.compile("".join(parts)), names


def match_output(expected: list[str], actual: str, known: dict[str, str] | None = None
                 ) -> tuple[dict[str, str], str]:
    """Placeholders captured, and '' or the first shown line not found (in order)."""
    lines = actual.splitlines()
    captured: dict[str, str] = dict(known or {})
    pos = 0
    for shown in expected:
        if shown.strip() == "...":
            continue
        pattern, names = output_pattern(shown, captured)
        for k in range(pos, len(lines)):
            m = pattern.search(lines[k].strip())
            if m:
                captured.update(zip(names, m.groups(), strict=True))
                pos = k + 1
                break
        else:
            return captured, shown
    return captured, ""
