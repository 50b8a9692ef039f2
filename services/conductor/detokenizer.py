"""Incremental detokenization with stop strings, for streaming text deltas.

Byte-level tokens can split a UTF-8 character; the text of such tokens is held back until the
character is complete (the decoded text would end in U+FFFD). Text that could still grow into a stop
string is held back too, so a stop string never reaches the client, not even in part.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self._emitted = 0  # characters of the full text already returned
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to emit (sets ``stopped`` on a stop string)."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(0, self._emitted - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        if not self.stopped:
            if text.endswith(REPLACEMENT):
                text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self._holdback(text)]
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return delta

    def flush(self) -> str:
        """The held-back text, once generation has ended without a stop string."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
