"""The Conductor's streaming detokenizer: the deltas of any chunking add up to the whole text, cut before a stop string.

Checked against decoding all tokens at once, on the test model's byte-level tokenizer (random token ids make
split and invalid UTF-8 sequences common) and on a SentencePiece-style one (Metaspace: a word's leading
space belongs to its first token, and decoding drops it at the start of a text).
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.tokenizer import build_byte_level_tokenizer
from services.conductor.detokenizer import Detokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "naïve café déjà vu — 東京 ☃ 🙂", "stop here. end!"] * 20


@functools.cache
def _tokenizers() -> dict[str, Tokenizer]:
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    metaspace.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    return {"byte-level": build_byte_level_tokenizer(), "metaspace": metaspace}


def _expected(tokenizer: Tokenizer, token_ids: list[int], stop: list[str]) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [at for s in stop if (at := text.find(s)) != -1]
    return text[: min(cuts)] if cuts else text


@st.composite
def _streams(draw: st.DrawFn) -> tuple[str, list[list[int]], list[str]]:
    name = draw(st.sampled_from(sorted(_tokenizers())))
    vocab = _tokenizers()[name].get_vocab_size()
    token_ids = draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(token_ids)), max_size=12)))
    chunks = [token_ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(token_ids)], strict=True)]
    stop = draw(st.lists(st.text("abcdefghij .!e", min_size=1, max_size=3), max_size=2))
    return name, chunks, stop


@settings(max_examples=400, deadline=None)
@given(_streams())
def test_streamed_deltas_equal_the_whole_decoded_text_cut_at_the_first_stop(stream):
    name, chunks, stop = stream
    tokenizer = _tokenizers()[name]
    detok = Detokenizer(tokenizer, stop)
    out = ""
    for chunk in chunks:
        out += detok.add(chunk)
        assert not any(s in out for s in stop), "a stop string reached the client"
        if detok.stopped:
            break
    out += detok.flush()
    assert out == _expected(tokenizer, [t for c in chunks for t in c], stop)


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    detok = Detokenizer(build_byte_level_tokenizer())
    euro = list("€".encode())  # the byte-level tokenizer's ids are the bytes
    assert detok.add([ord("a"), euro[0]]) == "a"
    assert detok.add([euro[1]]) == ""
    assert detok.add([euro[2]]) == "€"


def test_text_that_may_grow_into_a_stop_string_is_held_back():
    detok = Detokenizer(build_byte_level_tokenizer(), ["END"])
    assert detok.add(list(b"abcE")) == "abc"
    assert detok.add(list(b"N")) == ""
    assert detok.add(list(b"D and more")) == ""
    assert detok.stopped
