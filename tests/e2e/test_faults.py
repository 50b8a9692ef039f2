"""Faults on a real cluster (2 prefill + 2 decode workers, no KV copies): nothing is lost, outputs stay exact.

The tests run in file order and consume the cluster: a decode worker and a prefill worker are killed,
kvmeta is replaced and etcd goes away for 10 s.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from helpers import (
    grpc_generate,
    kill_decode_worker_mid_stream,
    kvmeta_matches,
    reference_tokens,
    run_load,
    running_cluster,
    spawn,
    wait_registered,
)

from cli.etcd_server import EmbeddedEtcd
from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import conductor_pb2
from services.common.registry import Registry

PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED


@pytest.fixture(scope="module")
def faults(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("faults")
    with running_cluster(
        root / "run", model_dir, "prefill.node_count=2", "decode.node_count=2",
        "scheduler.kv_cache_balancing_threshold=inf",
    ) as c:  # fmt: skip
        c.extra = []  # processes and etcd servers the tests start
        c.scratch = root
        yield c
        for extra in c.extra:
            extra.terminate() if hasattr(extra, "terminate") else extra.stop()


def _prompts(seed, count, low=40, high=400):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def test_idle_workers_send_a_shared_prefix_to_its_holder(faults):
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(320)]
    _, first, _ = grpc_generate(faults, prefix + [1, 2, 3], PD)
    for suffix in ([4, 5, 6, 7], [8, 9]):
        _, decision, usage = grpc_generate(faults, prefix + suffix, PD)
        assert decision.prefill_instance == first.prefill_instance
        assert (decision.copy_from, usage.cached_tokens) == ("", 320)


def test_kill_9_decode_worker_mid_stream_resumes_with_identical_output(faults, model_dir):
    prompt = _prompts(11, 1, 100, 101)[0]
    expected = reference_tokens(model_dir, [prompt], max_tokens=160)[0]
    tokens, victim = kill_decode_worker_mid_stream(faults, prompt, 160, after_tokens=20)
    assert victim is not None and victim not in faults.manifest["processes"], "the decode worker was not killed"
    assert tokens == expected  # no gap, no repeat, same greedy tokens as without the fault


def test_kill_9_prefill_worker_under_load_loses_nothing(faults, model_dir):
    prompts = _prompts(3, 12)
    expected = reference_tokens(model_dir, prompts)
    _, decision, _ = grpc_generate(faults, prompts[0], PD)
    victim = decision.prefill_instance
    killer = threading.Timer(0.3, os.kill, (faults.pid(victim), signal.SIGKILL))
    killer.start()
    results = run_load(faults, prompts, threads=3)
    killer.join()
    faults.manifest["processes"].pop(victim)
    assert results == expected  # every request completed, on the surviving prefill worker when needed
    hashes = prefix_block_hashes(prompts[0], 16)
    wait_registered(faults, "prefill", victim, present=False, timeout=2 + 1.5)  # lease TTL + 1 s, with slack
    deadline = time.monotonic() + 5
    while victim in kvmeta_matches(faults, hashes):
        assert time.monotonic() < deadline, "kvmeta kept the dead instance's blocks"
        time.sleep(0.1)


def test_kvmeta_restart_under_load_fails_no_request(faults, model_dir):
    prompts = _prompts(17, 16)
    expected = reference_tokens(model_dir, prompts)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(run_load(faults, prompts, threads=2)))
    load.start()
    time.sleep(0.3)
    os.kill(faults.pid("kvmeta-0"), signal.SIGKILL)
    faults.extra.append(spawn(faults, "kvmeta", "kvmeta-1", faults.scratch))
    load.join()
    assert results == expected  # scheduling went cache-unaware for a while; nothing failed
    wait_registered(faults, "kvmeta", "kvmeta-1")
    wait_registered(faults, "kvmeta", "kvmeta-0", present=False)  # the old one's lease expired
    # The workers resend their inventories to the new kvmeta (heartbeat every 2 s): prefix routing is back.
    shared = _prompts(23, 1, 200, 201)[0]
    grpc_generate(faults, shared + [1], PD)
    deadline = time.monotonic() + 10
    while not kvmeta_matches(faults, prefix_block_hashes(shared, 16)):
        assert time.monotonic() < deadline, "the new kvmeta never learned the workers' blocks"
        time.sleep(0.3)
    # The Conductor matches against its own replica of the new kvmeta, which follows it a moment behind.
    deadline = time.monotonic() + 20
    suffix = 2
    while True:
        _, decision, usage = grpc_generate(faults, shared + [suffix], PD)
        if decision.best_len > 0:  # the Conductor follows the new kvmeta, not the departed one
            break
        assert time.monotonic() < deadline, "the Conductor's index never learned the workers' blocks"
        suffix += 1
        time.sleep(0.3)
    assert usage.cached_tokens > 0


def test_etcd_down_for_10_seconds_fails_no_request(faults, model_dir):
    etcd = faults.manifest["embedded_etcd"]
    prompts = _prompts(29, 30, 20, 120)
    expected = reference_tokens(model_dir, prompts)
    os.kill(etcd["pid"], signal.SIGKILL)
    down_at = time.monotonic()
    results = []
    for prompt in prompts:  # sequential, spread over the outage
        results += run_load(faults, [prompt], threads=1)
        if time.monotonic() - down_at > 10:
            break
        time.sleep(max(0.0, 10 / len(prompts) - 0.05))
    assert time.monotonic() - down_at >= 5, "the load finished too early to overlap the outage"
    restarted = EmbeddedEtcd(client_port=etcd["client_port"], peer_port=etcd["peer_port"], run_dir=etcd["run_dir"])
    restarted.start()
    faults.extra.append(restarted)
    assert results == expected[: len(results)]
    # The registrations survived (etcd extends leases when it comes back) and the cluster still serves.
    with Registry(faults.manifest["etcd"], faults.manifest["cluster"]) as registry:
        roles = {role for role, _ in registry.list()}
    assert {"prefill", "decode", "conductor", "kvmeta"} <= roles
    assert run_load(faults, prompts[:3]) == expected[:3]
