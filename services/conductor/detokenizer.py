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
    """Turns a growing list of token ids into text deltas; finds stop strings.

    Decoding is incremental: the text of the tokens up to ``_read`` is kept, and new tokens are decoded
    together with the tokens since ``_prefix`` (the last chunk) so that what a tokenizer does at the
    start of a text (drop a word's leading space) or across tokens (join the bytes of one character)
    comes out as in one decode of the whole. The boundary moves only where the text is complete, and the
    window starts at tokens that have text of their own (not at special tokens alone).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self._text = ""  # the text of token_ids[:_read]
        self._prefix = 0
        self._read = 0
        self._emitted = 0  # characters of the full text already returned
        self.stopped = False

    def _decode(self) -> str:
        """The text of every token so far, decoding only those after ``_prefix``."""
        window = self.tokenizer.decode(self.token_ids[self._prefix :], skip_special_tokens=True)
        before = self.tokenizer.decode(self.token_ids[self._prefix : self._read], skip_special_tokens=True)
        if not window.startswith(before):  # a tokenizer whose decode is not local: decode everything
            return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        text = self._text + window[len(before) :]
        complete = not text.endswith(REPLACEMENT)  # later tokens cannot change it
        if complete and len(self.token_ids) > self._read:
            if len(text) > len(self._text):  # the next window starts at these tokens: they give it context
                self._prefix = self._read
            self._text, self._read = text, len(self.token_ids)
        return text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to emit (sets ``stopped`` on a stop string)."""
        self.token_ids.extend(token_ids)
        text = self._decode()
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
        text = self._decode()
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
