"""Token-mask tables: the ban set is exactly the tokens that would complete a literal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokens import token_byte_table
from finsieve.policy.masks import MaskTables, TokenTable
from finsieve.policy.matcher import StreamMatcher
from finsieve.policy.normalize import normalize
from finsieve.policy.pack import RuleSet
from finsieve.policy.schema import Rule

from support.mask_texts import EVASIONS, PATTERNS, texts

RULES = RuleSet([Rule("r", "d", "literal", tuple(PATTERNS), "output", "block", "", (), 20,
                      "high", (), "", "test")])


@pytest.fixture(scope="module")
def bpe_vocab(default_model_dir: Path) -> list[bytes]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return token_byte_table(tok.get_vocab(), special)


def sentencepiece_vocab() -> list[bytes]:
    """A SentencePiece-style vocabulary: ▁ for spaces and <0xNN> byte fallback."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁guaranteed", "▁returns", "▁return", "s", "▁risk", "▁free", "▁no", "▁at", "▁all",
             "guarant", "eed", "▁re", "turn", "稳", "赚", "不赔", "稳赚", "保本", "保息", "年化", "15",
             "%", "▁a", "▁b", "b", "▁", "▁GUARANTEED", "▁Risk", "▁FREE", "▁a▁b", "▁pay", "p", "ay",
             "▁р", "а", "у", "ау", "▁ра", "е", "ее", "д", "ох", "од", "收益", "▁ok", "ok", "▁o", "▁赚",
             "赚▁", "▁收益", "\u200d", "\x00", "▁12", "▁вот", "от", "▁bot", "t"]
    vocab = {p: i for i, p in enumerate(pieces + words)}
    return token_byte_table(vocab, special_ids={0, 1, 2})


def completing(text: bytes, tokens: list[bytes]) -> list[bool]:
    """Ground truth: does the streaming matcher report a new literal match for each token?
    In the first reading of invisibles (normalize.py): the mask is exact for it; a match of
    the other reading only is refused after sampling (tests/unit/test_invisibles.py)."""
    m = StreamMatcher(RULES, second_reading=False)
    m.feed(text)
    out = []
    for token in tokens:
        out.append(bool(m.feed(token)))
        m.rollback(1)
    return out


