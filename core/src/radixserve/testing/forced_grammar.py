"""A grammar matcher that forces a fixed token sequence, then end-of-sequence: the
building block of test grammar backends (the scheduler's grammar path and the
fault-injection plugin)."""

from __future__ import annotations

from radixserve.grammar import GrammarMatcher
from radixserve.sampling.bitmask import set_bit

__all__ = ["ForcedMatcher", "set_bit"]


class ForcedMatcher(GrammarMatcher):
    """Allows ``ids`` one at a time, then only ``eos``; with ``reject`` it refuses every
    token (a matcher contradicting its own mask)."""

    def __init__(self, ids: list[int], eos: list[int], reject: bool = False) -> None:
        self.ids, self.eos, self.reject = ids, eos, reject
        self.pos = 0
        self.ended = False

    def allowed(self) -> list[int]:
        return [self.ids[self.pos]] if self.pos < len(self.ids) else self.eos

    def fill_bitmask(self, bitmask, row):
        bitmask[row].zero_()
        for t in self.allowed():
            set_bit(bitmask, row, t)

    def accept_token(self, token_id):
        if self.reject or token_id not in self.allowed():
            return False
        if self.pos < len(self.ids):
            self.pos += 1
        else:
            self.ended = True
        return True

    def rollback(self, num_tokens):
        self.pos -= num_tokens

    def is_terminated(self):
        return self.ended
