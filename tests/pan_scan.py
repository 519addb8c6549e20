"""A small scanner for card numbers in what a server wrote (Valkey keys, values, the AOF).

It finds what a reader takes for one card number: digit groups joined by short runs (1-3
characters) of spaces or punctuation, any run of whole consecutive groups holding 13-19
digits that passes Luhn. Left out by shape, so that what a server must write cannot read
as a leak: a group glued to a letter (hex hashes), a group that reads as a Unix time of
2020-2033 (ts_ms, scores), and CR, LF, `"`, `$`, `:`, `*`, `=` never join groups (RESP
framing, JSON, masks such as `4111 11** **** 1111`).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

_RUN = re.compile(r"(?<![^\W_])\d+(?:(?:[^\w\r\n\"$:*=]|_){1,3}\d+)*(?![^\W_])")
_GROUP = re.compile(r"\d+")
_TIME = re.compile(r"1[6-9](?:\d{8}|\d{11}|\d{14}|\d{17})")


def luhn(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = unicodedata.digit(d)
        total += (n * 2 - 9 if n > 4 else n * 2) if i % 2 else n
    return total % 10 == 0


def card_numbers(text: str) -> list[str]:
    """Every Luhn-valid run of 13-19 digits in whole groups (see the module's note)."""
    found = []
    for run in _RUN.finditer(text):
        for groups in _split_at_times(run.group()):
            for i in range(len(groups)):
                digits = ""
                for g in groups[i:]:
                    digits += g
                    if len(digits) > 19:
                        break
                    if len(digits) >= 13 and luhn(digits):
                        found.append(digits)
    return found


def _split_at_times(run: str) -> list[list[str]]:
    """The run's digit groups, cut where a Unix time stands (it joins no number)."""
    parts: list[list[str]] = [[]]
    for g in _GROUP.findall(run):
        if _TIME.fullmatch(g):
            parts.append([])
        else:
            parts[-1].append(g)
    return parts


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
            out += [(name, m) for m in await client.zrange(key, 0, -1)]
        else:
            raise AssertionError(f"{name}: a {kind} this scanner does not read")
    return out


async def aof_files(client) -> list[Path]:
    directory = Path((await client.config_get("dir"))["dir"])
    sub = (await client.config_get("appenddirname")).get("appenddirname", "appendonlydir")
    return sorted(p for p in (directory / sub).glob("*") if p.is_file()) + sorted(directory.glob("*.aof"))


async def leaks(client) -> dict[str, list[str]]:
    """Where a card number is in clear: each key name and value, and the AOF files."""
    texts = {f"valkey {name}": v.decode(errors="replace") for name, v in await everything_in(client)}
    texts.update({f"aof {p.name}": p.read_bytes().decode(errors="replace") for p in await aof_files(client)})
    return {where: found for where, text in texts.items() if (found := card_numbers(text))}
