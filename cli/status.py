"""``kvconductor status`` and ``explain``: what the Conductor schedules on, and why it placed a request."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import grpc

from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import Config
from services.common.instance_record import InstanceRecord, StoreRecord, WorkerRecord
from services.common.rpc import sync_channel
from services.conductor.prediction_errors import DEFAULT_WINDOW_S

COLUMNS = (
    "role",
    "instance",
    "health",
    "address",
    "free/total blocks",
    "indexed",
    "running",
    "hit rate",
    "T_queue ms",
    "cost model",
)


STALLED_ENGINE_S = 5.0  # an engine loop that has not turned for this long is shown as stalled


def _conductor(config: Config, method: str, request: Any) -> Any:
    """One call to the Conductor (raises grpc.RpcError)."""
    with sync_channel(config.cluster.scheduler_endpoint) as channel:
        return getattr(conductor_pb2_grpc.ConductorStub(channel), method)(request, timeout=5.0)


def _record(instance: conductor_pb2.InstanceStatus) -> WorkerRecord:
    record = InstanceRecord.from_json(json.loads(instance.record_json))
    assert isinstance(record, WorkerRecord), f"{instance.instance_id} is not a worker"
    return record


def _row(instance: conductor_pb2.InstanceStatus) -> tuple[str, ...]:
    try:
        with sync_channel(instance.address) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=2.0)
        health = (
            "ok"
            if load.engine_heartbeat_age_s < STALLED_ENGINE_S
            else f"engine stalled {load.engine_heartbeat_age_s:.0f}s"
        )
        if instance.scheduling not in ("", "ok"):
            health += f", {instance.scheduling}"
        blocks = f"{load.num_free_blocks}/{load.num_total_blocks}"
        queried = load.prefix_cache_query_tokens
        hit_rate = f"{load.prefix_cache_hit_tokens / queried:.1%}" if queried else "-"
        running = str(load.num_running)
    except grpc.RpcError as e:
        health, blocks, hit_rate, running = f"unreachable ({e.code().name})", "-", "-", "-"
    model = _record(instance).cost_model
    p, d = model.prefill, model.decode
    costs = (
        f"prefill {p.c0 * 1e3:.1f} ms + {p.c1 * 1e6:.0f} ms/1k tokens + {p.c2 * 1e9:.1f} ms/1M attention pairs; "
        f"decode step {d.d0 * 1e3:.1f} ms + {d.d1 * 1e3:.2f} ms/sequence + {d.d2 * 1e6:.2f} ms/1k context tokens"
    )
    return (instance.role, instance.instance_id, health, instance.address, blocks, str(instance.indexed_blocks),
            running, hit_rate, f"{instance.t_queue_ms:.1f}", costs)  # fmt: skip


def print_status(config: Config, window_s: float = 0.0) -> int:
    """Print the table (errors and latencies over the last ``window_s``; 0 = 300 s); 1 when unreachable."""
    try:
        status = _conductor(config, "GetStatus", conductor_pb2.GetStatusRequest(window_s=window_s))
    except grpc.RpcError as e:
        print(f"the Conductor at {config.cluster.scheduler_endpoint} is unreachable: {e.code().name}")
        return 1
    print(f"model: {status.model}")
    print(f"KV index: following kvmeta at {status.kv_index_source}" if status.kv_index_source else
          "KV index: following no kvmeta (prompts are scheduled without prefix matches)")  # fmt: skip
    _table([COLUMNS, *(_row(i) for i in status.instances)])
    print(f"requests finished in the last {window_s or DEFAULT_WINDOW_S:.0f} s:")
    for lat in status.latencies:
        print(f"  {lat.metric.upper()} (n={lat.samples}): p50 {lat.p50_ms:.1f} ms, p90 {lat.p90_ms:.1f} ms, "
              f"p99 {lat.p99_ms:.1f} ms")  # fmt: skip
    rejected = sum(status.rejections.values())
    if rejected:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(status.rejections.items()))
        print(f"  rejected since the Conductor started: {rejected} ({kinds}; `kvconductor explain ID` says why, "
              "the 429 names the SLO's key)")  # fmt: skip
    if status.prediction_errors:
        errors = ", ".join(
            f"{e.metric} {e.median_relative_error:.0%} (n={e.samples})" for e in status.prediction_errors
        )
        print(f"  cost-model median relative error: {errors}")
    metrics = ", ".join(f"{i.instance_id} http://{_record(i).metrics_address}/metrics" for i in status.instances)
    print(f"metrics: {metrics}")
    overheads = ", ".join(f"{path} {ms:.1f} ms" for path, ms in sorted(status.ttft_overhead_ms.items()))
    print(f"learned TTFT overhead: {overheads}")
    if status.store_json:
        store = InstanceRecord.from_json(json.loads(status.store_json))
        assert isinstance(store, StoreRecord), "the store record is not a store's"
        started = f"{datetime.fromtimestamp(store.generation / 1e6, UTC):%Y-%m-%d %H:%M:%S} UTC"
        print(f"Mooncake Store: {store.instance_id}, master {store.master_address} (start of {started})")
    shared = [i for i in status.instances if i.num_foreign or i.overcommit_requests_max or i.overcommit_blocks_max]
    if shared:
        print("other Conductors' requests, and the most a worker held beyond this Conductor's count (requests/blocks):")
        for i in shared:
            print(f"  {i.instance_id}: {i.num_foreign} now; over-commit at most {i.overcommit_requests_max}/"
                  f"{i.overcommit_blocks_max}")  # fmt: skip
    if status.links:
        print("learned KV links (T_transfer = latency + bytes / bandwidth, from measured sends and copies):")
        for link in status.links:
            fit = (f"{link.bandwidth_gbps:.2f} Gbit/s + {link.latency_ms:.1f} ms" if link.bandwidth_gbps
                   else "too few distinct sizes to fit yet")  # fmt: skip
            to = link.destination or "any (pushes timed by the engine's connector)"
            print(f"  {link.source} -> {to}: {fit} (n={link.samples})")
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _candidates(d: conductor_pb2.Decision) -> None:
    """The decision's prefill candidates as a table."""
    header: tuple[str, ...] = ("candidate", "prefix_len", "copy from", "T_queue", "T_transfer", "T_prefill", "T_send",
                               "TTFT (ms)")  # fmt: skip
    shared = any(c.t_shared_ms for c in d.candidates)  # colocated: the decode time each would share
    rows = [
        (c.instance_id, str(c.prefix_len), c.copy_from or "-", f"{c.t_queue_ms:.1f}", f"{c.t_transfer_ms:.1f}",
         f"{c.t_prefill_ms:.1f}", f"{c.t_send_ms:.1f}", f"{c.predicted_ttft_ms:.1f}")
        + ((f"{c.t_shared_ms:.1f}",) if shared else ())
        for c in d.candidates
    ]  # fmt: skip
    header += ("shared (ms)",) if shared else ()
    if rows:
        _table([header, *rows])


