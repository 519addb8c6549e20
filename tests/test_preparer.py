"""Request preparation in worker processes (engine/preparer.py) against the same work done on
the calling thread: the default model's tokenizer and chat template, the default packs."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finsieve.engine.preparer import Message, Preparer
from finsieve.errors import RequestError
from finsieve.policy.pack import Pack

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    [Message("user", "What is an index fund?")],
    [Message("system", "You answer briefly."), Message("user", "My card is 4111 1111 1111 1111.")],
    [Message("user", "Can you give me insider tips on ACME before the merger?")],  # halts
    [Message("user", "Mail me at jane.doe@example.com and call +44 20 7946 0958.")],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def pool(tokenizer):
    preparer = Preparer(tokenizer, 512, workers=2)
    preparer.wait_ready()
    assert preparer.workers == 2
    yield preparer
    preparer.close()


def _pack(tmp: Path, word: str) -> Pack:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "p.yaml").write_text(
        "rules:\n  - id: secret-word\n    description: a word the model may not read\n"
        "    kind: literal\n    scope: input\n    action: redact\n    replacement: '[W]'\n"
        f"    patterns: ['{word}']\n")
    return Pack.load(tmp)


def test_workers_prepare_what_the_calling_thread_would(tokenizer, pool) -> None:
    pack = Pack.load(REPO / "rules")
    inline = Preparer(tokenizer, 512, workers=0)
    for messages in PROMPTS:
        here = inline.prepare(messages, pack.input, pack.version)
        there = pool.prepare(messages, pack.input, pack.version)
        assert there.ids == here.ids
        assert there.verdict == here.verdict
    verdicts = [pool.prepare(m, pack.input, pack.version).verdict for m in PROMPTS]
    assert [v.halted for v in verdicts] == [False, False, True, False]
    assert {i.rule_id for i in verdicts[1].events} == {"payment-card-number"}
    assert "4111" not in verdicts[1].messages[1]["content"]


def test_a_new_policy_version_reaches_every_worker(tokenizer, pool, tmp_path: Path) -> None:
    messages = [Message("user", "Tell me about the alpha fund and the beta fund.")]
    for word in ("alpha", "beta", "alpha"):  # the third: a version the workers already hold
        pack = _pack(tmp_path / word, word)
        for _ in range(4):  # more requests than workers: each worker answers some
            verdict = pool.prepare(messages, pack.input, pack.version).verdict
            assert [i.suppressed for i in verdict.events] == [word]
            assert word not in verdict.messages[0]["content"]


def test_refusals_name_the_field_as_on_the_calling_thread(tokenizer) -> None:
    pack = Pack.load(REPO / "rules")
    strict = copy.deepcopy(tokenizer)  # a template that refuses, as many do for a misplaced role
    strict.chat_template = "{{ raise_exception('system messages must come first') }}"
    cases = [(tokenizer, [Message("user", "word " * 2000)], "the prompt is"),
             (strict, PROMPTS[0], "the model's chat template rejected them")]
    for tok, messages, says in cases:
        pool = Preparer(tok, 512, workers=1)
        pool.wait_ready()
        errors = []
        for preparer in (Preparer(tok, 512, workers=0), pool):
            with pytest.raises(RequestError) as e:
                preparer.prepare(messages, pack.input, pack.version)
            errors.append((e.value.code, e.value.field, e.value.message))
        pool.close()
        assert errors[0] == errors[1]
        assert errors[1][1] == "messages" and says in errors[1][2]


def test_a_dead_worker_fails_no_request(tokenizer) -> None:
    pack = Pack.load(REPO / "rules")
    preparer = Preparer(tokenizer, 512, workers=1)
    preparer.wait_ready()
    expected = Preparer(tokenizer, 512, workers=0).prepare(PROMPTS[1], pack.input, pack.version)
    assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    (pid,) = preparer._pool._processes  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    for _ in range(3):  # prepared on the calling thread from now on
        assert preparer.prepare(PROMPTS[1], pack.input, pack.version) == expected
    assert preparer.workers == 0
