"""Paged attention over a flat batch of tokens from several requests.

Each request contributes a chunk of new tokens (a prefill chunk or one decode
token) starting at ``start_pos``. Attention first writes the chunk's K/V into its
slots, then gathers the request's context blocks (cached + new) and attends
causally: query at position ``p`` sees keys at positions ``0..p``. Queries are
padded per request to ``[B, max_query_len]`` for one batched SDPA call.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one request, at positions ``start_pos..``; their KV goes to ``block_table``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class AttentionBatch:
    """Per-step tensors shared by every layer (built once by ``build_batch``)."""

    input_ids: torch.Tensor  # [T] token ids, chunks concatenated
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] block id where each token's K/V is written
    slot_offsets: torch.Tensor  # [T] offset inside that block
    block_tables: torch.Tensor  # [B, context blocks] (padded with block 0, masked out)
    seq_idx: torch.Tensor  # [T] request index of each token
    query_idx: torch.Tensor  # [T] index of each token inside its chunk
    mask: torch.Tensor  # [B, 1, max_query_len, context slots] True where attention is allowed
    last_token_idx: torch.Tensor  # [B] flat index of each chunk's last token


def build_batch(chunks: Sequence[SeqChunk], block_size: int) -> AttentionBatch:
    """Flatten the chunks into the tensors the model needs for one forward."""
    if not chunks or any(not c.token_ids for c in chunks):
        raise ValueError("build_batch needs at least one chunk and no empty chunk")
    lens = [len(c.token_ids) for c in chunks]
    ends = [c.start_pos + n for c, n in zip(chunks, lens, strict=True)]
    num_ctx_blocks = [(e + block_size - 1) // block_size for e in ends]
    if any(n > len(c.block_table) for c, n in zip(chunks, num_ctx_blocks, strict=True)):
        raise ValueError("a chunk extends past the end of its block table")
    width = max(num_ctx_blocks)
    tables = torch.zeros(len(chunks), width, dtype=torch.long)
    for i, (c, n) in enumerate(zip(chunks, num_ctx_blocks, strict=True)):
        tables[i, :n] = torch.tensor(c.block_table[:n])
    positions = torch.cat([torch.arange(c.start_pos, e) for c, e in zip(chunks, ends, strict=True)])
    seq_idx = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
    starts = torch.tensor([c.start_pos for c in chunks])
    query_idx = positions - starts[seq_idx]
    pos_pad = torch.zeros(len(chunks), max(lens), dtype=torch.long)  # padded queries see key 0 only
    pos_pad[seq_idx, query_idx] = positions
    mask = torch.arange(width * block_size) <= pos_pad.unsqueeze(-1)
    return AttentionBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long),
        positions=positions,
        slot_blocks=tables[seq_idx, positions // block_size],
        slot_offsets=positions % block_size,
        block_tables=tables,
        seq_idx=seq_idx,
        query_idx=query_idx,
        mask=mask.unsqueeze(1),
        last_token_idx=torch.tensor(lens).cumsum(0) - 1,
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Store ``k``/``v`` ([T, H_kv, D]) in ``kv_layer`` and attend ``q`` ([T, H, D]); returns [T, H * D]."""
    kv_layer[batch.slot_blocks, 0, batch.slot_offsets] = k.to(kv_layer.dtype)
    kv_layer[batch.slot_blocks, 1, batch.slot_offsets] = v.to(kv_layer.dtype)
    num_seqs, width = batch.block_tables.shape
    context = kv_layer[batch.block_tables].to(q.dtype)  # [B, width, 2, block_size, H_kv, D]
    context = context.transpose(2, 3).reshape(num_seqs, -1, 2, k.shape[1], k.shape[2])
    keys = context[:, :, 0].transpose(1, 2)  # [B, H_kv, S, D]
    values = context[:, :, 1].transpose(1, 2)
    q_pad = q.new_zeros(num_seqs, batch.mask.shape[2], q.shape[1], q.shape[2])
    q_pad[batch.seq_idx, batch.query_idx] = q
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=batch.mask, enable_gqa=True)
    return out.transpose(1, 2)[batch.seq_idx, batch.query_idx].flatten(1)
