"""Checksums that turn a pattern hit into a real identifier (a match counts only if one accepts)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable


def _digits(text: str) -> str:
    return "".join(c for c in text if c.isdecimal())


def luhn(text: str) -> bool:
    """Payment card numbers (ISO/IEC 7812): 13 to 19 digits with a valid Luhn check digit."""
    digits = _digits(text)
    return 13 <= len(digits) <= 19 and _luhn_digits(digits)


# Between the groups of a card number as the default rules print it (`sep` in
# rules/identifiers.yaml: a space, or a dash, dot or slash with a space around or not).
_PLAIN_SEP = re.compile(r"(?: ?[-./] ?| )")
_GROUPS = re.compile(r"\d+")
MAX_RUN_DIGITS = 25  # a longer run of groups is a list of numbers, not a card with a neighbour


def _groups(text: str) -> tuple[list[str], list[str]]:
    """The digit groups of text and what stands between each two."""
    found = list(_GROUPS.finditer(text))
    seps = [text[a.end() : b.start()] for a, b in itertools.pairwise(found)]
    return [g.group() for g in found], seps


def _thousands(groups: list[str]) -> bool:
    """1-3 digits, then groups of three: how an amount is written (1,234,567,890,123)."""
    return len(groups) > 1 and len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:])


def _reads_as_one_number(groups: list[str], seps: list[str]) -> bool:
    """Would a reader take these groups, so separated, for one number? Printed with the
    usual separators, always (the rule's `sep` form). Otherwise: two or three groups of any
    size (8-8, 4-12, 4-6-5), or groups of one size but the last (4-4-4-4-3, 3-3-3-3-4,
    1-1-...-1: digit by digit); not two- or three-digit groups after a comma and a space
    ("12, 15, 18, 21": a list of numbers)."""
    if all(_PLAIN_SEP.fullmatch(s) for s in seps):
        return True
    if len(groups) <= 3:
        return True
    size = len(groups[0])
    if any(len(g) != size for g in groups[1:-1]) or len(groups[-1]) > size + 1:
        return False
    return not (size in (2, 3) and any(" " in s and s.strip(" ") in (",", ";", "，", "、")
                                      for s in seps))


def _luhn_digits(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def card_number(text: str) -> bool:
    """A payment card number as a reader reads it: 13-19 digits in groups that read as one
    number, with a valid Luhn digit; or, in a run of up to 25 digits (an extra group beside a
    card: "4111,1111,1111,1111,7"), consecutive whole groups that are one. The reader sees the
    card there, so the whole run is redacted. Amounts (1,234,567,890,123) are none."""
    groups, seps = _groups(text)
    digits = "".join(groups)
    if not 13 <= len(digits) <= MAX_RUN_DIGITS or not all(d.isdecimal() for d in digits):
        return False
    plain = all(_PLAIN_SEP.fullmatch(s) for s in seps)
    if not plain and _thousands(groups):
        return False
    if len(groups) == 1:  # run together: one number, whole
        return len(digits) <= 19 and _luhn_digits(digits)
    for i in range(len(groups)):
        count = 0
        for j in range(i, len(groups)):
            count += len(groups[j])
            if count > 19:
                break
            if (count >= 13 and _luhn_digits("".join(groups[i : j + 1]))
                    and _reads_as_one_number(groups[i : j + 1], seps[i:j])
                    and _inside_its_run(seps, i, j)):
                return True
    return False


def _inside_its_run(seps: list[str], i: int, j: int) -> bool:
    """Are groups i..j of a run one stretch with the groups beside them: the same separator
    inside and out? "1. 4111 - 1111 - 1111 - 1111" is a list item and a card (the rule
    finds the card by itself, from its first group); "4111 1111 1111 1111 7" is one run."""
    inside = set(seps[i:j])
    beside = {seps[k] for k in (i - 1, j) if 0 <= k < len(seps)}
    return not inside or not beside or (len(inside) == 1 and beside <= inside)


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
    "card_number": card_number,
    "iban_mod97": iban_mod97,
    "cn_resident_id": cn_resident_id,
    "us_ssn": us_ssn,
}
