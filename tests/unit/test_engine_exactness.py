"""Greedy output must not depend on how the KV was produced (cache hit, chunking, batching, transfer)."""

from pathlib import Path

import pytest
from conftest_engine import make_tiny_model, prefill_then_decode, random_prompt

from engine.llm_engine import LLMEngine, generate
from engine.outputs import StepOutput
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = random_prompt(70, seed=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> list[int]:
    engine = LLMEngine(model_dir, num_blocks=64, enable_prefix_caching=False)
    return generate(engine, PROMPT, GREEDY)


def run_all(engine: LLMEngine) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outputs: list[StepOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_prefix_cache_hit_gives_identical_output(model_dir: Path, baseline: list[int]) -> None:
    engine = LLMEngine(model_dir, num_blocks=64)
    engine.add_request("warm", PROMPT[:40] + [1, 2, 3], GREEDY)
    run_all(engine)
    engine.add_request("partial", PROMPT, GREEDY)
    partial = run_all(engine)["partial"]
    assert partial[0].num_cached_tokens == 32 and tokens(partial) == baseline
    engine.add_request("full", PROMPT, GREEDY)
    full = run_all(engine)["full"]
    assert full[0].num_cached_tokens == 64 and tokens(full) == baseline  # last prompt token recomputed
    assert engine.block_manager.num_hit_tokens == 96
    assert engine.num_free_blocks == 64


def test_whole_prompt_in_cache_still_recomputes_last_token(model_dir: Path) -> None:
    prompt = random_prompt(64, seed=11)
    engine = LLMEngine(model_dir, num_blocks=64)
    first = generate(engine, prompt, GREEDY)
    engine.add_request("again", prompt, GREEDY)
    outputs = run_all(engine)["again"]
    assert outputs[0].num_cached_tokens == 48 and tokens(outputs) == first


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_gives_identical_output(model_dir: Path, baseline: list[int], chunk: int) -> None:
    engine = LLMEngine(model_dir, num_blocks=64, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert generate(engine, PROMPT, GREEDY) == baseline


def test_mixed_batch_gives_identical_output(model_dir: Path, baseline: list[int]) -> None:
    others = {f"r{i}": random_prompt(n, seed=20 + i) for i, n in enumerate([5, 17, 90, 33])}
    solo_engine = LLMEngine(model_dir, num_blocks=64)
    solo = {rid: generate(solo_engine, p, GREEDY) for rid, p in others.items()}
    engine = LLMEngine(model_dir, num_blocks=64, max_num_batched_tokens=50)
    engine.add_request("main", PROMPT, GREEDY)
    for rid, prompt in others.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = run_all(engine)
    assert tokens(outputs["main"]) == baseline
    assert {rid: tokens(outputs[rid]) for rid in others} == solo


def test_decode_is_one_forward_per_step(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=64)
    for i, n in enumerate([3, 20, 41]):
        engine.add_request(f"r{i}", random_prompt(n, seed=i), SamplingParams(max_tokens=5, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 5  # one prefill step packing all three, then four batched decode steps


def test_prefill_decode_split_gives_identical_output(model_dir: Path, baseline: list[int]) -> None:
    prefill = LLMEngine(model_dir, num_blocks=16, max_num_batched_tokens=32)
    decode = LLMEngine(model_dir, num_blocks=32, block_size=16)
    assert prefill_then_decode(prefill, decode, "split", PROMPT, GREEDY) == baseline
    assert prefill.num_free_blocks == 16 and decode.num_free_blocks == 32
    assert prefill_then_decode(prefill, decode, "split-hit", PROMPT, GREEDY) == baseline
    assert prefill.block_manager.num_hit_tokens == 64


def test_prefilled_request_finishing_on_its_first_token(model_dir: Path) -> None:
    decode = LLMEngine(model_dir, num_blocks=8)
    params = SamplingParams(max_tokens=1, temperature=0)
    assert decode.reserve("one", 10, params) is not None
    out = decode.add_prefilled_request("one", list(range(10)), 7, params)
    assert out is not None and out.finished and out.finish_reason == "length" and out.new_token_ids == [7]
    assert decode.num_free_blocks == 8 and not decode.has_unfinished_requests()


def test_arrivals_do_not_stall_running_decodes(model_dir: Path, baseline: list[int]) -> None:
    engine = LLMEngine(model_dir, num_blocks=256, max_num_batched_tokens=32)
    engine.add_request("main", PROMPT, GREEDY)
    main: list[int] = []
    while not main:
        main += [t for o in engine.step() if o.request_id == "main" for t in o.new_token_ids]
    for i in range(GREEDY.max_tokens - 1):  # a 40-token prompt arrives before every step
        engine.add_request(f"arrival-{i}", random_prompt(40, seed=100 + i), SamplingParams(max_tokens=2))
        (out,) = [o for o in engine.step() if o.request_id == "main"]
        main += out.new_token_ids
    assert out.finished and main == baseline
    assert engine.stats().num_waiting + engine.stats().num_running > 0  # the arrivals are still queued
