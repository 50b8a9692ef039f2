"""Byte-level tokenizer for generated models: 256 byte symbols, no merges, Llama-3 special tokens.

Token id ``b`` (0..255) is the raw byte ``b``; the special tokens follow at 256.. in
the order of ``SPECIAL_TOKENS``. Decoding maps ids back to bytes, so any UTF-8 text
round-trips.
"""

import asyncio
import json
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
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
    _remember_bound(tokenizer)
    return tokenizer


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    tokenizer = Tokenizer.from_file(str(path))
    _remember_bound(tokenizer)  # here, at start-up: it reads the whole vocabulary (about 0.2 s)
    return tokenizer


class TooManyTokens(ValueError):
    """A text of more tokens than the caller's bound.

    ``count``: how many, or at least how many when ``at_least`` (counted from its bytes, not tokenized).
    """

    def __init__(self, count: int, bound: int, at_least: bool = False) -> None:
        super().__init__(f"{'at least ' if at_least else ''}{count} tokens exceed {bound}")
        self.count = count
        self.at_least = at_least


def too_long(tokens: int, context_len: int, at_least: bool = False) -> str:
    """The refusal of a prompt of ``tokens`` tokens (at least, when counted from its bytes) for a context."""
    least = "at least " if at_least else ""
    return f"the prompt has {least}{tokens} tokens; this model's context length is {context_len}"


def check_prompt_bytes(tokenizer: Tokenizer, text: str, max_tokens: int) -> None:
    """Raise ``TooManyTokens`` (``at_least``) when ``text``'s bytes alone prove more than ``max_tokens`` tokens.

    No tokenizing: a 1 MiB prompt for an 8k context is refused in well under a millisecond, where the gateway
    receives it and again in the Conductor (for gRPC clients).
    """
    if (least := _min_tokens(tokenizer, text)) > max_tokens:
        raise TooManyTokens(least, max_tokens, at_least=True)


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token stands for, where that bounds a text's token count from below.

    That holds where every byte of a text ends up in exactly one token: byte-level BPE (GPT-2, Llama-3,
    SmolLM2) with no normalizer. ``None`` for any other tokenizer (a normalizer may shrink a text, as NFC
    does; SentencePiece adds a prefix space): then no bound is claimed.
    """
    config = json.loads(tokenizer.to_str())
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if config.get("normalizer") is not None or not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    # ByteLevel vocabularies spell each byte as one character; added tokens match their text literally
    longest = max(len(token) for token in tokenizer.get_vocab(with_added_tokens=False))
    added = [len(t.content.encode()) for t in tokenizer.get_added_tokens_decoder().values()]
    return max([longest, *added])


def whole_token_ids(tokenizer: Tokenizer, exclude: set[int], limit: int) -> list[int]:
    """The first ``limit`` ids (not in ``exclude``) whose text alone is whole: non-empty, no partial character.

    A stream sends one chunk per such token; a byte-level vocabulary's lone bytes past ASCII are the
    partial characters an incremental detokenizer holds back until the rest arrives.
    """
    found: list[int] = []
    for token_id in range(tokenizer.get_vocab_size()):
        if token_id not in exclude and (text := tokenizer.decode([token_id])) and "\ufffd" not in text:
            found.append(token_id)
            if len(found) == limit:
                break
    return found


_bytes_bound: "weakref.WeakKeyDictionary[Tokenizer, int | None]" = weakref.WeakKeyDictionary()


def _remember_bound(tokenizer: Tokenizer) -> int | None:
    _bytes_bound[tokenizer] = max_token_bytes(tokenizer)
    return _bytes_bound[tokenizer]


def _min_tokens(tokenizer: Tokenizer, text: str) -> int:
    """A lower bound on ``text``'s token count from its length alone (0 where none holds)."""
    per_token = _bytes_bound[tokenizer] if tokenizer in _bytes_bound else _remember_bound(tokenizer)
    if per_token is None:
        return 0
    return len(text.encode()) // per_token


def _lower_priority() -> None:
    """Run this thread at the lowest CPU priority (Linux nice is per thread; raising it needs no privilege)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


_pool: ThreadPoolExecutor | None = None


async def tokenize_off_loop(tokenizer: Tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """``text``'s token ids, computed on a low-priority thread without the GIL.

    A long prompt delays no other stream, neither on this event loop nor on the cores the workers decode on.

    A text whose bytes alone prove more than ``max_tokens`` tokens (``max_token_bytes``) is refused at once: on
    two cores, tokenizing a 1 MiB prompt took a core for 1-2 s, and the decode streams beside it slowed
    (bench/serve/neighbours.py). Tokenizing runs on threads at nice 19, so decoding workers and the relay
    take the cores first. ``encode_batch`` releases the GIL while it runs (``encode`` holds it: a 1 MB prompt
    froze the event loop for its whole 2 s) and encodes one text on the calling thread. Turning the ids into
    Python ints holds the GIL (about 12 ms for a million): a text of more than ``max_tokens`` tokens raises
    ``TooManyTokens`` before that.
    """
    global _pool
    if max_tokens is not None:
        check_prompt_bytes(tokenizer, text, max_tokens)
    if _pool is None:
        _pool = ThreadPoolExecutor(4, thread_name_prefix="tokenize", initializer=_lower_priority)
    return await asyncio.get_running_loop().run_in_executor(_pool, _ids, tokenizer, text, max_tokens)


def _ids(tokenizer: Tokenizer, text: str, max_tokens: int | None) -> list[int]:
    encoding = tokenizer.encode_batch([text], add_special_tokens=False)[0]
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokens(len(encoding), max_tokens)
    return list(encoding.ids)