def check_exact(vocab: list[bytes], tables: MaskTables, data: st.DataObject) -> None:
    text = data.draw(texts(vocab))
    m = StreamMatcher(RULES)
    m.feed(text)
    banned = set(tables.ban_set_for(m))
    # Random tokens, banned ones, tokens that start with the rest of some pattern, and
    # tokens that start with UTF-8 continuation bytes (they complete a pending character).
    candidates = data.draw(st.lists(st.integers(0, len(vocab) - 1), min_size=20, max_size=20))
    candidates += sorted(banned)[:10]
    candidates += [i for group in tables.tokens.groups.values() for i in group.ids]
    for p in PATTERNS:
        for k in range(1, len(p)):
            candidates += tables.tokens.index.starting_with(p[k:])[:3]
            candidates += tables.tokens.index.starting_with(" " + p[k:])[:3]
    truth = completing(text, [vocab[t] for t in candidates])
    for t, completes in zip(candidates, truth, strict=True):
        assert completes == (t in banned), (text, vocab[t])
        assert completes == tables.is_banned(m, t, vocab[t]), (text, vocab[t])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ban_set_is_exact_for_byte_level_bpe(bpe_vocab, data):
    check_exact(bpe_vocab, _tables(bpe_vocab), data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_ban_set_is_exact_for_sentencepiece(data):
    vocab = sentencepiece_vocab()
    check_exact(vocab, _tables(vocab), data)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_ban_set_is_exact_at_every_byte_cut_of_every_pattern(request, kind):
    """Every cut, inside characters too, in several contexts: no sampling luck involved."""
    vocab = request.getfixturevalue("bpe_vocab") if kind == "bpe" else sentencepiece_vocab()
    tables = _tables(vocab)
    everyone = set(range(len(vocab))) if kind == "sentencepiece" else None
    groups = {i for g in tables.tokens.groups.values() for i in g.ids}
    # Each text is checked once, against every candidate that any of the patterns cut to it
    # brings: about half the cuts give a text already seen (a variant that upper() or doubled
    # spaces leave unchanged, a pattern's prefix that its evasion shares, the same bytes
    # after another context). The pairs checked are the same as cut by cut.
    cases: dict[bytes, set[int]] = {}
    for pattern in PATTERNS + EVASIONS:
        norm = normalize(pattern)
        starting = everyone or {i for k in range(len(pattern)) for i in [
            *tables.tokens.index.starting_with(norm[k:])[:50],
            *tables.tokens.index.starting_with(" " + norm[k:])[:50]]}
        for variant in (pattern, pattern.upper(), pattern.replace(" ", "  ")):
            data = variant.encode()
            for cut in range(1, len(data)):
                for context in (b"", b"Well ", "　".encode(), "好".encode(), "好 ".encode()):
                    cases.setdefault(context + data[:cut], set()).update(starting)
    for text, starting in cases.items():
        m = StreamMatcher(RULES)
        m.feed(text)
        banned = set(tables.ban_set_for(m))
        candidates = sorted(everyone or banned | groups | starting)
        truth = completing(text, [vocab[t] for t in candidates])
        for t, completes in zip(candidates, truth, strict=True):
            assert completes == (t in banned), (text, vocab[t])
            assert completes == tables.is_banned(m, t, vocab[t]), (text, vocab[t])


_CACHE: dict[int, MaskTables] = {}


def _tables(vocab: list[bytes]) -> MaskTables:
    if id(vocab) not in _CACHE:
        _CACHE.clear()
        _CACHE[id(vocab)] = MaskTables(TokenTable.build(vocab), PATTERNS)
    return _CACHE[id(vocab)]


def test_sentencepiece_bytes_are_decoded():
    vocab = sentencepiece_vocab()
    table = TokenTable.build(vocab)
    assert vocab[3 + 0xE7] == b"\xe7"
    ids = {table.contrib[i]: i for i in range(len(vocab))}
    assert " guaranteed" in ids and " a b" in ids


def test_tables_are_persisted_keyed_by_tokenizer_and_version_and_rebuilt_when_stale(tmp_path):
    vocab = sentencepiece_vocab()
    tokens = TokenTable.load_or_build(vocab, tmp_path)
    (fp_dir,) = tmp_path.iterdir()
    assert fp_dir.name == tokens.fingerprint and (fp_dir / "tokens.json.gz").exists()
    again = TokenTable.load_or_build(vocab, tmp_path)
    assert again.contrib == tokens.contrib

    tables = MaskTables.load_or_build(tokens, PATTERNS, "v1", tmp_path)
    stored = json.loads((fp_dir / "v1.banned.json").read_text())
    assert stored["always_banned"] == tables.always_banned != []
    # The same version name over other patterns is stale: rebuilt, not trusted.
    other = MaskTables.load_or_build(tokens, ["free"], "v1", tmp_path)
    assert other.always_banned != tables.always_banned
    assert json.loads((fp_dir / "v1.banned.json").read_text())["always_banned"] == other.always_banned
    # A damaged file is rebuilt too.
    (fp_dir / "tokens.json.gz").write_bytes(b"garbage")
    assert TokenTable.load_or_build(vocab, tmp_path).contrib == tokens.contrib
    assert TokenTable.load_or_build(vocab[:-1], tmp_path).fingerprint != tokens.fingerprint


def test_an_optimistic_token_asks_the_exact_mask_only_when_it_completes_a_block_literal(tmp_path):
    """Guard.check(exact_mask=True), for a token sampled under the base bans only: None, and
    nothing fed, when the exact mask bans it; the mask is asked only when the token completed
    a block literal; a block regex is decided as without the flag."""
    from finsieve.policy.guard import Guard, Verdict, compile_policy

    (tmp_path / "p.yaml").write_text(
        "rules:\n"
        "  - {id: promise, description: d, kind: literal, action: block, patterns: [risk free]}\n"
        "  - {id: ssn, description: d, kind: regex, action: block, max_span: 11,\n"
        "     patterns: ['\\b\\d{3}-\\d{2}-\\d{4}\\b']}\n")
    vocab = sentencepiece_vocab()
    policy = compile_policy(tmp_path, TokenTable.build(vocab), None)[0]
    assert policy.masks is not None
    ids = {p: i for i, p in enumerate(vocab)}
    asked = []
    is_banned = policy.masks.is_banned
    policy.masks.is_banned = lambda *a: asked.append(a[1]) or is_banned(*a)  # type: ignore[method-assign]

    guard = Guard(policy, vocab)
    for word in (b" no", b" risk"):
        decision = guard.check(ids[word], exact_mask=True)
        assert decision is not None and decision.verdict is Verdict.ACCEPT
    assert asked == []
    tokens, raw = list(guard.tokens), guard.matcher.norm.raw_len
    free = ids[b" free"]
    assert guard.check(free, exact_mask=True) is None
    assert asked == [free]
    assert (guard.tokens, guard.matcher.norm.raw_len, guard.matcher.tokens) == (tokens, raw, len(tokens))
    assert guard.check(free).verdict is not Verdict.ACCEPT  # without the flag: decided as a match

    def fed(exact_mask: bool) -> list:
        g = Guard(policy, vocab)
        return [g.check(ids[bytes([b])], exact_mask=exact_mask) for b in b" 123-45-6789 "]

    asked.clear()
    assert [d.verdict for d in fed(True)] == [d.verdict for d in fed(False)]
    assert Verdict.ACCEPT in {d.verdict for d in fed(True)} != {Verdict.ACCEPT}
    assert asked == []


def test_engines_sharing_a_luts_directory_write_its_files_whole(tmp_path):
    """Four writers at once, as engines sharing a luts volume: no writer fails, no
    temporary file is left, and the file holds one writer's data whole."""
    from concurrent.futures import ThreadPoolExecutor

    from finsieve.policy.masks import _write

    path = tmp_path / "luts" / "table.json.gz"
    blobs = [bytes([i]) * (1 << 16) for i in range(4)]

    def writer(i: int) -> None:
        for _ in range(100):
            _write(path, blobs[i])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))  # re-raises a writer's error
    assert path.read_bytes() in blobs
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert path.stat().st_mode & 0o777 == 0o644
