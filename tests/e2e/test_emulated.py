"""The emulated engine on a real cluster: 2 prefill + 1 decode + 1 colocated emulated workers.

Workers run the built-in scheduler, block manager and prefix cache on a real KV pool registered with
the transfer engine; only the forward pass is a wait from the analytic A800 profile. Emulated tokens
are a function of the KV bytes (``engine.emulated_runner``), so equal outputs on the colocated worker,
through a prefill-to-decode transfer and after a KV copy between prefill workers prove those bytes
crossed the transfer engine intact.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    FAR_SLOS,
    bytes_per_block,
    grpc_generate,
    prefill_booked_on,
    running_cluster,
    wait_indexed,
    worker_loads,
)

from kvconductor.v1 import conductor_pb2
from scheduler.profiles import analytic_gpu

PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
COLOCATED = conductor_pb2.DEPLOYMENT_COLOCATED
TIME_SCALE = 1.0


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, model_dir):
    with running_cluster(
        tmp_path_factory.mktemp("emulated") / "run", model_dir, 'engine.backend="emulated"',
        'emulation.profile="analytic-gpu"', f"emulation.time_scale={TIME_SCALE}", "emulation.kv_bytes_per_token=64",
        "prefill.node_count=2", "decode.node_count=1", "colocated.node_count=1",
        "prefill.max_num_batched_tokens=8192", "colocated.max_num_batched_tokens=8192",
        *FAR_SLOS,
    ) as c:  # fmt: skip
        yield c


def _prompt(rng, n):
    return [rng.randrange(256) for _ in range(n)]


def test_disaggregated_equals_colocated_and_the_kv_crosses_the_transfer_engine(emulated):
    rng = random.Random(1)
    before = worker_loads(emulated)
    sent = 0
    for n in (40, 333, 2000):
        prompt = _prompt(rng, n)
        single, on_colocated, _ = grpc_generate(emulated, prompt, COLOCATED, max_tokens=20)
        tokens, decision, _ = grpc_generate(emulated, prompt, PD, max_tokens=20)
        assert on_colocated.prefill_instance == "colocated-0" and decision.decode_instance == "decode-0"
        assert tokens == single and len(tokens) == 20
        sent += -(-n // 16)
    after = worker_loads(emulated)
    received = after["decode-0"].kv_bytes_received - before["decode-0"].kv_bytes_received
    assert received >= sent * bytes_per_block(emulated) == sent * 16 * 64


def test_a_prompt_takes_at_least_its_profile_time(emulated):
    prompt = _prompt(random.Random(2), 8000)
    expected_s = analytic_gpu().prefill.predict(len(prompt)) * TIME_SCALE
    start = time.monotonic()
    grpc_generate(emulated, prompt, PD, max_tokens=1)
    assert time.monotonic() - start >= expected_s  # the emulated forward pass waits its profile's time


def test_a_busy_holders_prefix_is_copied_and_the_copy_gives_the_same_tokens(emulated):
    rng = random.Random(3)
    prefix = _prompt(rng, 2000)  # recomputing it takes about 0.2 s (analytic A800); copying its 125 blocks, ms
    prompt = prefix + [7, 7, 7]
    expected, _, _ = grpc_generate(emulated, prompt, COLOCATED)
    # A long prompt that starts with the prefix caches it within its first chunk and then keeps its worker
    # busy for seconds (about 7 s of emulated prefill); the prompt sent meanwhile copies the prefix.
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(grpc_generate, emulated, prefix + _prompt(rng, 40000), PD, 1)
        holder = prefill_booked_on(emulated, busy)
        assert holder is not None
        wait_indexed(emulated, prefix, holder)  # the first chunk's blocks, announced while the rest computes
        tokens, decision, usage = grpc_generate(emulated, prompt, PD)
        busy.result()
    assert (decision.copy_from, decision.prefix_len) == (holder, 2000), decision.reason
    assert decision.prefill_instance != holder and usage.cached_tokens == 2000
    assert tokens == expected  # the copied KV bytes carried the prefix's chain values intact
