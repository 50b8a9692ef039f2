"""The start-up profile, kept for the next start: a worker reuses it when nothing it was measured on changed.

Profiling times real prefills and decode steps, one worker per host at a time (services/worker/profiling/profiler.py),
and on two CPU cores that is most of a cluster's start. The samples depend on what ran and where: the model's
files, the engine and its version, dtypes, threads, block size, batch limits, the role's scheduling, the
host's CPU, and the profile's own shapes. Those are the *fingerprint*; its hash names one JSON file under
``[engine] profile_cache_dir`` holding the samples. A start whose fingerprint has a file loads it instead
of profiling; anything else profiles and writes the file. The cost models refit from live steps either way
(services/worker/profiling/refiner.py), so a profile from a quieter hour is corrected within seconds of work.

A file that does not parse, or names another fingerprint, is ignored (and replaced); a directory that cannot
be written only costs the next start its reuse.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from services.common.config import Config, WorkerConfig
from services.worker.profiling.profiler import SHAPES
from services.worker.profiling.refiner import CostRefiner

log = logging.getLogger(__name__)
FORMAT = 1  # bump when the profile's shapes or the samples' meaning change
MODEL_FILES = ("config.json", "*.safetensors", "*.bin", "tokenizer.json")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def fingerprint(config: Config, role: str, pool: WorkerConfig) -> dict[str, Any]:
    """Everything the start-up profile of this worker depends on."""
    model = Path(config.model.path)
    files = sorted({p for pattern in MODEL_FILES for p in model.glob(pattern)})
    backend = config.engine.backend
    return {
        "format": FORMAT,
        "model": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        "engine": backend,
        "versions": {name: _version(name) for name in ("torch", "vllm" if backend == "vllm" else "kvconductor")},
        "dtype": config.model.dtype,
        "kv_cache_dtype": pool.kv_cache_dtype,
        "torch_threads": pool.torch_threads,
        "block_size": config.block_size,
        "max_num_batched_tokens": pool.max_num_batched_tokens,
        "max_concurrent_requests": pool.max_concurrent_requests,
        "prefix_caching": pool.enable_prefix_caching and role != "decode",
        "one_prefill_at_a_time": role == "prefill",
        "host": {"name": platform.node(), "cpu": _cpu(), "cpus": os.cpu_count()},
        "shapes": json.loads(json.dumps(SHAPES)),
    }


def _path(config: Config, key: dict[str, Any]) -> Path | None:
    if not config.engine.profile_cache_dir:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(config.engine.profile_cache_dir).expanduser() / f"profile-{digest}.json"


def load(config: Config, key: dict[str, Any]) -> CostRefiner | None:
    """The profile measured under ``key`` before, if one is kept."""
    path = _path(config, key)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data["fingerprint"] != key:
            return None
        prefill = [tuple(sample) for sample in data["prefill"]]
        decode = [tuple(sample) for sample in data["decode"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the kept profile %s (%s): profiling again", path, e)
        return None
    log.info("reusing the start-up profile %s: nothing it was measured on changed (delete it to profile again)",
             path)  # fmt: skip
    return CostRefiner(prefill, decode)


def save(config: Config, key: dict[str, Any], refiner: CostRefiner) -> None:
    """Keep ``refiner``'s start-up samples for the next start (best effort)."""
    path = _path(config, key)
    if path is None:
        return
    data = {"fingerprint": key, "prefill": refiner.prefill_profile, "decode": refiner.decode_profile}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data))
        partial.replace(path)  # atomic: a worker starting meanwhile reads the old file or the new one
    except OSError as e:
        log.warning("could not keep the start-up profile in %s (%s): the next start profiles again", path, e)
