"""Constrained rows on the agent: one llguidance matcher per constrained sequence, advanced by every
token the agent samples for it, and each constrained row's logits masked to what its grammar allows
before sampling. The grammar lives here, not in the server, because the agent samples: a fed (`a`)
row's mask needs the token sampled one step before, which the server has not seen yet when it
sends the next step. A step's header brings a grammar with the sequence's outputs so far when the
sequence is (re)admitted (docs/protocol.md, `grammars`); that rebuilds its matcher from scratch."""
from __future__ import annotations

import llguidance as llg
import llguidance.numpy as lln
import numpy as np


class Grammars:
    def __init__(self, tok: llg.LLTokenizer, vocab: int):
        self.tok, self.vocab = tok, vocab
        self.matchers: dict[int, llg.LLMatcher] = {}
        self._mask = lln.allocate_token_bitmask(1, vocab)

    def start(self, seq: int, grammar: str, outputs: list[int]) -> None:
        """A matcher for `seq` that has consumed its outputs so far (a bad grammar or output leaves
        it in its error state: the row then fails)."""
        m = llg.LLMatcher(self.tok, grammar)
        if outputs:
            m.consume_tokens(outputs)
        self.matchers[seq] = m

    def free(self, seq: int) -> None:
        self.matchers.pop(seq, None)

    def constrained(self, seq_ids: np.ndarray) -> list[tuple[int, llg.LLMatcher]]:
        """(row, matcher) of each row whose sequence has a grammar."""
        if not self.matchers:
            return []
        return [(r, m) for r, s in enumerate(seq_ids.tolist()) if (m := self.matchers.get(s)) is not None]

    def mask(self, logits: np.ndarray, rows: list[tuple[int, llg.LLMatcher]]) -> np.ndarray:
        """In place: each constrained row's disallowed tokens to -inf. Returns the rows whose
        grammar is in its error state (they fail)."""
        failed = np.zeros(logits.shape[0], bool)
        for r, m in rows:
            if m.is_error():
                failed[r] = True
                continue
            lln.fill_next_token_bitmask(m, self._mask, 0)
            allowed = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little", count=self.vocab)
            np.putmask(logits[r], allowed[:logits.shape[1]] == 0, -np.inf)
        return failed

    def consume(self, rows: list[tuple[int, llg.LLMatcher]], ids: np.ndarray) -> None:
        for r, m in rows:
            if ids[r] >= 0:
                m.consume_token(int(ids[r]))
