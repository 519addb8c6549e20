"""The matcher as it was before readings were built from checkpoints: the oracle of the
readings tests and bench/bench_readings.py."""

from __future__ import annotations

import itertools

from finsieve.policy.matcher import StreamMatcher


class Replaying(StreamMatcher):
    """The matcher as it was: another reading starts fed every earlier token again."""

    replayed = 0  # tokens fed again

    def _reading(self, reading: str) -> StreamMatcher:
        other = StreamMatcher(self.rules, self._deadline, other=reading)
        raw, checkpoints = self.raw, self._checkpoints
        for a, b in itertools.pairwise(checkpoints):
            other.feed(bytes(raw[a.raw_len : b.raw_len]))
            self.replayed += 1
        return other
