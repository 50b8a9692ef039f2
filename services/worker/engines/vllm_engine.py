"""vLLM behind the EnginePort (``[engine] backend = "vllm"``).

The worker process builds an ``AsyncLLM`` (vLLM spawns its EngineCore and model worker as child
processes) and stays our gRPC service: registered in etcd, profiled, reporting load, publishing KV events.
What differs from the built-in engine:

* **Prompt KV moves with vLLM's MooncakeConnector** (``services/worker/engines/vllm_connector.py``): a decode
  worker's ``Reserve`` commits its blocks; the prefill worker runs the prompt with ``max_tokens=1``
  (``do_remote_decode``), and vLLM holds its KV for the decode request, which ``decode`` submits after it
  (``do_remote_prefill``, naming the prefill worker's engine id and bootstrap server), as vLLM's own PD
  proxies do; the prefill worker's connector pushes the blocks over the Mooncake Transfer Engine. The decode
  request is the prompt followed by the prefill's token 0 (``continues_token_0``): vLLM computes that
  token's KV and samples token 1 in its first step, as the colocated engine does. Where it cannot (the token's
  slot would start or fill a block, which the pull would leave unwritten or cache unwritten; token 0 may end
  the request; a seeded sampler must draw token 0 again to draw the same token 1), the decode request is
  the prompt alone, vLLM computes its last token again and samples token 0 once more (same logits, same seed:
  the same token), ``decode`` drops it, and a different token fails the attempt (``diverged``): the request
  resumes.
* **KV copies between prefill workers** go through the same connector (prefill workers are ``kv_both``): the
  holder runs the prefix as a request of its own (``export_prefix``: cached, one block computed, at
  ``EXPORT_PRIORITY`` ahead of the prompts waiting there, so it waits only for the prefill running) whose
  KV its connector sends to the puller, which runs the prefix as a remote-prefill request (``import_prefix``)
  that pulls the blocks it lacks into its prefix cache. The prompt that follows hits them there.
* **Decode admission** counts vLLM's real pool: a ``Reserve`` commits the blocks of its prompt and
  ``max_tokens`` until the request ends, and is refused (RESOURCE_EXHAUSTED, as on the built-in engine)
  when they exceed the free blocks: the fewer of the pool's free blocks after vLLM's last step (its block
  pool's own count) and the blocks no live reservation holds. The same count is the load's free blocks,
  so the Conductor's decode choice sees it. vLLM allocates the blocks as the request runs; the
  commitment keeps them from being promised twice.
* **KV events** come from vLLM's cache over ZMQ (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``) and are translated to this repository's chained block hashes (``engine.block_hash``)
  from their token ids, so kvmeta and Algorithm 1's ``prefix_len`` see vLLM's real cache.
* **Load and step timings** come from a vLLM stat logger: queue, batch and KV usage per step, and each
  step's scheduled tokens and elapsed time, which feed the same ``CostRefiner`` as the built-in engine.
* **Liveness** is ``AsyncLLM.check_health`` polled once a second; a dead EngineCore resolves ``died``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc

from engine.block_hash import hash_block
from engine.block_manager import StoredBlock
from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from services.common import metrics
from services.common.config import Config, WorkerConfig
from services.common.rpc import RpcError
from services.worker.engines.loop import EngineDied
from services.worker.engines.port import EngineLoad, ImportedBlocks, KVLayout, RemotePrefill
from services.worker.profiling.refiner import CostRefiner

log = logging.getLogger(__name__)
MEDIUM_GPU = "GPU"  # vllm.distributed.kv_events.MEDIUM_GPU: vLLM's own pool (vLLM is imported lazily)
MEDIUM_STORE = "cpu"  # the medium vLLM's MooncakeStoreConnector gives the blocks it put into the Store
HEALTH_PERIOD_S = 1.0
CONNECTOR = "CpuMooncakeConnector"
STORE_CONNECTOR = "CpuMooncakeStoreConnector"
STORE_TIER_CONNECTOR = "StoreTierConnector"  # vLLM's MultiConnector over both
CONNECTOR_MODULE = "services.worker.engines.vllm_connector"
STORE_LOCAL_BUFFER_BYTES = 16 << 20  # the Store client's staging buffer, as our own client's (kv/store.py)
PUSH_WINDOW = 64  # timed connector pushes kept for the next prefill response (the latest, when none goes out)
EXPORT_PRIORITY = -1  # an export runs before the prompts waiting on the holder (vLLM: lower runs first; prompts 0)
COPY_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # an export's or import's one token


def diverged(request_id: str, decoded: int, prefilled: int) -> RpcError:
    """The error of a decode whose token 0 is not the prefill's: the KV it received is not the prompt's.

    INTERNAL, so the Conductor resumes the request on another attempt (after the token 0 its client already has)
    instead of streaming a continuation of a different token; counted in ``kvconductor_decode_divergences``.
    """
    metrics.DIVERGENCES.inc()
    log.error("request %s: decode sampled token 0 = %d, prefill %d: failing this attempt", request_id, decoded,
              prefilled)  # fmt: skip
    message = f"decode diverged from prefill: token 0 = {decoded} here, {prefilled} on the prefill worker"
    return RpcError(grpc.StatusCode.INTERNAL, message)


def failed_in_vllm(request_id: str, role: str) -> RpcError:
    """The error of a request vLLM ended with its ``error`` finish.

    On a decode worker the prompt's KV did not load from the prefill worker (the connector's send failed or timed
    out; ``kv_load_failure_policy="fail"``). UNAVAILABLE, so the Conductor resumes the request on another attempt
    instead of ending its stream where vLLM stopped it (the client would get a cut answer as if it had finished);
    counted in ``kvconductor_engine_errors``.
    """
    metrics.ENGINE_ERRORS.inc()
    cause = "its KV did not load from the prefill worker" if role == "decode" else "an engine error"
    log.error("request %s: vLLM ended it with an error (%s): failing this attempt", request_id, cause)
    return RpcError(grpc.StatusCode.UNAVAILABLE, f"vLLM ended request {request_id} with an error: {cause}")


class VllmEngine:
    """``AsyncLLM`` as an ``EnginePort``."""

    moves_kv_itself = True  # vLLM's KV connector moves prompt KV; the worker's transfer engine does not

    def __init__(
        self,
        llm: Any,
        layout: KVLayout,
        role: str,
        refiner: CostRefiner | None = None,
        count_sent: Callable[[int, int], None] | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        self.llm = llm
        self.eos_token_ids = eos_token_ids  # the model's end-of-sequence tokens (None: unknown)
        self.layout = layout
        self.role = role
        self.refiner = refiner
        self.count_sent = count_sent  # (blocks, bytes) the connector wrote to decode workers
        self._pushes: deque[tuple[int, float]] = deque(maxlen=PUSH_WINDOW)  # (bytes, seconds) not yet reported
        self._store_loads: deque[tuple[int, float]] = deque(maxlen=PUSH_WINDOW)  # the Store connector's reads
        self.events = KVEventTranslator(layout.block_size)
        self.stats = StepStats(layout.num_blocks)
        self.contexts: dict[str, int] = {}  # running request -> tokens with KV (for decode step samples)
        self._reserved: dict[str, dict[str, Any]] = {}  # decode request -> its connector's parameters
        self._committed: dict[str, int] = {}  # reserved decode request -> blocks of its prompt and max_tokens
        self._committed_blocks = 0  # their sum (read from the stat logger's thread too)
        self._died: asyncio.Future[BaseException] | None = None
        self._beats = 0
        self._last_beat = time.monotonic()
        self._health: asyncio.Task[None] | None = None

    @property
    def died(self) -> asyncio.Future[BaseException] | None:
        """Resolves when the EngineCore is gone."""
        return self._died

    def start(self) -> None:
        """Start polling the engine's health."""
        self._died = asyncio.get_running_loop().create_future()
        self._health = asyncio.create_task(self._watch_health())

    async def _watch_health(self) -> None:
        assert self._died is not None
        while True:
            try:
                await asyncio.wait_for(self.llm.check_health(), HEALTH_PERIOD_S * 10)
            except TimeoutError:
                pass  # a busy engine: the heartbeat ages, health follows engine_heartbeat_timeout_s
            except Exception as e:  # noqa: BLE001 - EngineDeadError and whatever else a dead core raises
                log.error("vLLM engine died: %s", e)
                if not self._died.done():
                    self._died.set_result(e)
                return
            else:
                self._beats += 1
                self._last_beat = time.monotonic()
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def close(self) -> None:
        """Stop vLLM and its processes."""
        if self._health is not None:
            self._health.cancel()
        self.events.close()
        await asyncio.to_thread(self.llm.shutdown)

    def heartbeat(self) -> tuple[int, float]:
        """(health checks passed, seconds since the last)."""
        return self._beats, time.monotonic() - self._last_beat

    def _check_alive(self) -> None:
        if self._died is not None and self._died.done():
            raise EngineDied(self._died.result())

    def _sampling(
        self, params: SamplingParams, transfer: dict[str, Any] | None = None, *, prefill: bool = False
    ) -> Any:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        return VllmSampling(
            n=1, max_tokens=1 if prefill else params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, seed=params.seed,
            stop_token_ids=[] if prefill else list(params.stop_token_ids),
            # The prefill of a disaggregated request must end "length capped" for its connector to send the KV.
            ignore_eos=True if prefill else params.ignore_eos, logprobs=0 if params.logprobs else None,
            detokenize=False, output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": transfer} if transfer is not None else None,
        )  # fmt: skip

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Any, priority: int = 0
    ) -> AsyncGenerator[StepOutput, None]:
        from vllm.inputs import TokensPrompt

        self._check_alive()
        finished = False
        self.contexts[request_id] = len(prompt)
        try:
            request = TokensPrompt(prompt_token_ids=prompt)
            async for out in self.llm.generate(request, sampling, request_id, priority=priority):
                completion = out.outputs[0]
                if completion.finish_reason == "error":
                    raise failed_in_vllm(request_id, self.role)
                tokens = list(completion.token_ids)
                self.contexts[request_id] = self.contexts.get(request_id, len(prompt)) + len(tokens)
                finished = out.finished
                logprobs = [next(iter(lp.values())).logprob for lp in completion.logprobs or []]
                yield StepOutput(
                    request_id, tokens, finished, _finish_reason(completion.finish_reason) if finished else None,
                    out.num_cached_tokens or 0, logprobs=logprobs[-len(tokens):] if tokens else [],
                )  # fmt: skip
                if finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self.llm.errored:
                raise EngineDied(e) from e
            raise
        finally:
            self.contexts.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        imported: ImportedBlocks | None = None,
    ) -> AsyncGenerator[StepOutput, None]:
        """Run a request; ``prefill_only``: the prefill of a disaggregated request (its KV goes to decode)."""
        if imported is not None:
            raise ValueError("vLLM workers take no KV copies")
        transfer = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": request_id}
        sampling = self._sampling(params, transfer if prefill_only else None, prefill=prefill_only)
        async for out in self._stream(request_id, prompt, sampling):
            if prefill_only:  # whether token 0 ends the request is the decode worker's call
                out = dataclasses.replace(out, finish_reason=None)
            yield out

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        remote: RemotePrefill | None = None,
    ) -> tuple[list[int] | None, int]:
        """Commit the decode request's blocks if the pool has room: ``[]`` (vLLM allocates as it goes) or None.

        And the free count. Its prompt and ``max_tokens`` stay committed until it ends (``num_free_blocks``).
        vLLM gets the request at ``decode``, once the ``remote`` prefill worker has run the prompt: a request
        waiting in vLLM for its KV keeps the engine stepping (EngineCore and model runner, each an empty step
        after the other), which on a CPU host takes a core from the prefill it waits for.
        """
        self._check_alive()
        if remote is None:
            raise ValueError("a vLLM decode worker needs remote_prefill in Reserve")
        if request_id in self._reserved:
            raise ValueError(f"request {request_id!r} is already reserved")
        need = self.layout.num_blocks_for(min(num_prompt_tokens + params.max_tokens, self.layout.max_model_len))
        free = self.num_free_blocks
        if need > free:
            return None, free
        self._committed[request_id] = need
        self._committed_blocks += need
        transfer = {
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": remote.engine_id,
            "remote_bootstrap_addr": remote.bootstrap_addr, "transfer_id": request_id,
        }  # fmt: skip
        self._reserved[request_id] = transfer
        return [], self.num_free_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free in vLLM's pool after its last step that no live reservation has promised."""
        return max(0, min(self.stats.num_free_blocks, self.layout.num_blocks - self._committed_blocks))

    def _uncommit(self, request_id: str) -> None:
        self._committed_blocks -= self._committed.pop(request_id, 0)

    async def decode(
        self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams
    ) -> AsyncGenerator[StepOutput, None]:
        """Submit the reserved request (its connector pulls the KV from the prefill worker); outputs after token 0.

        The prefill worker sampled token 0: the request continues it, or samples it again and it must be the same.
        """
        if request_id not in self._reserved:
            raise ValueError(f"no decode request {request_id!r} reserved")
        transfer = self._reserved[request_id]
        again = not continues_token_0(len(prompt), first_token_id, params, self.layout.block_size, self.eos_token_ids)
        if not again:
            prompt, params = [*prompt, first_token_id], dataclasses.replace(params, max_tokens=params.max_tokens - 1)
        sampling = self._sampling(params, transfer)
        try:
            async with contextlib.aclosing(self._stream(request_id, prompt, sampling)) as outputs:
                async for out in outputs:
                    if again and out.new_token_ids:  # token 0 sampled again: check it and drop it
                        again = False
                        if out.new_token_ids[0] != first_token_id:
                            raise diverged(request_id, out.new_token_ids[0], first_token_id)
                        out = dataclasses.replace(out, new_token_ids=out.new_token_ids[1:], logprobs=out.logprobs[1:])
                    yield out
        finally:  # an unfinished stream was aborted in vLLM as it closed
            self._reserved.pop(request_id, None)
            self._uncommit(request_id)

    async def release(self, request_id: str) -> None:
        """Nothing to do: a finished prefill's blocks belong to vLLM's connector until the decode pulls them."""

    async def abort(self, request_id: str) -> None:
        """Drop a request (a waiting remote decode included); completes even if the caller is cancelled."""
        self._reserved.pop(request_id, None)
        self._uncommit(request_id)
        with contextlib.suppress(Exception):
            await asyncio.shield(self.llm.abort(request_id))

    async def export_prefix(self, export_id: str, token_ids: Sequence[int]) -> None:
        """Run the prefix so that the connector sends its KV to the peer whose ``import_prefix`` names ``export_id``.

        Cached here, it computes one block. Returns when its prefill is done; the blocks stay held for the
        peer's pull, ``[cluster] kv_transfer_timeout_s`` at most.
        """
        transfer = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": export_id}
        sampling = self._sampling(COPY_SAMPLING, transfer, prefill=True)
        async for _ in self._stream(export_id, list(token_ids), sampling, EXPORT_PRIORITY):
            pass

    async def import_prefix(self, export_id: str, token_ids: Sequence[int], source: RemotePrefill) -> bool:
        """Pull the blocks of the prefix ``token_ids`` this pool lacks from ``source``; whether they arrived.

        They land in the prefix cache; a failed pull leaves the prompt to compute them.
        """
        transfer = {
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": source.engine_id,
            "remote_bootstrap_addr": source.bootstrap_addr, "transfer_id": export_id,
        }  # fmt: skip
        sampling = self._sampling(COPY_SAMPLING, transfer, prefill=True)
        reason = None
        async for out in self._stream(export_id, list(token_ids), sampling):
            reason = out.finish_reason
        return reason == "length"

    def held_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` cached here, as vLLM's KV events last said."""
        return self.events.held_prefix(block_hashes)

    async def pin_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Not readable by the worker's transfer engine: copies go through the connector (``export_prefix``)."""
        raise NotImplementedError("vLLM's pool is copied through its KV connector")

    async def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Nothing is pinned (see ``pin_cached_blocks``)."""
        raise NotImplementedError("vLLM's pool is copied through its KV connector")

    async def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Not writable by the worker's transfer engine: copies go through the connector (``import_prefix``)."""
        raise NotImplementedError("vLLM's pool is copied through its KV connector")

    async def abandon_import(self, imported: ImportedBlocks) -> None:
        """Nothing was imported (see ``allocate_blocks``)."""
        raise NotImplementedError("vLLM's pool is copied through its KV connector")

    def take_store_loads(self) -> list[tuple[int, float]]:
        """The Store connector's timed reads since the last call (``[store] enabled``; they name no request)."""
        loads, self._store_loads = list(self._store_loads), deque(maxlen=PUSH_WINDOW)
        return loads

    def take_kv_pushes(self) -> list[tuple[int, float]]:
        """The connector's timed pushes since the last call (the prefill worker's next response carries them)."""
        pushes, self._pushes = list(self._pushes), deque(maxlen=PUSH_WINDOW)
        return pushes

    async def pop_kv_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        """Blocks stored and block hashes removed (ours) since the last call."""
        return self.events.pop()

    def pop_store_puts(self) -> list[bytes]:
        """Blocks (ours) the connector put into the Mooncake Store since the last call (``[store] enabled``)."""
        return self.events.pop_store_puts()

    async def load(self) -> EngineLoad:
        """The engine's load after its last step."""
        self._check_alive()
        return self.snapshot()

    def snapshot(self) -> EngineLoad:
        """The load, from any thread."""
        s = self.stats
        return EngineLoad(s.num_waiting, s.num_running, self.num_free_blocks, self.layout.num_blocks,
                          s.prefix_queries, s.prefix_hits)  # fmt: skip

    def inject_fault(self, kind: str) -> None:
        """Test-only: "raise" kills the EngineCore (SIGKILL); "freeze"/"thaw" stop and continue it."""
        import signal

        import psutil

        for child in psutil.Process().children(recursive=True):
            os.kill(child.pid, {"raise": signal.SIGKILL, "freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}[kind])

    def observe_step(self, scheduler_stats: Any) -> None:
        """A vLLM step's stats (called by the stat logger on the event loop)."""
        self.stats.update(scheduler_stats)
        stats = getattr(scheduler_stats, "kv_connector_stats", None) or {}
        connector = stats.get(CONNECTOR, stats)  # under a MultiConnector ([store] enabled): by child
        loads = stats.get(STORE_CONNECTOR, {}).get("load_get", ())
        self._store_loads.extend((int(r["num_bytes"]), float(r["duration_seconds"])) for r in loads
                                 if r.get("status") == "ok" and r.get("num_bytes"))  # fmt: skip
        pushed = list(zip(connector.get("bytes_transferred", ()), connector.get("transfer_duration", ()), strict=False))
        self._pushes.extend((int(b), float(t)) for b, t in pushed if b > 0 and t > 0)  # the MooncakeConnector's, timed
        sent = int(sum(b for b, _ in pushed))
        if sent and self.count_sent is not None:
            self.count_sent(round(sent / self.layout.bytes_per_block), sent)
        details = getattr(scheduler_stats, "iteration_details", None)
        if self.refiner is None or details is None or details.elapsed_ms <= 0:
            return
        seconds = details.elapsed_ms / 1e3
        if details.num_generation_requests == 0 and details.num_ctx_requests == 1:
            self.refiner.observe([(details.num_ctx_tokens, 0)], seconds)
        elif details.num_ctx_requests == 0 and details.num_generation_requests > 0 and self.contexts:
            mean = sum(self.contexts.values()) // len(self.contexts)
            self.refiner.observe([(1, mean)] * details.num_generation_requests, seconds)


def continues_token_0(
    num_prompt_tokens: int, first_token_id: int, params: SamplingParams, block_size: int,
    eos_token_ids: frozenset[int] | None,
) -> bool:  # fmt: skip
    """Whether a decode request can be the prompt followed by the prefill's token 0, ``max_tokens`` one fewer.

    The connector pulls the prefill's blocks, which hold the prompt's KV; token 0's slot in them is unwritten,
    and vLLM computes it again (it always computes the last token of a request whose KV it loaded). So the
    slot must lie inside the prompt's last block: not the first of a new block (the decode would need one
    block more than the prefill has: vLLM fails the pull) nor the last of one (vLLM would cache the block
    before computing the slot). And token 0 must not end the request (``max_tokens`` 1, a stop token, an
    end-of-sequence token unless ``ignore_eos``: vLLM checks none of them on a prompt token), nor a seeded
    sampler count on drawing token 0 before token 1.
    """
    offset = num_prompt_tokens % block_size
    if not 0 < offset < block_size - 1 or params.max_tokens <= 1 or first_token_id in params.stop_token_ids:
        return False
    if params.seed is not None and params.temperature > 0:
        return False
    return params.ignore_eos or (eos_token_ids is not None and first_token_id not in eos_token_ids)


def _finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", "abort" if reason else None)


@dataclasses.dataclass
class StepStats:
    """The engine's state after its last step, as vLLM's scheduler reported it."""

    num_total_blocks: int
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks not in use (cached, evictable ones included)."""
        return int(self.num_total_blocks * (1.0 - self.kv_cache_usage))

    def update(self, s: Any) -> None:
        """Apply one ``SchedulerStats``."""
        self.num_waiting, self.num_running, self.kv_cache_usage = (
            s.num_waiting_reqs,
            s.num_running_reqs,
            s.kv_cache_usage,
        )
        self.prefix_queries += s.prefix_cache_stats.queries
        self.prefix_hits += s.prefix_cache_stats.hits


class KVEventTranslator:
    """vLLM's KV cache events (ZMQ) as this repository's chained block hashes.

    vLLM's block hashes depend on its hash algorithm, seed and version; ours depend only on the tokens. A
    ``BlockStored`` names its parent (vLLM's hash) and carries its token ids, so each vLLM hash maps to
    ``hash_block(ours(parent), tokens)``. A block whose parent is unknown (events missed) is skipped.

    Only events of vLLM's own pool count as this instance's blocks (``medium`` "GPU", the name vLLM gives its
    device pool on every platform, or none): a KV connector's tiers publish theirs on the same socket, and a
    block there is not one a request here hits without a load. The Mooncake Store connector's puts
    (``medium`` "cpu") are kept apart (``pop_store_puts``): kvmeta indexes them as the Store's blocks. The
    Store sends no removals (its master evicts silently); a prefill that finds a planned Store block gone
    says so instead (``copy.settle_store_load``).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.endpoint = ""
        self._ours: dict[Any, bytes] = {}
        self._held: Counter[bytes] = Counter()  # the values of _ours (``held_prefix`` reads it per copy)
        self._stored: list[StoredBlock] = []
        self._removed: list[bytes] = []
        self._store_puts: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, endpoint: str, topic: str = "") -> None:
        """Receive from vLLM's publisher at ``endpoint`` on a thread."""
        import zmq

        self.endpoint = endpoint
        sub: Any = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(endpoint)
        self._thread = threading.Thread(target=self._receive, args=(sub,), name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _receive(self, sub: Any) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = sub.recv_multipart()  # [topic, sequence number, msgpack KVEventBatch]
            except zmq.Again:
                continue
            self.apply_payload(frames[-1])
        sub.close(linger=0)

    def apply_payload(self, payload: bytes) -> None:
        """Translate one msgpack ``KVEventBatch`` as vLLM's ZMQ publisher sends it (a malformed one is skipped)."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        try:
            self.apply(msgspec.msgpack.decode(payload, type=KVEventBatch).events)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("skipping a malformed vLLM KV event batch: %s", e)

    def apply(self, events: Sequence[Any]) -> None:
        """Translate a batch of vLLM events."""
        with self._lock:
            for event in events:
                kind = type(event).__name__
                medium = getattr(event, "medium", None)
                if medium == MEDIUM_STORE and kind == "BlockStored":
                    self._store_put(event)
                if medium not in (None, MEDIUM_GPU):
                    continue
                if kind == "BlockStored":
                    self._stored_block(event)
                elif kind == "BlockRemoved":
                    self._removed.extend(h for h in (self._forget(v) for v in event.block_hashes) if h)
                elif kind == "AllBlocksCleared":
                    self._removed.extend(self._ours.values())
                    self._ours.clear()
                    self._held.clear()

    def _forget(self, theirs: Any) -> bytes | None:
        ours = self._ours.pop(theirs, None)
        if ours is not None:
            self._held[ours] -= 1
            if not self._held[ours]:
                del self._held[ours]
        return ours

    def _stored_block(self, event: Any) -> None:
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                return
        size = event.block_size
        for i, theirs in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            if len(tokens) < size:
                return
            ours = hash_block(parent, tokens)
            self._forget(theirs)  # stored again (vLLM re-announces a block it evicted and computed anew)
            self._ours[theirs] = ours
            self._held[ours] += 1
            self._stored.append(StoredBlock(ours, parent, tokens))
            parent = ours

    def _store_put(self, event: Any) -> None:
        """Blocks the Store connector put: the pool's blocks of the same vLLM hash, or their parent's children."""
        parent = None if event.parent_block_hash is None else self._ours.get(event.parent_block_hash)
        size = event.block_size
        for i, theirs in enumerate(event.block_hashes):
            ours = self._ours.get(theirs)
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            if ours is None and len(tokens) == size and (parent is not None or event.parent_block_hash is None):
                ours = hash_block(parent, tokens)
            if ours is None:
                return  # neither the block nor its parent is known here (events missed): the Store keeps it unindexed
            self._store_puts.append(ours)
            parent = ours

    def pop_store_puts(self) -> list[bytes]:
        """Our hashes of the blocks put into the Mooncake Store since the last call."""
        with self._lock:
            puts, self._store_puts = self._store_puts, []
        return puts

    def held_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` (ours) that vLLM's cache holds, as its events so far say."""
        with self._lock:
            return next((i for i, h in enumerate(block_hashes) if h not in self._held), len(block_hashes))

    def pop(self) -> tuple[list[StoredBlock], list[bytes]]:
        """Blocks stored and hashes removed since the last call."""
        with self._lock:
            stored, removed = self._stored, self._removed
            self._stored, self._removed = [], []
        return stored, removed

    def close(self) -> None:
        """Stop receiving."""
        self._stop.set()


