"""Incremental detokenizer with stop strings: never emits broken UTF-8, always emits the last token."""
from __future__ import annotations

from common.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes and every token adds at least one, so an incomplete
# character never spans more than this many pending tokens: more pending means invalid bytes.
MAX_PENDING = 3


class IncrementalDetokenizer:
    def __init__(self, tok: TextTokenizer, stop: list[str]):
        self.tok, self.stop = tok, stop
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far
        self.emitted = 0  # chars of `text` already handed out
        self._prefix = 0  # token index where the decode window starts (bounded cost per token)
        self._read = 0
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> str:
        """Feed one token; returns newly final text (may be empty while a UTF-8 char is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
        full = self.tok.decode(self.ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            self._commit(full[len(prefix_text):], len(self.ids))
        elif len(self.ids) - self._read > MAX_PENDING:
            self._commit_invalid(prefix_text, full)
        return self._release(final=False)

    def _commit(self, new_text: str, read: int) -> None:
        self.text += new_text
        self._prefix, self._read = self._read, read

    def _commit_invalid(self, prefix_text: str, full: str) -> None:
        """Too many tokens pending for one incomplete character: the text holds invalid bytes
        (a model can emit any byte token). Release it as U+FFFD up to the latest token boundary
        that does not cut a character (its text is a prefix of the full decode), keeping at most
        MAX_PENDING tokens back for a character that may still complete."""
        for end in range(len(self.ids) - MAX_PENDING, self._read, -1):
            head = self.tok.decode(self.ids[self._prefix:end])
            if len(head) > len(prefix_text) and full.startswith(head):
                self._commit(head[len(prefix_text):], end)
                return

    def stop_hit(self) -> bool:
        """True once a stop string appeared; the text is cut just before it."""
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def finish(self) -> str:
        """Flush everything left, including a trailing incomplete character."""
        tail = self.tok.decode(self.ids[self._prefix:])
        done = self.tok.decode(self.ids[self._prefix:self._read])
        if len(tail) > len(done):
            self.text += tail[len(done):]
            self._read = len(self.ids)
        self.stop_hit()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        if self.stop and not final:
            for s in self.stop:  # never hand out text that a stop string will remove
                at = self.text.find(s, max(0, self.emitted - len(s)))
                if at >= 0:
                    end = min(end, at)
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
