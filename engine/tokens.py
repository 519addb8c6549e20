"""Token ids to text: the exact bytes of every token, and UTF-8-safe incremental text.

A byte-level BPE token can be half of a UTF-8 character, so text is built from bytes and
an incremental decoder keeps an incomplete character pending until its last byte comes.
The per-token byte table is also what the rules engine's mask tables are built from.
"""

from __future__ import annotations

import codecs
import re
from functools import cache

from finsieve.policy.utf8 import replaced_in_step

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"


@cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_byte_table(vocab: dict[str, int], special_ids: set[int]) -> list[bytes]:
    """bytes of each token id; special (control) tokens map to b"" and are never delivered.

    Handles byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2) and SentencePiece pieces
    (`▁` for a space, `<0xNN>` byte fallback).
    """
    size = max(vocab.values()) + 1
    table = [b""] * size
    decoder = _byte_decoder()
    regular = [t for t, i in vocab.items() if i not in special_ids]
    byte_level = all(ch in decoder for t in regular for ch in t)
    for token, idx in vocab.items():
        if idx in special_ids:
            continue
        if byte_level:
            table[idx] = bytes(decoder[ch] for ch in token)
        elif m := _SP_BYTE.match(token):
            table[idx] = bytes([int(m.group(1), 16)])
        else:
            table[idx] = token.replace(_SP_SPACE, " ").encode()
    return table


class IncrementalText:
    """Text of a growing token sequence; an incomplete UTF-8 character stays pending.

    It also knows where each character starts in the raw bytes, the offsets the guard
    releases in: a U+FFFD stands for one to three invalid raw bytes, not for its own three
    UTF-8 bytes, so the text's encoded length is not a raw offset once it holds one.
    """

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = b""  # the decoder's: bytes of a character not yet complete
        self.text = ""
        self.raw_len = 0  # raw bytes of `text` (pending bytes are not in it)
        # (index in text, raw size - 3) of each U+FFFD whose raw size is not 3, in order:
        # the only characters whose UTF-8 form is not their raw bytes.
        self._odd: list[tuple[int, int]] = []

    def add(self, token_id: int) -> str:
        piece = self._table[token_id] if token_id < len(self._table) else b""
        new = self._decoder.decode(piece)
        pending = self._decoder.getstate()[0]
        if "\ufffd" in new:  # rare: invalid bytes, or a U+FFFD the model wrote
            base = len(self.text)
            self._odd += [(base + i, size - 3) for i, size
                          in replaced_in_step(self._pending, piece, pending) if size != 3]
        self.raw_len += len(self._pending) + len(piece) - len(pending)
        self._pending = pending
        self.text += new
        return new

    def raw_offset(self, index: int) -> int:
        """Raw byte offset where character `index` starts; costs the text after it only."""
        tail = len(self.text[index:].encode())
        for i, extra in reversed(self._odd):
            if i < index:
                break
            tail += extra
        return self.raw_len - tail

    def cut(self, index: int) -> None:
        """The text ends before character `index` (a stop string starts there); nothing is
        added after this."""
        self.raw_len = self.raw_offset(index)
        self.text = self.text[:index]
        while self._odd and self._odd[-1][0] >= index:
            self._odd.pop()


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int:
    """Index in `text` where the earliest stop string starts, at or after search_from; -1 if none."""
    hits = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    return min(hits, default=-1)


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could still be the start of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
