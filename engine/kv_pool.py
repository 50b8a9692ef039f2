"""KVPool: one contiguous tensor holding the KV cache of every layer, block-major.

A block is ONE contiguous byte range, so a transfer engine moves a block with a
single (address, length) pair::

    data[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

    base_address
    |<------------------------- block 0 (bytes_per_block) ------------------------->|<- block 1 ...
    | layer 0: K[block_size, H, D] | V[block_size, H, D] | layer 1: K | V | ... | layer L-1: K | V |

    block b starts at base_address + b * bytes_per_block (a transfer engine addresses blocks so)

fp8 KV (``dtype=torch.float8_e4m3fn``): values are stored unscaled (an implicit
per-tensor scale of 1.0, vLLM's default when a checkpoint has no calibrated
scales), saturated at +-448. e4m3's relative precision (3 mantissa bits) is the
same anywhere in its normal range [2**-6, 448], where Llama-family K/V activations
lie, so a scale would buy little accuracy; without one a block stays plain fp8
bytes with no side metadata, and a transfer engine copies it unchanged. Reads
convert back to the model dtype, so attention computes in the model dtype.
"""

import torch

from engine.config import ModelConfig


class KVPool:
    """The paged KV cache: token ``p`` of a request lives in ``block_table[p // block_size]``."""

    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        """Allocate the pool from an explicit block count or a byte budget (exactly one of them)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_bytes")
        block_shape = (config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        per_block = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        count = num_blocks if num_blocks is not None else (kv_cache_bytes or 0) // per_block
        if count <= 0:
            raise ValueError(f"KV pool must hold at least one block ({per_block} bytes), got {count} blocks")
        self._block_size = block_size
        self._bytes_per_block = per_block
        self.data = torch.zeros((count, *block_shape), dtype=dtype)

    @property
    def num_blocks(self) -> int:
        """Number of blocks in the pool."""
        return self.data.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (K and V of every layer)."""
        return self._bytes_per_block

    @property
    def base_address(self) -> int:
        """Address of block 0 (register this memory with a transfer engine)."""
        return int(self.data.data_ptr())

    @property
    def nbytes(self) -> int:
        """Total size of the pool in bytes."""
        return self.num_blocks * self._bytes_per_block

    def store(
        self, layer_idx: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K and V ``[T, H_kv, D]`` of ``T`` tokens into their (block, offset) slots of one layer."""
        layer = self.data[:, layer_idx]
        if self.data.dtype == torch.float8_e4m3fn:
            limit = torch.finfo(torch.float8_e4m3fn).max
            k, v = k.clamp(-limit, limit), v.clamp(-limit, limit)
        layer[slot_blocks, 0, slot_offsets] = k.to(self.data.dtype)
        layer[slot_blocks, 1, slot_offsets] = v.to(self.data.dtype)

    def gather(
        self, layer_idx: int, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H_kv, blocks * block_size, D]`` in ``dtype`` of the ``[B, blocks]`` tables."""
        context = self.data[block_tables, layer_idx].to(dtype)  # [B, blocks, 2, block_size, H_kv, D]
        num_seqs, _, _, _, num_heads, head_dim = context.shape
        context = context.transpose(2, 3).reshape(num_seqs, -1, 2, num_heads, head_dim)
        return context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
