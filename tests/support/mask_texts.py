"""The mask tests' patterns, their evasive spellings, and texts built from their fragments
and a vocabulary's tokens (cut anywhere, often inside a pattern or a character)."""

from __future__ import annotations

from hypothesis import strategies as st

PATTERNS = ["guaranteed returns", "稳赚不赔", "保本保息", "risk free", "no risk at all", "年化15%", "a b",
            "pay", "收益 ok", "доход", "12 bot"]
# Spellings a reader takes for the patterns: look-alike letters (Cyrillic, Greek), invisible
# and control characters, decorating marks, spaces inside CJK phrases; and foreign text that
# only looks like a pattern ("рау" is all Cyrillic: not a match).
EVASIONS = ["guarant\u0435\u0435d returns", "\u0440\u0430y", "\u0440\u0430\u0443", "\u03a1\u0391\u03a5",
            "r\u0456sk\x00free", "no\u202erisk at a\u200dll", "稳 赚 不 赔", "保\u3000本 保\ufe0f息",
            "p\u0301a\u20ddy", "收益\x00ok", "收益 ｏｋ", "д\u043eход", "d\u043ex\u043ed", "12 вот", "вот",
            "１２\u00a0в\u03bft"]
FRAGMENTS = [*PATTERNS, *EVASIONS, "GUARANTEED", "Returns", " ", "  ", "\n", "\u200d", "１５％", "年化",
             "稳赚", "RISK", "\u0435", "\u0430", "\u0440", "\x00", "稳 ", " 赚", "\u3000", "\U000e0041",
             "\u0301"]

def texts(vocab: list[bytes]) -> st.SearchStrategy[bytes]:
    fragment = st.sampled_from(FRAGMENTS).flatmap(
        lambda f: st.integers(1, len(f.encode())).map(lambda k: f.encode()[:k])  # may split a char
    )
    token = st.integers(0, len(vocab) - 1).map(lambda i: vocab[i])
    # Ends with a cut fragment: often inside a pattern, often inside a character.
    head = st.lists(st.one_of(fragment, fragment, token), max_size=5).map(b"".join)
    return st.tuples(head, fragment).map(b"".join)
