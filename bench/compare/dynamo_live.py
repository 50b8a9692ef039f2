"""Dynamo's own serving stack as a ``bench compare --routers`` contender: ``dynamo.mocker`` + ``dynamo.frontend``.

Dynamo's router drives only Dynamo workers, so these contenders bring their own mocker engines, whose timing
is a profile table of the same latency profile the emulated workers run (``[emulation] profile``), with the
cluster config's block size, KV capacity (``kv_cache_memory_mb`` at ``[emulation] kv_bytes_per_token``) and
batch limits, and at the same pace (``--speedup-ratio`` = 1 / ``[emulation] time_scale``):

- ``dynamo:POLICY`` (deployment ``dynamo``): one ``dynamo.mocker`` process with ``--workers`` aggregated
  engines (each prefills and decodes) shaped as our ``[colocated]`` pool;
- ``dynamo-pd:POLICY`` (deployment ``dynamo-pd``): Dynamo's disaggregated serving on the same split as
  ``conductor:disaggregated``: ``--prefill-workers`` prefill-only engines shaped as our ``[prefill]`` pool
  and the rest decode-only engines shaped as our ``[decode]`` pool, two mocker processes; the frontend finds
  the prefill engines and routes each request's prefill (its KV router over the prefill engines) before
  its decode. Each request's KV transfer costs the profile's link time for the emulated model's KV (the
  same ``[emulation] model_link`` time our emulated workers take; none when that is off).

Then ``dynamo.frontend`` with the contender's router mode (``kv`` is its KV router, ``round_robin`` its
round robin) on a free port. Both discover each other through a file store
(``--discovery-backend file``: no etcd or NATS). They run from Dynamo's own environment (``make dynamo``:
``.venv-dynamo``). What its mocker does differently from our emulated engine: ``bench/scale/dynamo_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tokenizers import AddedToken

from bench.compare.cluster import split
from bench.compare.peers import DYNAMO_PYTHON, HOST, ROUTER_STOP_TIMEOUT_S
from cli.local_cluster import REPO, stop
from engine.tokenizer import load_tokenizer
from scheduler.profiles import named_profile
from services.common.config import Config, load_config
from services.common.net import free_port

ROUTER_MODES = {"kv": "kv", "round_robin": "round-robin"}
MOCKER_IDS = range(1000, 2000)  # the ids Dynamo 1.6.1's mocker samples its output tokens from
READY_TIMEOUT_S = 120.0


def _env(store: Path) -> dict[str, str]:
    return {**os.environ, "DYN_FILE_KV": str(store), "DYN_LOG": "warn", "RUST_LOG": "warn"}


def cluster_config(args: argparse.Namespace) -> Config:
    """The config our emulated clusters of this comparison run with."""
    return load_config(args.config, [*args.model_overrides, *args.set])


def engine_counts(args: argparse.Namespace, deployment: str) -> dict[str, int]:
    """Mocker engines by role: ``{"agg": N}`` for ``dynamo``, ``{"prefill": P, "decode": N - P}`` for ``dynamo-pd``
    (the split of ``conductor:disaggregated``)."""
    if deployment == "dynamo":
        return {"agg": args.workers}
    prefill, decode = split(args.workers, args.prefill_workers)
    return {"prefill": prefill, "decode": decode}


def mocker_model(served: Path, out: Path) -> Path:
    """The served model's folder for the mocker, its vocabulary extended so that the ids it emits are text.

    The mocker samples each output id from ``MOCKER_IDS``, past a small model's vocabulary (tiny-llama has 261
    ids), where Dynamo's frontend detokenizes them to nothing and sends no chunk: a client would see one gap
    per request. Each id the vocabulary lacks becomes an added token of its own text, so every token streams
    as a chunk, as our emulated workers' do (``engine.emulated_runner``): both sides' TBT is of their tokens'
    gaps. Prompts arrive as ids of the served vocabulary and mean the same.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(served)
    size = tokenizer.get_vocab_size()
    tokenizer.add_tokens([AddedToken(f"w{i}", normalized=False) for i in range(size, MOCKER_IDS.stop)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((served / "config.json").read_text())
    config["vocab_size"] = max(config["vocab_size"], tokenizer.get_vocab_size())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("tokenizer_config.json", "generation_config.json"):
        if (served / extra).is_file():
            shutil.copyfile(served / extra, out / extra)
    return out


def mocker_command(
    args: argparse.Namespace, config: Config, table: Path, model: Path, role: str = "agg", count: int = 0
) -> list[str]:
    """``dynamo.mocker`` serving the folder ``model`` with ``count`` (default ``--workers``) engines of ``role``
    (agg, prefill or decode), the engine shape of the matching pool of the cluster config and the profile table
    ``table``."""
    pool = {"agg": config.colocated, "prefill": config.prefill, "decode": config.decode}[role]
    blocks = pool.kv_cache_bytes // (config.emulation.kv_bytes_per_token * config.block_size)
    command = [str(DYNAMO_PYTHON), "-m", "dynamo.mocker", "--model-path", str(model),
               "--model-name", args.model, "--num-workers", str(count or args.workers), "--discovery-backend",
               "file", "--block-size", str(config.block_size), "--num-gpu-blocks-override", str(blocks),
               "--max-num-seqs", str(pool.max_concurrent_requests), "--max-num-batched-tokens",
               str(pool.max_num_batched_tokens), "--planner-profile-data", str(table),
               "--speedup-ratio", f"{1 / config.emulation.time_scale:g}"]  # fmt: skip
    if role == "agg":
        return command
    profile = named_profile(config.emulation.profile)
    gbytes_per_s = profile.link.bandwidth_bytes_per_s / 1e9 if config.emulation.model_link else 0.0
    return [*command, "--disaggregation-mode", role, "--kv-bytes-per-token", str(profile.bytes_per_token),
            "--kv-transfer-bandwidth", f"{gbytes_per_s:g}"]  # fmt: skip


def _start(command: list[str], store: Path, log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write((" ".join(command) + "\n").encode())
        log.flush()
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(store))


@contextmanager
def dynamo_workers(args: argparse.Namespace, root: Path, deployment: str = "dynamo") -> Iterator[Path]:
    """The mocker engines of ``deployment`` (``dynamo`` or ``dynamo-pd``), up until the block ends; yields the
    discovery store the frontends use."""
    from bench.scale.dynamo_replay import profile_table

    root.mkdir(parents=True, exist_ok=True)
    config = cluster_config(args)
    table = profile_table(named_profile(config.emulation.profile), root / "mocker_profile.npz")
    model = mocker_model(REPO / config.model.path, root / "model")
    store = root / "discovery"
    store.mkdir(exist_ok=True)
    processes = []
    try:
        for role, count in engine_counts(args, deployment).items():
            log = root / f"mocker-{role}.log"
            print(f"[routers] starting {count} Dynamo mocker {role} engines (log {log}) ...", file=sys.stderr,
                  flush=True)  # fmt: skip
            processes.append(_start(mocker_command(args, config, table, model, role, count), store, log))
        yield store
    finally:
        for process in processes:
            stop(process, ROUTER_STOP_TIMEOUT_S)


@contextmanager
def dynamo_frontend(policy: str, model: str, store: Path, log_path: Path, workers: int) -> Iterator[str]:
    """``dynamo.frontend`` in router mode ``policy`` until it lists ``model`` on ``workers`` engines; yields its
    ``/v1`` base URL."""
    port = free_port()
    command = [str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--router-mode", ROUTER_MODES[policy],
               "--discovery-backend", "file", "--http-host", HOST, "--http-port", str(port)]  # fmt: skip
    process = _start(command, store, log_path)
    base_url = f"http://{HOST}:{port}/v1"
    try:
        t0 = time.monotonic()
        while not _ready(base_url, model, workers):
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"dynamo.frontend exited with {process.returncode}: " + " | ".join(tail))
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"dynamo.frontend has no {workers} {model!r} engines after {READY_TIMEOUT_S:.0f} s "
                                   f"({log_path})")  # fmt: skip
            time.sleep(0.5)
        yield base_url
    finally:
        stop(process, ROUTER_STOP_TIMEOUT_S)


def _ready(base_url: str, model: str, workers: int) -> bool:
    """Whether the frontend lists ``model`` and its health names ``workers`` generate instances (prefill and
    decode engines both serve ``generate``)."""
    try:
        data = httpx.get(f"{base_url}/models", timeout=2.0).json().get("data") or []
        health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    instances = [i for i in health.get("instances") or [] if i.get("endpoint") == "generate"]
    return any(m.get("id") == model for m in data) and len(instances) >= workers
