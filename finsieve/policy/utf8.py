"""The raw bytes behind Python's U+FFFD replacement characters.

`decode("utf-8", "replace")` writes one U+FFFD per maximal invalid subsequence: a stray
byte (1), a character cut short (up to 3), each byte of an overlong or a surrogate (1).
Raw byte offsets must know each one's size: the text's encoded length counts 3 for each.
Shared by the policy's normalized view and the engine's incremental text, so both map a
character to the same raw bytes.
"""

from __future__ import annotations


def replaced(data: bytes) -> list[tuple[int, int]]:
    """(index in data.decode("utf-8", "replace"), raw size) of each U+FFFD that stands for
    invalid bytes. The strict decoder's errors are the spans "replace" puts one U+FFFD for,
    decoding again from each one's end, so these are Python's own sizes."""
    out: list[tuple[int, int]] = []
    pos = chars = 0
    while True:
        try:
            data[pos:].decode()
            return out
        except UnicodeDecodeError as e:
            chars += len(data[pos : pos + e.start].decode())
            out.append((chars, e.end - e.start))
            chars += 1
            pos += e.end


def replaced_in_step(before: bytes, piece: bytes, after: bytes) -> list[tuple[int, int]]:
    """replaced() of what an incremental decoder just decoded: the bytes pending `before`
    it and `piece`, less those still pending `after` (they are decoded later)."""
    consumed = len(before) + len(piece) - len(after)
    return replaced((before + piece)[:consumed])
