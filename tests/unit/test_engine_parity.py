"""The engine against transformers as an independent reference (logits and greedy tokens).

Every shape runs a 200-token prompt: the engine's logits must match at every position
(within 1e-4, fp32) however the prompt is chunked over the paged pool, and its 64 greedy
tokens must be identical with or without prefix-cache hits, with chunked prefill, and
when the request shares its steps with other requests arriving over time.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest_engine import TINY_SHAPE, make_hf_model, make_tiny_model, random_prompt

from engine.attention import SeqChunk, build_batch
from engine.checkpoint import load_checkpoint, make_model
from engine.kv_pool import KVPool
from engine.llm_engine import LLMEngine, generate
from engine.model import CausalLM
from engine.outputs import StepOutput
from engine.sampling import SamplingParams

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

PROMPT_LEN, NUM_TOKENS, BLOCK_SIZE = 200, 64, 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
PROMPT = random_prompt(PROMPT_LEN, seed=1)

# (architecture, tied embeddings, shape): GQA, MQA (one KV head), MHA; head counts and hidden
# sizes that are not powers of two; head_dim 20, 16, 12, 8.
HF_SHAPES = {
    "llama_3h_1kv": ("llama", False, {"hidden_size": 60, "num_attention_heads": 3, "num_key_value_heads": 1}),
    "llama_6h_2kv_tied": ("llama", True, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}),
    "qwen2_6h_2kv_tied": ("qwen2", True, {"hidden_size": 72, "num_attention_heads": 6, "num_key_value_heads": 2}),
    "qwen2_7h_7kv": ("qwen2", False, {"hidden_size": 56, "num_attention_heads": 7, "num_key_value_heads": 7}),
}
SHAPES = ["llama_4h_2kv", "llama3_rope", *HF_SHAPES]


@dataclass(frozen=True)
class Case:
    """A checkpoint and what transformers computes on it."""

    model_dir: Path
    logits: torch.Tensor  # [PROMPT_LEN, vocab] of the prompt
    tokens: list[int]  # NUM_TOKENS greedy tokens after the prompt


def _write_model(name: str, out: Path) -> Path:
    if name in HF_SHAPES:
        arch, tie, shape = HF_SHAPES[name]
        size = {"num_hidden_layers": 2, "intermediate_size": 2 * shape["hidden_size"] + 8}
        return make_hf_model(out, arch, tie, **size, **shape)
    model_dir = make_tiny_model(out)
    if name == "llama3_rope":
        config = json.loads((model_dir / "config.json").read_text())
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,  # small, so the prompt spans all three bands
        }
        (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module", params=SHAPES)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    model_dir = _write_model(request.param, tmp_path_factory.mktemp(request.param))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NUM_TOKENS, do_sample=False)
    return Case(model_dir, logits, out[0, PROMPT_LEN:].tolist())


def chunked_logits(model_dir: Path, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits of every prompt position, computing ``chunk`` tokens per forward over scattered blocks."""
    config, state = load_checkpoint(model_dir)
    model = CausalLM.from_state_dict(config, state, torch.float32)
    pool = KVPool(config, BLOCK_SIZE, torch.float32, num_blocks=20)
    table = [19 - 3 * i % 20 for i in range(20)]  # non-contiguous, out of order
    logits = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            batch = build_batch([SeqChunk(prompt[start : start + chunk], start, table)], BLOCK_SIZE)
            logits.append(model.compute_logits(model(batch, pool)))
    return torch.cat(logits)


def run_all(engine: LLMEngine, arrivals: dict[int, dict[str, list[int]]]) -> dict[str, list[int]]:
    """Step until idle, adding ``arrivals[step]`` requests before that step; returns tokens per request."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for rid, prompt in arrivals.get(step, {}).items():
            engine.add_request(rid, prompt, GREEDY if rid == "main" else SamplingParams(max_tokens=20, temperature=0))
        outputs: list[StepOutput] = engine.step()
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens


@pytest.mark.parametrize("chunk", [PROMPT_LEN, 37, 1])
def test_prompt_logits_match_transformers(case: Case, chunk: int) -> None:
    ours = chunked_logits(case.model_dir, PROMPT, chunk)
    assert ours.shape == case.logits.shape
    assert torch.allclose(ours, case.logits, atol=1e-4, rtol=0), (ours - case.logits).abs().max()


def test_greedy_tokens_match_transformers(case: Case) -> None:
    engine = LLMEngine(case.model_dir, num_blocks=32, enable_prefix_caching=False)
    assert generate(engine, PROMPT, GREEDY) == case.tokens


def test_greedy_tokens_with_prefix_cache_hits(case: Case) -> None:
    engine = LLMEngine(case.model_dir, num_blocks=64)
    generate(engine, PROMPT[:150] + [7, 7, 7], GREEDY)  # leaves 9 full blocks of the prompt cached
    assert generate(engine, PROMPT, GREEDY) == case.tokens
    assert generate(engine, PROMPT, GREEDY) == case.tokens  # every full prompt block cached
    assert engine.stats().prefix_cache_hit_tokens == 144 + 192


@pytest.mark.parametrize("chunk", [1, 13, 64])
def test_greedy_tokens_with_chunked_prefill(case: Case, chunk: int) -> None:
    engine = LLMEngine(case.model_dir, num_blocks=32, max_num_batched_tokens=chunk)
    assert generate(engine, PROMPT, GREEDY) == case.tokens


def test_greedy_tokens_in_a_mixed_batch(case: Case) -> None:
    others = {f"r{i}": random_prompt(n, seed=20 + i) for i, n in enumerate([5, 17, 90, 33, 130])}
    solo_engine = LLMEngine(case.model_dir, num_blocks=64)
    solo = {rid: generate(solo_engine, p, SamplingParams(max_tokens=20, temperature=0)) for rid, p in others.items()}
    engine = LLMEngine(case.model_dir, num_blocks=128, max_num_batched_tokens=50)
    arrivals = {0: {"r0": others["r0"], "main": PROMPT, "r1": others["r1"]}, 3: {"r2": others["r2"]}}
    arrivals[9] = {"r3": others["r3"], "r4": others["r4"]}  # arrive while main decodes
    tokens = run_all(engine, arrivals)
    assert tokens.pop("main") == case.tokens
    assert tokens == solo
    assert engine.num_free_blocks == 128


@pytest.mark.parametrize("shape", [TINY_SHAPE, {}], ids=["tiny", "default"])
def test_generated_model_has_clear_top1(shape: dict[str, int], tmp_path: Path) -> None:
    logits = chunked_logits(make_model(tmp_path, **shape), random_prompt(200, seed=3), PROMPT_LEN)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() >= 0.98, gaps.min()
