"""Byte-level tokenizer for generated models: 256 byte symbols, no merges, Llama-3 special tokens.

Token id ``b`` (0..255) is the raw byte ``b``; the special tokens follow at 256.. in
the order of ``SPECIAL_TOKENS``. Decoding maps ids back to bytes, so any UTF-8 text
round-trips.
"""

import asyncio
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOT_TOKEN)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_level_tokenizer() -> Tokenizer:
    """Build the byte-level BPE tokenizer (id == byte value) with the special tokens appended."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


class TooManyTokens(ValueError):
    """A text of more tokens than the caller's bound (``count``: how many)."""

    def __init__(self, count: int, bound: int) -> None:
        super().__init__(f"{count} tokens exceed {bound}")
        self.count = count


async def tokenize_off_loop(tokenizer: Tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """``text``'s token ids, computed on a thread without the GIL: a long prompt delays no other stream.

    ``encode_batch`` releases the GIL while it runs (``encode`` holds it: measured here, a 1 MB prompt froze the
    event loop for its whole 2 s). Turning the ids into Python ints holds it, on whichever thread (about 12 ms
    for a million): a text of more than ``max_tokens`` tokens raises ``TooManyTokens`` before that.
    """
    return await asyncio.to_thread(_ids, tokenizer, text, max_tokens)


def _ids(tokenizer: Tokenizer, text: str, max_tokens: int | None) -> list[int]:
    encoding = tokenizer.encode_batch([text], add_special_tokens=False)[0]
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokens(len(encoding), max_tokens)
    return list(encoding.ids)
