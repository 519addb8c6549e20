"""Checksums that turn a pattern hit into a real identifier (a match counts only if one accepts)."""

from __future__ import annotations

from collections.abc import Callable


def _digits(text: str) -> str:
    return "".join(c for c in text if c.isdecimal())


def luhn(text: str) -> bool:
    """Payment card numbers (ISO/IEC 7812): 13 to 19 digits with a valid Luhn check digit."""
    digits = _digits(text)
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def iban_mod97(text: str) -> bool:
    """IBAN (ISO 13616): country code, check digits, BBAN; the number mod 97 is 1."""
    s = "".join(c for c in text if c.isascii() and c.isalnum()).upper()
    if not (15 <= len(s) <= 34 and s[:2].isalpha() and s[2:4].isdigit()):
        return False
    moved = s[4:] + s[:4]
    number = "".join(str(int(c, 36)) for c in moved)
    return int(number) % 97 == 1


_CN_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_CHECK = "10X98765432"


def cn_resident_id(text: str) -> bool:
    """PRC resident identity card number (GB 11643): 17 digits and an ISO 7064 check."""
    s = "".join(c for c in text if c.isalnum()).upper()
    if len(s) != 18 or not s[:17].isdecimal() or not (s[17].isdecimal() or s[17] == "X"):
        return False
    month, day = int(s[10:12]), int(s[12:14])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return False
    total = sum(int(d) * w for d, w in zip(s[:17], _CN_WEIGHTS, strict=True))
    return _CN_CHECK[total % 11] == s[17]


def us_ssn(text: str) -> bool:
    """US Social Security number: 9 digits; area not 000, 666 or 900-999, group not 00,
    serial not 0000 (SSA's never-issued ranges)."""
    d = _digits(text)
    return (len(d) == 9 and d[:3] not in ("000", "666") and d[0] != "9" and d[3:5] != "00"
            and d[5:] != "0000")


VALIDATORS: dict[str, Callable[[str], bool]] = {
    "luhn": luhn,
    "iban_mod97": iban_mod97,
    "cn_resident_id": cn_resident_id,
    "us_ssn": us_ssn,
}
