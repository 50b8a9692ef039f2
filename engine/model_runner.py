"""ModelRunner: turns a scheduled batch into one model forward and returns the logits to sample from."""

import torch

from engine.attention import SeqChunk, build_batch
from engine.kv_pool import KVPool
from engine.model import CausalLM
from engine.scheduler import ScheduledBatch


class ModelRunner:
    """Runs the model over the KV pool; one batched forward per step, decodes and prefill chunks together."""

    def __init__(self, model: CausalLM, kv_pool: KVPool) -> None:
        """Bind the model to the pool it reads and writes."""
        self.model = model
        self.kv_pool = kv_pool

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch's new tokens; returns float32 logits [B, V] of each chunk's last token."""
        chunks = [
            SeqChunk(r.next_token_ids(n), r.num_computed_tokens, r.block_table)
            for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        ]
        attn = build_batch(chunks, self.kv_pool.block_size)
        hidden = self.model(attn, self.kv_pool)
        return self.model.compute_logits(hidden[attn.last_token_idx])
