"""Start vLLM for one worker process: AsyncLLM from the config, the adapter over it, its start-up profile.

The profile comes from the profile cache (``services.worker.profiling.cache``) when nothing it was measured on
changed, else from timing the engine (``vllm_profile``); each step's scheduler stats reach the adapter through a
stat logger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.common.config import Config, WorkerConfig
from services.common.metrics import register_engine
from services.worker.engines.port import KVLayout
from services.worker.engines.vllm_engine import VllmEngine, engine_arguments, worker_temp_path
from services.worker.engines.vllm_profile import profile_vllm
from services.worker.profiling import cache as profile_cache
from services.worker.profiling.refiner import CostRefiner

log = logging.getLogger(__name__)


async def build(
    config: Config,
    role: str,
    instance_id: str,
    pool_config: WorkerConfig,
    count_sent: Callable[[int, int], None],
    store_master: str = "",
) -> tuple[VllmEngine, CostRefiner, str]:
    """Start vLLM for one worker process and profile it: (engine, refiner, KV bootstrap address or "").

    ``count_sent(blocks, bytes)`` is called with the KV its connector pushed to decode workers;
    ``store_master``: the Mooncake Store's master, on a prefill worker with ``[store] enabled``.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    events_endpoint = f"ipc://{worker_temp_path(instance_id, 'kv-events.sock')}"
    arguments, bootstrap = engine_arguments(config, role, instance_id, pool_config, events_endpoint, store_master)
    caching = arguments["kv_events_config"] is not None
    args = AsyncEngineArgs(**arguments, disable_log_stats=False, enable_logging_iteration_details=True)
    log.info("starting vLLM for %s (%s, %d MiB KV cache)", config.model.path, config.model.dtype,
             pool_config.kv_cache_memory_mb)  # fmt: skip
    # vLLM's own stat logger would log every step (we ask for per-step details); ours reads them instead.
    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
    holder: dict[str, VllmEngine] = {}
    llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(holder)])
    cache, model = llm.vllm_config.cache_config, llm.vllm_config.model_config
    hf = model.hf_config
    num_kv_heads = model.get_num_kv_heads(llm.vllm_config.parallel_config)
    head_dim = model.get_head_size()
    num_layers = model.get_num_layers(llm.vllm_config.parallel_config)
    itemsize = 4 if config.model.dtype == "float32" else 2
    layout = KVLayout(
        block_size=cache.block_size, num_blocks=cache.num_gpu_blocks or 0,
        bytes_per_block=2 * num_layers * num_kv_heads * head_dim * itemsize * cache.block_size, base_address=0,
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=config.model.dtype,
        max_model_len=model.max_model_len, vocab_size=hf.vocab_size,
    )  # fmt: skip
    engine = VllmEngine(llm, layout, role, count_sent=count_sent, eos_token_ids=_eos_token_ids(llm))
    holder["engine"] = engine
    if caching:
        engine.events.subscribe(events_endpoint)
    key = profile_cache.fingerprint(config, role, pool_config)
    refiner = profile_cache.load(config, key) or await profile_vllm(engine)
    profile_cache.save(config, key, refiner)
    engine.refiner = refiner
    register_engine(engine.snapshot)
    return engine, refiner, bootstrap


def _eos_token_ids(llm: Any) -> frozenset[int] | None:
    """The model's end-of-sequence tokens, as vLLM adds them to a request's stops (None: not found)."""
    try:
        processor = llm.input_processor
        eos = processor.renderer.get_eos_token_id()
        more = processor.generation_config_fields.get("eos_token_id")
    except AttributeError:  # another vLLM's internals: decode requests sample token 0 again
        log.warning("vLLM's end-of-sequence tokens not found: every decode request samples token 0 again")
        return None
    ids = {eos} if eos is not None else set()
    ids |= {more} if isinstance(more, int) else set(more or ())
    return frozenset(ids)


def _stat_logger_factory(holder: dict[str, VllmEngine]) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLogger(StatLoggerBase):
        """Hands each step's scheduler stats to the engine adapter."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:  # fmt: skip
            engine = holder.get("engine")
            if engine is not None and scheduler_stats is not None:
                engine.observe_step(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return StepLogger
