"""The emulated engine: real scheduling and KV blocks, the forward pass a wait from a profile.

Its tokens are a function of the chain values in the KV pool, so every path a real model takes gives
the same output only if the KV really arrived: a prefix-cache hit, KV bytes copied into a decode
engine's reserved blocks. Corrupted KV changes the output.
"""

import dataclasses
from pathlib import Path

import pytest
from conftest_engine import make_tiny_model, prefill_then_decode, random_prompt

from engine.emulated_runner import Emulation
from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams
from engine.tokenizer import load_tokenizer
from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel
from services.conductor.detokenizer import Detokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0)
EMULATION = Emulation(PrefillModel(0.002, 1e-5, 1e-9), DecodeModel(0.001, 1e-5, 1e-8), time_scale=0.5,
                      kv_bytes_per_token=32, max_model_len=4096)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def _engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    return LLMEngine(model_dir, num_blocks=64, block_size=16, emulation=EMULATION, **kwargs)  # type: ignore[arg-type]


def test_outputs_are_the_same_on_every_path_and_depend_on_the_kv(model_dir: Path) -> None:
    prompt = random_prompt(200, seed=3)
    engine = _engine(model_dir)
    expected = generate(engine, prompt, GREEDY)
    assert len(expected) == GREEDY.max_tokens  # never an EOS: emulated requests run to max_tokens
    assert all(t not in engine.config.eos_token_ids for t in expected)
    assert generate(engine, prompt, GREEDY) == expected  # a prefix-cache hit
    assert engine.stats().prefix_cache_hit_tokens >= 192
    chunked = _engine(model_dir, max_num_batched_tokens=48)
    assert generate(chunked, prompt, GREEDY) == expected
    assert prefill_then_decode(_engine(model_dir), _engine(model_dir), "r", prompt, GREEDY) == expected  # KV moved
    assert generate(engine, prompt[:-1] + [prompt[-1] ^ 1], GREEDY) != expected

    cached = _engine(model_dir)
    generate(cached, prompt, GREEDY)
    cached.kv_pool.data.zero_()  # the cached prefix's KV is lost, its blocks still indexed
    assert generate(cached, prompt, GREEDY) != expected


def test_every_output_token_streams_as_a_chunk_of_its_own(model_dir: Path) -> None:
    """A client measures TBT from the gaps between chunks: an emulated token must be one (tiny-llama's lone bytes
    past ASCII would be held back by the detokenizer and sent with the next)."""
    engine = _engine(model_dir)
    detokenizer = Detokenizer(load_tokenizer(model_dir))
    outputs = [generate(engine, random_prompt(50, seed=s), SamplingParams(max_tokens=40, temperature=0))
               for s in range(5)]  # fmt: skip
    assert all(detokenizer.add([t]) for out in outputs for t in out)
    assert len({t for out in outputs for t in out}) > 20  # still spread over many ids


def test_a_step_waits_the_profile_time_scaled(model_dir: Path) -> None:
    engine = _engine(model_dir, max_num_batched_tokens=64)
    waits: list[float] = []
    engine.runner._sleep = waits.append  # type: ignore[union-attr]
    engine.runner._clock = lambda: 0.0  # type: ignore[union-attr]
    engine.add_request("a", random_prompt(100, seed=1), SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # chunk 1: 64 new tokens
    engine.step()  # chunk 2: 36 new after 64
    engine.step()  # one decode of context 101
    p, d = EMULATION.prefill, EMULATION.decode
    expected = [p.predict(64, 0), p.predict(36, 64), d.predict(1, 101)]
    assert waits == pytest.approx([s * EMULATION.time_scale for s in expected])


def test_a_transfer_takes_the_emulated_models_kv_time_on_the_emulated_link() -> None:
    link = TransferModel.from_gbps(100.0, latency_s=0.001)
    emulation = dataclasses.replace(EMULATION, link=link, model_bytes_per_token=327680)
    tokens = 4000
    assert emulation.transfer_seconds(tokens * 32) == pytest.approx(link.predict(tokens * 327680) * 0.5)
    assert EMULATION.transfer_seconds(tokens * 32) == 0.0  # no link: as fast as the real bytes go


def test_bad_emulation_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        Emulation(EMULATION.prefill, EMULATION.decode, kv_bytes_per_token=24)
    with pytest.raises(ValueError, match="time_scale"):
        Emulation(EMULATION.prefill, EMULATION.decode, time_scale=0)
