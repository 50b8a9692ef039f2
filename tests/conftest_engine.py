"""Shared helpers for the engine tests (imported explicitly, not a pytest conftest)."""

from pathlib import Path

import torch

from engine.checkpoint import make_model
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.sampling import SamplingParams

TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    torch.set_num_threads(1)
    return make_model(out_dir, seed=seed, **TINY_SHAPE)


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def copy_blocks(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int]) -> None:
    """Simulate the KV transfer: copy each block's bytes into the reserved block of the other engine."""
    src_bytes = src.kv_pool.data.view(src.kv_pool.num_blocks, -1).view(torch.uint8)
    dst_bytes = dst.kv_pool.data.view(dst.kv_pool.num_blocks, -1).view(torch.uint8)
    assert src_bytes.shape[1] == src.kv_pool.bytes_per_block
    for s, d in zip(src_blocks, dst_blocks, strict=False):
        dst_bytes[d].copy_(src_bytes[s])


def prefill_then_decode(
    prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    """Run a request split across two engines, as a prefill and a decode worker would."""
    prefill.add_request(request_id, prompt, params, prefill_only=True)
    outputs: list[StepOutput] = []
    while not (outputs and outputs[-1].finished):  # chunk progress outputs come before the last one
        outputs += [o for o in prefill.step() if o.request_id == request_id]
    first = outputs[-1]
    assert first.finished and first.block_ids
    reserved = decode.reserve(request_id, len(prompt), params)
    assert reserved is not None
    copy_blocks(prefill, first.block_ids, decode, reserved)
    prefill.release(request_id)
    tokens = list(first.new_token_ids)
    done = decode.add_prefilled_request(request_id, prompt, tokens[0], params)
    finished = done is not None
    while not finished:
        for out in decode.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                finished = out.finished
    return tokens


def make_hf_model(out_dir: Path, arch: str, tie: bool, seed: int = 0, **shape: int) -> Path:
    """Write a random Llama or Qwen2 checkpoint with ``transformers`` itself (an independent writer).

    Weights are re-drawn from one seeded generator with std 1/sqrt(fan_in) (embeddings std 1,
    biases std 0.1) so logits have clear top-1 gaps and greedy decoding is far from float noise.
    """
    import transformers

    torch.set_num_threads(1)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_cls(vocab_size=300, max_position_embeddings=512, tie_word_embeddings=tie, eos_token_id=299, **shape)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            if param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir
