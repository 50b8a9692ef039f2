"""SIGTERM drains: a rolling restart of every worker under load loses no request; a disconnect storm leaks no KV."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time

import grpc
import httpx
import pytest
from helpers import (
    address_of,
    reference_tokens,
    run_load,
    running_cluster,
    spawn,
    wait_registered,
)

from kvconductor.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def drained(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("drain")
    # No grace: the drain cuts whatever is in flight, so every drain exercises resumption elsewhere.
    with running_cluster(
        root / "run", model_dir, "prefill.node_count=1", "decode.node_count=1", "cluster.drain_grace_s=0"
    ) as c:
        c.extra, c.scratch = [], root
        yield c
        for process in c.extra:
            process.terminate()
            process.wait(timeout=30)


def _load(cluster, instance_id):
    with grpc.insecure_channel(address_of(cluster, instance_id)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def test_rolling_restart_of_every_worker_under_load_loses_no_request(drained, model_dir):
    rng = random.Random(41)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(30, 200))] for _ in range(4)]
    expected = reference_tokens(model_dir, prompts, max_tokens=300)  # streams of ~2 s: longer than the grace
    results: list = []
    done = threading.Event()

    def load():  # two streams at a time, over and over, until every worker has been replaced
        while not done.is_set():
            results.extend(zip(range(len(prompts)), run_load(drained, prompts, threads=2, max_tokens=300), strict=True))

    loader = threading.Thread(target=load)
    loader.start()
    for old, new, role in (("prefill-0", "prefill-1", "prefill"), ("decode-0", "decode-1", "decode")):
        drained.extra.append(spawn(drained, role, new, drained.scratch))
        wait_registered(drained, role, new)
        deadline = time.monotonic() + 10
        while role == "decode" and not _load(drained, old).num_running:  # drain it with streams in flight
            assert time.monotonic() < deadline, "no stream on the old decode worker to cut"
            time.sleep(0.05)
        os.kill(drained.pid(old), signal.SIGTERM)
        wait_registered(drained, role, old, present=False, timeout=5)  # it leaves etcd at once
    time.sleep(2.0)
    done.set()
    loader.join(timeout=300)
    assert not loader.is_alive()
    assert [tokens for _, tokens in results] == [expected[i] for i, _ in results]  # all completed, exactly
    log = (drained.run_dir / "conductor-0.log").read_text()
    assert re.search(r"decode-0: [A-Z_]+: .*; resuming after \d+ streamed tokens", log), "the drain cut no stream"


def test_disconnect_storm_returns_every_block(drained):
    workers = ("prefill-1", "decode-1")
    idle = {w: _load(drained, w) for w in workers}
    body = {"model": "tiny-llama", "prompt": "x" * 300, "max_tokens": 2000, "stream": True, "ignore_eos": True}

    def hang_up(n):
        with httpx.stream("POST", f"{drained.rest}/completions", json=body, timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= n:
                    break

    storm = [threading.Thread(target=hang_up, args=(2 + i % 5,)) for i in range(12)]
    for t in storm:
        t.start()
    for t in storm:
        t.join(timeout=60)
    deadline = time.monotonic() + 20
    for w in workers:
        while (load := _load(drained, w)).num_running or load.num_free_blocks != idle[w].num_free_blocks:
            assert time.monotonic() < deadline, f"{w} still holds KV after the clients left: {load}"
            time.sleep(0.2)
