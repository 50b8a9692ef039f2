"""fp8 (e4m3) KV: a quarter of fp32's bytes, and greedy tokens that mostly agree with fp32 KV."""

from pathlib import Path

import pytest
import torch
from conftest_engine import prefill_then_decode, random_prompt

from engine.attention import SeqChunk, build_batch
from engine.checkpoint import make_model
from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
PROMPTS = [random_prompt(200, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("default"))  # the default shape, as served


def teacher_forced_argmax(engine: LLMEngine, prompt: list[int], continuation: list[int]) -> list[int]:
    """Greedy pick after each prefix of ``continuation``, decoding one token at a time over the pool."""
    table = list(range(engine.kv_pool.num_blocks))
    tokens, picks = prompt + continuation, []
    with torch.inference_mode():
        for start, size in [(0, len(prompt)), *((len(prompt) + i, 1) for i in range(len(continuation) - 1))]:
            batch = build_batch([SeqChunk(tokens[start : start + size], start, table)], engine.kv_pool.block_size)
            hidden = engine.runner.model(batch, engine.kv_pool)
            picks.append(int(engine.runner.model.compute_logits(hidden[batch.last_token_idx]).argmax()))
    return picks


def test_fp8_kv_quarters_block_bytes_and_mostly_agrees(model_dir: Path) -> None:
    fp32 = LLMEngine(model_dir, num_blocks=32)
    fp8 = LLMEngine(model_dir, num_blocks=32, kv_cache_dtype="fp8")
    assert fp8.kv_pool.data.dtype == torch.float8_e4m3fn
    assert fp8.kv_pool.bytes_per_block * 4 == fp32.kv_pool.bytes_per_block
    free_agree = forced_agree = 0
    for prompt in PROMPTS:
        reference = generate(fp32, prompt, GREEDY)
        free_agree += sum(a == b for a, b in zip(reference, generate(fp8, prompt, GREEDY), strict=True))
        forced = teacher_forced_argmax(fp8, prompt, reference)
        forced_agree += sum(a == b for a, b in zip(reference, forced, strict=True))
    total = len(PROMPTS) * GREEDY.max_tokens
    free_rate, forced_rate = free_agree / total, forced_agree / total
    # Free-running agreement counts every token after a first divergence as a miss; per step
    # compares the next-token pick after the same fp32 prefix (teacher forcing).
    print(f"fp8 vs fp32 KV greedy token agreement: free-running {free_rate:.3f}, per step {forced_rate:.3f}")
    assert forced_rate > 0.9 and free_rate > 0.3


def test_fp8_kv_dtype_checks_and_transfer_is_exact(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(model_dir, num_blocks=4, kv_cache_dtype="int4")
    bf16 = LLMEngine(model_dir, num_blocks=4, dtype="bfloat16").kv_pool
    bf16_fp8 = LLMEngine(model_dir, num_blocks=4, dtype="bfloat16", kv_cache_dtype="fp8").kv_pool
    assert bf16_fp8.bytes_per_block * 2 == bf16.bytes_per_block
    # Raw fp8 block bytes copied to another engine decode exactly as in the engine that computed them.
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = random_prompt(100, seed=9)
    single = LLMEngine(model_dir, num_blocks=32, kv_cache_dtype="fp8")
    prefill = LLMEngine(model_dir, num_blocks=32, kv_cache_dtype="fp8")
    decode = LLMEngine(model_dir, num_blocks=32, kv_cache_dtype="fp8")
    assert prefill_then_decode(prefill, decode, "split", prompt, params) == generate(single, prompt, params)