def worker_temp_path(instance_id: str, name: str) -> str:
    """A file of this worker process in the temp dir (vLLM's IPC socket, the Store client's JSON), gone at exit."""
    path = os.path.join(tempfile.gettempdir(), f"kvconductor-{instance_id}-{os.getpid()}-{name}")
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _register_children() -> None:
    """Name the MultiConnector's children in vLLM's connector registry, in the process that reads their stats.

    vLLM's front end (this process) rebuilds each child's stats from the registry by the child's class name;
    ours are vLLM's connectors under another name (their stats are their parents'), and importing them here
    would run ``vllm_connector``'s set-up, meant for vLLM's own processes.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_mooncake = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake"
    for name, module, parent in (
        (CONNECTOR, f"{vllm_mooncake}.mooncake_connector", "MooncakeConnector"),
        (STORE_CONNECTOR, f"{vllm_mooncake}.store.connector", "MooncakeStoreConnector"),
    ):
        with contextlib.suppress(ValueError):  # named already
            KVConnectorFactory.register_connector(name, module, parent)


def _store_tier(config: Config, instance_id: str, pd: dict[str, Any], store_master: str) -> dict[str, Any]:
    """The connector arguments of a prefill worker whose prompts also go to the Mooncake Store (``[store] enabled``).

    vLLM's MultiConnector (``StoreTierConnector``) over the MooncakeConnector (``pd``: PD and copies; first, so
    that it claims the remote-prefill requests) and vLLM's MooncakeStoreConnector: every prompt's full blocks
    are put into the Store, and every prompt loads from it what the instance's own cache lacks. The Store
    client reads its settings from the JSON that ``MOONCAKE_CONFIG_PATH`` names (written here): the
    master, this worker's segment of ``[store] segment_mb`` and handshakes peer to peer, as our own client.
    A Store block evicted between the lookup and the load is recomputed (``kv_load_failure_policy``): the
    Store is a lossy cache.
    """
    _register_children()
    path = worker_temp_path(instance_id, "mooncake-store.json")
    settings = {
        "metadata_server": "P2PHANDSHAKE", "master_server_address": store_master,
        "protocol": config.cluster.transfer_backend, "device_name": "", "mode": "embedded",
        "global_segment_size": config.store.segment_mb << 20, "local_buffer_size": STORE_LOCAL_BUFFER_BYTES,
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(settings, f)
    os.environ["MOONCAKE_CONFIG_PATH"] = path
    store = {
        "kv_connector": STORE_CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
        "kv_connector_extra_config": {
            # The lookup's IPC socket is named by this number: one per worker on a host.
            "lookup_rpc_port": _free_port(config.cluster.host),
            # vLLM's keys name the model, not the dtype nor the block size.
            "cache_prefix": f"{config.cluster.name}-{config.model.dtype}-{config.block_size}",
        },
    }  # fmt: skip
    return {
        "kv_connector": STORE_TIER_CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
        "engine_id": instance_id, "kv_connector_extra_config": {"connectors": [pd, store]},
        "kv_load_failure_policy": "recompute",
    }  # fmt: skip


def engine_arguments(
    config: Config,
    role: str,
    instance_id: str,
    pool_config: WorkerConfig,
    events_endpoint: str | None,
    store_master: str = "",
) -> tuple[dict[str, Any], str]:
    """The engine arguments of vLLM for one worker, and its KV bootstrap address ("" unless prefill).

    ``store_master``: the Mooncake Store's master (host:port), on a prefill worker of a cluster with
    ``[store] enabled``. Sets the process environment vLLM reads at start-up. Shared with
    ``bench/compare/vllm_server.py``, so a stock vLLM server in a comparison runs exactly the engine our worker
    runs.
    """
    from vllm.config import KVEventsConfig, KVTransferConfig

    host = config.cluster.host
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_HOST_IP"] = host
    # vLLM waits this long for KV that never comes (480 s by default); the Conductor's own bounds sit on top.
    os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(max(1, int(config.cluster.kv_transfer_timeout_s)))
    bootstrap = ""
    transfer = None
    if role in ("prefill", "decode"):
        if role == "prefill":
            port = _free_port(host)
            os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(port)
            bootstrap = f"http://{host}:{port}"
        pd = {
            "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            # A prefill worker also pulls prefixes from its peers (KV copies): both roles.
            "kv_role": "kv_both" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": config.cluster.transfer_backend},
        }  # fmt: skip
        tier = (
            _store_tier(config, instance_id, pd, store_master)
            if role == "prefill" and store_master
            else {**pd, "engine_id": instance_id, "kv_load_failure_policy": "fail"}
        )
        transfer = KVTransferConfig(**tier)
    caching = pool_config.enable_prefix_caching and role != "decode"
    arguments = dict(
        model=config.model.path, served_model_name=[config.model.name], dtype=config.model.dtype,
        enforce_eager=True, block_size=config.block_size, enable_prefix_caching=caching,
        max_num_batched_tokens=pool_config.max_num_batched_tokens, max_num_seqs=pool_config.max_concurrent_requests,
        kv_cache_memory_bytes=pool_config.kv_cache_bytes, seed=0, kv_transfer_config=transfer,
        scheduling_policy="priority" if role == "prefill" else "fcfs",  # exports go ahead of waiting prompts
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint)
        if caching and events_endpoint else None,
    )  # fmt: skip
    return arguments, bootstrap
