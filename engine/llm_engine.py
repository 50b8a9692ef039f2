"""LLMEngine: the narrow, single-threaded interface a worker drives.

``step()`` reads like the algorithm: schedule, run the model, sample, update.
Besides plain requests it supports both halves of prefill/decode disaggregation:
``prefill_only`` requests finish after their first token and hold their KV blocks
until ``release`` (before that, each prefill chunk reports progress: the blocks
whose KV is computed so far, for chunk-level KV streaming; see ``StepOutput``);
on the decode side ``reserve`` sets blocks aside for KV that
arrives from another process, and ``add_prefilled_request`` decodes from them.
"""

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_manager import BlockManager, StoredBlock
from engine.checkpoint import load_checkpoint, load_model_config
from engine.emulated_runner import EmulatedRunner, Emulation
from engine.kv_pool import KVPool
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.outputs import StepOutput
from engine.request import Request
from engine.sampling import SamplingParams, chosen_logprobs, sample
from engine.scheduler import Scheduler
from engine.tokenizer import load_tokenizer

DEFAULT_KV_CACHE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and prefix-cache counters."""

    num_waiting: int  # requests not yet admitted
    num_running: int  # admitted requests (prefilling or decoding)
    prefix_cache_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # of which found


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# "fp8": KV stored as float8 e4m3 (see engine/kv_pool.py for the scaling choice), computed in the model dtype.
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


class LLMEngine:
    """Continuous-batching inference over a paged, prefix-cached KV pool.

    Thread safety: one thread calls ``step()``; any other thread may call the other methods at any time,
    even while ``step()`` runs the model, except ``abort()`` of a request that may be in the running
    batch, which belongs between steps (on the stepping thread).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_num_prefills: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str = "float32",
        kv_cache_dtype: str = "auto",
        emulation: Emulation | None = None,
    ) -> None:
        """Load the checkpoint; size the pool by ``num_blocks``, else ``kv_cache_bytes``, else 512 MiB.

        ``kv_cache_dtype`` is "auto" (KV in the model ``dtype``) or "fp8" (float8 e4m3: a quarter of
        float32's KV bytes, half of bfloat16's). With ``emulation`` only the folder's config.json is read
        (vocabulary, special tokens): the forward pass is a wait from its profile (``engine.emulated_runner``).
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if num_blocks is None and kv_cache_bytes is None:
            kv_cache_bytes = DEFAULT_KV_CACHE_BYTES
        size = {"num_blocks": num_blocks, "kv_cache_bytes": kv_cache_bytes}
        self.runner: ModelRunner | EmulatedRunner
        if emulation is None:
            self.config, state = load_checkpoint(model_dir)
            self.kv_pool = KVPool(self.config, block_size, _KV_CACHE_DTYPES[kv_cache_dtype] or _DTYPES[dtype], **size)
            self.runner = ModelRunner(CausalLM.from_state_dict(self.config, state, _DTYPES[dtype]), self.kv_pool)
        else:
            self.config = emulation.model_config(load_model_config(model_dir))
            self.kv_pool = KVPool(self.config, block_size, torch.uint8, **size)
            has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
            tokenizer = load_tokenizer(model_dir) if has_tokenizer else None
            self.runner = EmulatedRunner(self.kv_pool, self.config, emulation, tokenizer=tokenizer)
        self.block_manager = BlockManager(self.kv_pool.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_model_len=self.config.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            eos_token_ids=self.config.eos_token_ids,
            max_num_prefills=max_num_prefills,
        )
        # Held by step() while it schedules and while it applies results, but not while the model runs, and by
        # every other public method: any thread may call them without waiting for a long step.
        self._lock = threading.RLock()
        # (new tokens, tokens already computed) of each sequence in the last step: what a worker needs to
        # refine its cost models from the steps it times.
        self.last_step: tuple[tuple[int, int], ...] = ()
        self._reserved: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """KV blocks that can be allocated now (evictable cached blocks included)."""
        return self.block_manager.num_free_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        pinned: Sequence[int] = (),
    ) -> None:
        """Queue a request; raises ValueError if the prompt is empty, too long, or can never fit the pool.

        ``pinned``: references to cached blocks of its prefix (a KV copy's) that the request takes over and
        drops once it is admitted, so that they cannot be evicted while it waits in the queue.
        """
        with self._lock:
            self._check_new(request_id, prompt_token_ids)
            request = Request(request_id, list(prompt_token_ids), params.with_seed(), prefill_only, pinned=list(pinned))
            self.scheduler.add(request)

    def step(self) -> list[StepOutput]:
        """Run one step (decode tokens and prefill chunks together); returns an output per request that got a token."""
        with self._lock:
            batch = self.scheduler.schedule()
        if batch is None:
            self.last_step = ()
            return []
        self.last_step = tuple(
            (n, r.num_computed_tokens) for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        )
        logits = self.runner.run(batch)  # without the lock: the model touches only blocks the batch holds
        rows = batch.sample_rows()
        requests = [batch.requests[row] for row in rows]
        tokens = sample(logits[rows], [r.params for r in requests], [len(r.output_token_ids) for r in requests])
        logprobs = chosen_logprobs(logits[rows], tokens, [r.params.logprobs for r in requests])
        with self._lock:
            return self.scheduler.update(batch, dict(zip(rows, zip(tokens, logprobs, strict=True), strict=True)))

    def stats(self) -> EngineStats:
        """Load and prefix-cache counters."""
        with self._lock:
            bm = self.block_manager
            return EngineStats(
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                prefix_cache_query_tokens=bm.num_hit_tokens + bm.num_miss_tokens,
                prefix_cache_hit_tokens=bm.num_hit_tokens,
            )

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def abort(self, request_id: str) -> None:
        """Drop a request (waiting, running, held or reserved) and free its blocks; ignores unknown ids."""
        with self._lock:
            self.scheduler.abort(request_id)
            blocks = self._reserved.pop(request_id, None)
            if blocks is not None:
                self.block_manager.free(blocks)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished prefill-only request (after its KV was transferred)."""
        with self._lock:
            self.scheduler.release(request_id)

    def reserve(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> list[int] | None:
        """Allocate blocks for a whole request whose KV arrives from elsewhere; None if too few are free."""
        with self._lock:
            if request_id in self._reserved:
                raise ValueError(f"request {request_id!r} already has a reservation")
            blocks = self.block_manager.allocate(self.scheduler.num_blocks_for(num_prompt_tokens, params, False))
            if blocks is not None:
                self._reserved[request_id] = blocks
            return blocks

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams
    ) -> StepOutput | None:
        """Decode a request whose prompt KV was written into its reserved blocks.

        ``first_token_id`` is output index 0 (sampled by the prefill side). Returns the
        finished output if that token already ends the request, else None.
        """
        with self._lock:
            blocks = self._reserved.get(request_id)
            if blocks is None:
                raise ValueError(f"request {request_id!r} has no reservation; call reserve() first")
            if len(blocks) != self.scheduler.num_blocks_for(len(prompt_token_ids), params, False):
                raise ValueError(f"prompt length {len(prompt_token_ids)} does not match the reservation")
            del self._reserved[request_id]
            request = Request(request_id, list(prompt_token_ids), params, block_table=blocks)
            request.num_computed_tokens = len(prompt_token_ids)
            return self.scheduler.add_running(request, first_token_id)

    def reset_prefix_cache_stats(self) -> None:
        """Zero the prefix-cache hit counters (e.g. after a start-up profile, which is not traffic)."""
        with self._lock:
            self.block_manager.num_hit_tokens = self.block_manager.num_miss_tokens = 0

    def pop_kv_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        """Return and clear the blocks stored and the block hashes removed since the last call."""
        with self._lock:
            return self.block_manager.pop_events()

    def pin_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Hold the cached blocks of the longest leading run of ``block_hashes``, for a peer to read.

        Block i holds ``token_ids[i*bs:(i+1)*bs]``; give the blocks back with ``unpin_blocks``. Thread-safe:
        another thread may call it while ``step`` runs the model, so an export never waits for a long step.
        """
        with self._lock:
            return self.block_manager.match_prefix(block_hashes, token_ids)

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the references taken by ``pin_cached_blocks`` or ``allocate_blocks`` (thread-safe)."""
        with self._lock:
            self.block_manager.free(block_ids)

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks to receive KV copied from a peer; None if too few are free."""
        with self._lock:
            return self.block_manager.allocate(num_blocks)

    def commit_imported_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        parent_hash: bytes | None = None,
        keep_reference: bool = False,
    ) -> None:
        """Put blocks filled with a peer's KV into the prefix cache and drop the import's reference.

        Block i holds ``token_ids[i*bs:(i+1)*bs]`` with hash ``block_hashes[i]``; ``parent_hash`` is the
        hash of the block before the first (None: the prompt's first block). The blocks stay cached (and
        are announced as stored) until evicted; with ``keep_reference`` the caller keeps the reference (to
        hand it to ``add_request``'s ``pinned``).
        """
        with self._lock:
            self.block_manager.commit_full_blocks(block_ids, block_hashes, token_ids, 0, parent_hash)
            if not keep_reference:
                self.block_manager.free(block_ids)

    def _check_new(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Reject duplicate ids and token ids outside the vocabulary."""
        live = [*self.scheduler.waiting, *self.scheduler.running, *self.scheduler.held.values()]
        if request_id in self._reserved or any(r.request_id == request_id for r in live):
            raise ValueError(f"request id {request_id!r} is already in use")
        if any(not 0 <= t < self.config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")


def generate(engine: LLMEngine, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
    """Run one request to completion on an otherwise idle engine and return its output tokens."""
    request_id = f"generate-{uuid.uuid4().hex}"
    engine.add_request(request_id, prompt_token_ids, params)
    tokens: list[int] = []
    while True:
        outputs = engine.step()
        for out in outputs:
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens
        if not outputs and not engine.scheduler.running:
            raise RuntimeError("request cannot be admitted: not enough free KV blocks")


__all__ = ["EngineStats", "LLMEngine", "SamplingParams", "StepOutput", "generate"]
