"""One scanner for card numbers in what a server wrote (Valkey keys and values, the AOF,
exports, logs), shared by the PCI tests.

It looks for what a reader would take for one card number: a run of digit groups joined by
short runs (1-3 characters) of spaces or punctuation, every run of whole consecutive groups
that holds 13-19 digits and passes Luhn. Whole groups, because a reader does not start a
number in the middle of a group: a zero-padded 20-digit index member holds Luhn-valid
13-digit windows that no one reads as a card. Left out on purpose, each by its shape, so
that what the server must write anyway cannot read as a leak:
  * a group glued to a letter (hex HMACs and hashes, base64, `04T01` in ISO times);
  * a group that reads as a Unix time of 2020-2033 in s, ms, us or ns (10, 13, 16 or 19
    digits from 16 to 19, as `ts_ms`, scores in the AOF), with its decimal fraction;
  * CR, LF, `"`, `$`, `:`, `*` and `=` never join groups: they frame RESP (the AOF), JSON
    and masks (`4111 11** **** 1111`), not numbers.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

_SEP = r'(?:[^\w\r\n"$:*=]|_){1,3}'  # \w: letters, digits and `_`; `_` does join groups
RUN = re.compile(rf"(?<![^\W_])\d+(?:{_SEP}\d+)*(?![^\W_])")  # not glued to a letter or digit
_GROUP = re.compile(r"\d+")
_TIME = re.compile(r"1[6-9](?:\d{8}|\d{11}|\d{14}|\d{17})")


def _luhn(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = unicodedata.digit(d)
        total += (n * 2 - 9 if n > 4 else n * 2) if i % 2 else n
    return total % 10 == 0


def _readable_groups(run: str) -> list[list[re.Match[str]]]:
    """The run's digit groups, split where a Unix time (and its fraction) stands."""
    parts: list[list[re.Match[str]]] = [[]]
    after_time = False
    for g in _GROUP.finditer(run):
        fraction = after_time and run[g.start() - 1] == "."
        after_time = bool(_TIME.fullmatch(g.group()))
        if after_time or fraction:
            parts.append([])
        else:
            parts[-1].append(g)
    return [p for p in parts if p]


def card_numbers(text: str) -> list[str]:
    """Every Luhn-valid run of 13-19 digits grouped the way a reader reads one number, as
    spelled in text."""
    found = []
    for run in RUN.finditer(text):
        for groups in _readable_groups(run.group()):
            for i in range(len(groups)):
                digits = ""
                for j in range(i, len(groups)):
                    digits += groups[j].group()
                    if len(digits) > 19:
                        break
                    if len(digits) >= 13 and _luhn(digits):
                        found.append(run.group()[groups[i].start() : groups[j].end()])
    return found


async def everything_in(client) -> list[tuple[str, bytes]]:
    """Every key name and every value of every type in a Valkey, as (key, bytes)."""
    out: list[tuple[str, bytes]] = []
    async for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        out.append((name, key))
        kind = (await client.type(key)).decode()
        if kind == "string":
            out.append((name, await client.get(key) or b""))
        elif kind == "hash":
            out += [(name, k + b"=" + v) for k, v in (await client.hgetall(key)).items()]
        elif kind == "list":
            out += [(name, v) for v in await client.lrange(key, 0, -1)]
        elif kind == "set":
            out += [(name, v) for v in await client.smembers(key)]
        elif kind == "zset":
            out += [(name, m + b" " + str(s).encode())
                    for m, s in await client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            for entry_id, fields in await client.xrange(key):
                out.append((name, entry_id + b" " + b" ".join(k + b"=" + v for k, v in fields.items())))
        else:
            raise AssertionError(f"{name}: a {kind} this scanner does not read")
    return out


async def aof_files(client) -> list[Path]:
    directory = Path((await client.config_get("dir"))["dir"])
    sub = (await client.config_get("appenddirname")).get("appenddirname", "appendonlydir")
    return sorted(p for p in (directory / sub).glob("*") if p.is_file()) + sorted(directory.glob("*.aof"))


async def stored_texts(client) -> dict[str, str]:
    """Each key name and value, and each AOF file, by where it is."""
    texts = {f"valkey {name}": v.decode(errors="replace") for name, v in await everything_in(client)}
    texts.update({f"aof {p.name}": p.read_bytes().decode(errors="replace") for p in await aof_files(client)})
    return texts


async def leaks(client) -> dict[str, list[str]]:
    """Where a card number is in clear: each key name and value, and the AOF files."""
    return {where: found for where, text in (await stored_texts(client)).items()
            if (found := card_numbers(text))}