def print_decision(config: Config, request_id: str) -> int:
    """Print one request's decision; 1 when it is unknown or the Conductor unreachable."""
    try:
        d = _conductor(config, "ExplainDecision", conductor_pb2.ExplainDecisionRequest(request_id=request_id))
    except grpc.RpcError as e:
        print(f"no decision: {e.details() or e.code().name}")
        return 1
    verdict = "REJECTED" if d.rejected else f"prefill {d.prefill_instance} -> decode {d.decode_instance}"
    label = f"{d.client_request_id} [{d.request_id}]" if d.client_request_id else d.request_id
    print(f"request {label} ({d.policy}): {verdict}")
    print(f"  {d.reason}")
    print(f"  best_len {d.best_len} on {d.best_instance or '-'}; predicted TTFT {d.predicted_ttft_ms:.1f} ms "
          f"(learned overhead {d.ttft_overhead_ms:.1f} ms included), TBT {d.predicted_tbt_ms:.1f} ms"
          + ("; admitted as a probe (idle instances)" if d.probe else ""))  # fmt: skip
    o = d.outcome
    if o.ttft_ms:
        copied = f", copied {o.copied_tokens} in {o.kv_copy_ms:.1f} ms" if o.copied_tokens else ""
        print(f"  measured: TTFT {o.ttft_ms:.1f} ms, TBT {o.tbt_ms:.1f} ms, prefill {o.prefill_ms:.1f} ms, "
              f"KV send {o.kv_send_ms:.1f} ms ({o.kv_send_exposed_ms:.1f} ms after token 0), "
              f"cached {o.cached_tokens} tokens{copied}")  # fmt: skip
    if o.copy_note:
        print(f"  the planned copy moved less: {o.copy_note}")
    _candidates(d)
    if d.path:  # conditional disaggregation: the plan of the other path, and its candidates
        a, other = d.alternative, "remote" if d.path == "local" else "local"
        where = {"local": "on its decode instance", "remote": "on a prefill instance"}
        print(f"  path: {d.path} (prefills {where[d.path]}); the {other} plan (prefills {where[other]}):")
        if a.rejected:
            print(f"    not admitted: {a.reason}")
        if a.prefill_instance:
            print(f"    prefill {a.prefill_instance} -> decode {a.decode_instance}: predicted TTFT "
                  f"{a.predicted_ttft_ms:.1f} ms, TBT {a.predicted_tbt_ms:.1f} ms")  # fmt: skip
        _candidates(a)
    return 0
