"""The engine against transformers as an independent reference (logits and greedy tokens)."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest_engine import TINY_SHAPE, make_tiny_model, random_prompt

from engine.attention import SeqChunk, build_batch
from engine.checkpoint import load_checkpoint, make_model
from engine.kv_pool import KVPool
from engine.llm_engine import LLMEngine, generate
from engine.model import CausalLM
from engine.sampling import SamplingParams

pytestmark = pytest.mark.unit
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,  # larger than the default so greedy top-1 is far from float noise
        eos_token_id=299,
    )
    out = tmp_path_factory.mktemp("qwen2")
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("llama3_rope"))
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # small, so the test prompt spans all three bands
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def engine_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    config, state = load_checkpoint(model_dir)
    model = CausalLM.from_state_dict(config, state, torch.float32)
    pool = KVPool(config, 16, torch.float32, num_blocks=16)
    batch = build_batch([SeqChunk(prompt, 0, list(range(16)))], 16)
    with torch.inference_mode():
        return model.compute_logits(model(batch, pool))


def reference(model_dir: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("which", ["llama", "qwen2", "llama3_rope"])
def test_logits_match_transformers(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"{which}_dir")
    prompt = random_prompt(100, seed=1)
    ours = engine_logits(model_dir, prompt)
    with torch.no_grad():
        theirs = reference(model_dir)(torch.tensor([prompt])).logits[0]
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"{which}_dir")
    prompt = random_prompt(40, seed=2)
    engine = LLMEngine(model_dir, num_blocks=32, block_size=16)
    ours = generate(engine, prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    with torch.no_grad():
        out = reference(model_dir).generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert ours == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("shape", [TINY_SHAPE, {}], ids=["tiny", "default"])
def test_generated_model_has_clear_top1(shape: dict[str, int], tmp_path: Path) -> None:
    logits = engine_logits(make_model(tmp_path, **shape), random_prompt(200, seed=3))
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() >= 0.98, gaps.min()
