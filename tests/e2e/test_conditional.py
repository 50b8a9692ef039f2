"""End to end: conditional disaggregation on a mixed pool (a prefill worker beside a colocated one).

Each request prefills on the prefill worker, its KV sent into blocks reserved on the colocated worker, which
decodes it, or on the colocated worker itself (``scheduler/disaggregation.py``). The cluster runs the
``length`` rule so that the path each prompt takes is known; both paths must give the tokens the engine gives
in this process.
"""

from __future__ import annotations

import math
import os
import random
import signal

import helpers
import pytest

from kvconductor.v1 import conductor_pb2

LOCAL_BELOW = 100  # [scheduler] local_prefill_max_tokens: shorter prompts prefill on the colocated worker
PROMPT_LENGTHS = (5, 40, 99, 100, 257, 480)
BLOCK = 16  # the test model's KV block, tokens


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, model_dir):
    run_dir = tmp_path_factory.mktemp("conditional") / "run"
    overrides = ("prefill.node_count=1", "decode.node_count=0", "colocated.node_count=1",
                 'scheduler.disaggregation="length"', f"scheduler.local_prefill_max_tokens={LOCAL_BELOW}")  # fmt: skip
    with helpers.running_cluster(run_dir, model_dir, *overrides, *helpers.FAR_SLOS) as c:
        yield c


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(31)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Greedy tokens of the same engine run in this process, no cluster."""
    return helpers.reference_tokens(model_dir, prompts)


def test_each_prompt_prefills_where_the_rule_says_and_both_paths_give_the_engines_tokens(mixed, prompts, reference):
    before = helpers.worker_loads(mixed)
    remote_blocks = 0
    for prompt, expected in zip(prompts, reference, strict=True):
        tokens, decision, usage = helpers.grpc_generate(mixed, prompt, conductor_pb2.DEPLOYMENT_AUTO)
        assert tokens == expected, f"prompt of {len(prompt)} tokens, {decision.path}"
        local = len(prompt) < LOCAL_BELOW
        assert decision.path == ("local" if local else "remote"), decision.reason
        assert decision.prefill_instance == ("colocated-0" if local else "prefill-0")
        assert decision.decode_instance == "colocated-0"
        # The path not taken, with its numbers.
        other = decision.alternative
        assert other.prefill_instance == ("prefill-0" if local else "colocated-0"), other
        assert other.decode_instance == "colocated-0" and other.predicted_ttft_ms > 0
        assert usage.prompt_tokens == len(prompt)
        remote_blocks += 0 if local else math.ceil(len(prompt) / BLOCK)
    after = helpers.worker_loads(mixed)
    # Every block of each remote prompt crossed the transfer engine into the colocated worker; no local one did.
    sent = after["prefill-0"].kv_blocks_sent - before["prefill-0"].kv_blocks_sent
    received = after["colocated-0"].kv_bytes_received - before["colocated-0"].kv_bytes_received
    assert sent == remote_blocks
    assert received == remote_blocks * helpers.bytes_per_block(mixed, "colocated")
    assert after["colocated-0"].num_reserved == 0  # every reservation was decoded


def test_explain_shows_both_plans_and_the_metrics_count_each_path(mixed, prompts):
    long_prompt = prompts[-1] + [7]
    _, decision, _ = helpers.grpc_generate(mixed, long_prompt, conductor_pb2.DEPLOYMENT_CONDITIONAL)
    explained = helpers.cli(mixed, "explain", decision.request_id)
    assert explained.returncode == 0, explained.stderr
    out = explained.stdout
    assert "prefill prefill-0 -> decode colocated-0" in out
    assert "path: remote (prefills on a prefill instance); the local plan (prefills on its decode instance):" in out
    assert "prefill colocated-0 -> decode colocated-0: predicted TTFT" in out
    metrics = helpers.scrape(helpers.records(mixed)[("conductor", "conductor-0")].metrics_address)
    counts = {p: metrics.get(f'kvconductor_conditional_paths_total{{path="{p}"}}', 0) for p in ("local", "remote")}
    assert counts["local"] >= 3 and counts["remote"] >= 4, counts


def test_auto_stays_disaggregated_where_decode_workers_exist(cluster):
    """The shared cluster has prefill, decode and colocated workers: auto is not conditional there."""
    _, decision, _ = helpers.grpc_generate(cluster, [1, 2, 3], conductor_pb2.DEPLOYMENT_AUTO)
    assert decision.path == "" and decision.decode_instance == "decode-0"


def test_with_its_prefill_worker_dead_a_long_prompt_prefills_locally(mixed, prompts, reference):
    """Last in the module: prefill-0 is killed. Its prompt resumes on the colocated worker, token for token."""
    os.kill(mixed.pid("prefill-0"), signal.SIGKILL)
    tokens, decision, _ = helpers.grpc_generate(mixed, prompts[-1], conductor_pb2.DEPLOYMENT_CONDITIONAL)
    assert tokens == reference[-1]
    assert decision.prefill_instance == "colocated-0", decision.reason
