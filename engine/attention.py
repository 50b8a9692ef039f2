"""Paged attention over a flat batch of tokens from several requests.

Each request contributes a chunk of new tokens (a prefill chunk or one decode
token) starting at ``start_pos``. Attention first writes the chunk's K/V into its
slots, then attends causally: query at position ``p`` sees keys at positions ``0..p``.

- Single-token chunks (decode) form one group: their context blocks are gathered
  from the pool into ``[B, H_kv, S, D]`` (padded to the longest, masked) for one
  batched SDPA call, whatever the requests' lengths.
- Longer chunks (prefill) attend one by one, so no decode row is padded to a
  prompt's length. A chunk without cached context (``start_pos == 0``) attends to
  its own fresh K/V with SDPA's ``is_causal`` fast path; a chunk after cached or
  earlier-chunk context reads that context from the pool with an explicit mask.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_pool import KVPool


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one request, at positions ``start_pos..``; their KV goes to ``block_table``."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class DecodeGroup:
    """The single-token chunks of a step, attended in one batched call."""

    token_idx: torch.Tensor  # [B] flat index of each row's token
    block_tables: torch.Tensor  # [B, context blocks] (padded with block 0, masked out)
    mask: torch.Tensor  # [B, 1, 1, context slots] True where attention is allowed


@dataclass(frozen=True)
class PrefillChunk:
    """One multi-token chunk: flat tokens ``start..end`` at positions ``start_pos..``."""

    start: int
    end: int
    start_pos: int
    block_table: torch.Tensor  # [1, blocks covering positions 0..end_pos)
    mask: torch.Tensor | None  # [chunk, end_pos] when there is earlier context, else None (causal)


@dataclass(frozen=True)
class AttentionBatch:
    """Per-step tensors shared by every layer (built once by ``build_batch``)."""

    input_ids: torch.Tensor  # [T] token ids, chunks concatenated
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] block id where each token's K/V is written
    slot_offsets: torch.Tensor  # [T] offset inside that block
    decode: DecodeGroup | None
    prefills: list[PrefillChunk]
    last_token_idx: torch.Tensor  # [B] flat index of each chunk's last token


def build_batch(chunks: Sequence[SeqChunk], block_size: int) -> AttentionBatch:
    """Flatten the chunks into the tensors the model needs for one forward."""
    if not chunks or any(not c.token_ids for c in chunks):
        raise ValueError("build_batch needs at least one chunk and no empty chunk")
    lens = [len(c.token_ids) for c in chunks]
    ends = [c.start_pos + n for c, n in zip(chunks, lens, strict=True)]
    num_ctx_blocks = [-(-e // block_size) for e in ends]
    if any(n > len(c.block_table) for c, n in zip(chunks, num_ctx_blocks, strict=True)):
        raise ValueError("a chunk extends past the end of its block table")
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(c.start_pos, e) for c, e in zip(chunks, ends, strict=True)])
    tables = [torch.tensor(c.block_table[:n], dtype=torch.long) for c, n in zip(chunks, num_ctx_blocks, strict=True)]
    spans = zip(tables, offsets, offsets[1:], strict=False)
    slot_blocks = torch.cat([t[positions[a:b] // block_size] for t, a, b in spans])
    singles = [i for i, n in enumerate(lens) if n == 1]
    prefills = [
        _prefill_chunk(chunks[i], offsets[i], offsets[i + 1], num_ctx_blocks[i]) for i, n in enumerate(lens) if n > 1
    ]
    return AttentionBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long),
        positions=positions,
        slot_blocks=slot_blocks,
        slot_offsets=positions % block_size,
        decode=_decode_group([chunks[i] for i in singles], [offsets[i] for i in singles], block_size),
        prefills=prefills,
        last_token_idx=torch.tensor(offsets[1:]) - 1,
    )


def _decode_group(chunks: Sequence[SeqChunk], token_idx: Sequence[int], block_size: int) -> DecodeGroup | None:
    """Block tables padded to the longest context, and a mask hiding the padding."""
    if not chunks:
        return None
    num_blocks = [c.start_pos // block_size + 1 for c in chunks]
    tables = torch.zeros(len(chunks), max(num_blocks), dtype=torch.long)
    for row, (c, n) in enumerate(zip(chunks, num_blocks, strict=True)):
        tables[row, :n] = torch.tensor(c.block_table[:n])
    pos = torch.tensor([c.start_pos for c in chunks])
    mask = torch.arange(tables.shape[1] * block_size) <= pos.unsqueeze(-1)
    return DecodeGroup(torch.tensor(token_idx, dtype=torch.long), tables, mask[:, None, None, :])


def _prefill_chunk(chunk: SeqChunk, start: int, end: int, num_blocks: int) -> PrefillChunk:
    """A multi-token chunk; the mask is needed only when earlier context exists."""
    mask = None
    if chunk.start_pos > 0:
        end_pos = chunk.start_pos + end - start
        mask = torch.arange(end_pos) <= torch.arange(chunk.start_pos, end_pos).unsqueeze(-1)
    table = torch.tensor([chunk.block_table[:num_blocks]], dtype=torch.long)
    return PrefillChunk(start, end, chunk.start_pos, table, mask)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer_idx: int, batch: AttentionBatch
) -> torch.Tensor:
    """Store ``k``/``v`` ([T, H_kv, D]) in the pool's layer and attend ``q`` ([T, H, D]); returns [T, H * D]."""
    pool.store(layer_idx, batch.slot_blocks, batch.slot_offsets, k, v)
    out = torch.empty_like(q)
    group = batch.decode
    if group is not None:
        keys, values = pool.gather(layer_idx, group.block_tables, q.dtype)
        rows = q[group.token_idx].unsqueeze(2)  # [B, H, 1, D]
        attended = F.scaled_dot_product_attention(rows, keys, values, attn_mask=group.mask, enable_gqa=True)
        out[group.token_idx] = attended.squeeze(2)
    for chunk in batch.prefills:
        out[chunk.start : chunk.end] = _attend_chunk(q, k, v, pool, layer_idx, chunk)
    return out.flatten(1)


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer_idx: int, chunk: PrefillChunk
) -> torch.Tensor:
    """Causal attention of one prefill chunk; returns [chunk, H, D]."""
    rows = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if chunk.mask is None:  # no earlier context: the chunk's own fresh K/V is all there is
        keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(rows, keys, values, is_causal=True, enable_gqa=True)
    else:
        keys, values = pool.gather(layer_idx, chunk.block_table, q.dtype)
        num_keys = chunk.mask.shape[1]
        keys, values = keys[:, :, :num_keys], values[:, :, :num_keys]
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=chunk.mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
