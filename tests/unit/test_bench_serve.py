"""`kvconductor bench serve`: workload builders, summary math, and one run against a real cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.provenance import command_line
from bench.serve.cli import add_arguments, build_workload, pacing
from bench.serve.client import RequestResult, error_reason
from bench.serve.metrics import format_table, percentile, summarize, within_slo
from bench.serve.runner import _open_loop, arrival_times, poisson_arrivals
from bench.serve.workloads import BenchRequest, TraceScale, load_trace, shared_prefix, trace_request

REPO = Path(__file__).resolve().parents[2]


def _record(ids, input_length, output_length=100, timestamp=0):
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": ids}


def test_equal_hash_ids_give_equal_token_blocks():
    scale = TraceScale(length_scale=1 / 32)
    a = trace_request(_record([7, 8, 9], 3 * 512), scale)
    b = trace_request(_record([7, 8, 10], 3 * 512), scale)
    c = trace_request(_record([11, 8, 9], 3 * 512), scale)
    assert a.prompt_ids[:32] == b.prompt_ids[:32]  # two shared blocks of 16 tokens
    assert a.prompt_ids[32:] != b.prompt_ids[32:]
    assert a.prompt_ids[:16] != c.prompt_ids[:16]
    assert trace_request(_record([7, 8, 9], 3 * 512), scale) == a  # deterministic


def test_trace_lengths_and_times_scale_as_documented():
    scale = TraceScale(length_scale=1 / 32, max_output_tokens=20, time_scale=0.5)
    r = trace_request(_record([1, 2], 1000, output_length=100, timestamp=4000), scale)
    assert len(r.prompt_ids) == math.ceil(1000 / 32)  # 32: one full 16-token block + a partial one
    assert r.max_tokens == math.ceil(100 / 32)
    assert r.arrival_s == pytest.approx(2.0)
    assert trace_request(_record([1], 10, output_length=2000), scale).max_tokens == 20  # capped
    assert len(trace_request(_record(list(range(100)), 51_200), TraceScale(max_input_tokens=64)).prompt_ids) == 64
    assert TraceScale(length_scale=1 / 16).block_tokens == 32


def test_load_trace_limits_and_starts_at_zero(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [_record([0, i + 1], 900, timestamp=1000 + 500 * i) for i in range(5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = load_trace(path, 3, TraceScale())
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0]
    assert len({r.prompt_ids[:16] for r in requests}) == 1  # hash id 0 everywhere
    with pytest.raises(ValueError, match="not found"):
        load_trace(tmp_path / "missing.jsonl", 3, TraceScale())


def test_shared_prefix_is_n_prefixes_times_m_suffixes():
    requests = shared_prefix(2, 3, prefix_len=20, suffix_len=5, output_len=4)
    assert len(requests) == 6
    assert {r.prompt_ids[:20] for r in requests[0::2]} != {r.prompt_ids[:20] for r in requests[1::2]}
    assert len({r.prompt_ids[:20] for r in requests}) == 2
    assert len({r.prompt_ids for r in requests}) == 6
    assert all(len(r.text) == 25 and r.max_tokens == 4 for r in requests)


def test_tpot_and_percentiles_on_hand_numbers():
    r = RequestResult(prompt_len=10, max_tokens=11, ttft=0.1, latency=1.1, output_tokens=11)
    assert r.tpot == pytest.approx(0.1)  # (1.1 - 0.1) / (11 - 1)
    assert RequestResult(10, 1, ttft=0.1, latency=0.1, output_tokens=1).tpot is None
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def test_goodput_hit_rate_and_errors():
    fast = RequestResult(100, 5, ttft=0.1, latency=0.5, output_tokens=5, prompt_tokens=100, cached_tokens=50)
    slow_first = RequestResult(100, 5, ttft=0.9, latency=1.3, output_tokens=5, prompt_tokens=100, cached_tokens=0)
    slow_decode = RequestResult(100, 5, ttft=0.1, latency=2.1, output_tokens=5, prompt_tokens=100, cached_tokens=50)
    rejected = RequestResult(100, 5, error=error_reason(429, '{"error": {"message": "predicted TTFT 2500 ms"}}'))
    results = [fast, slow_first, slow_decode, rejected]
    assert within_slo(fast, 0.5, 0.2) and not within_slo(slow_first, 0.5, 0.2) and not within_slo(slow_decode, 0.5, 0.2)
    s = summarize(results, duration_s=2.0, ttft_slo_ms=500, tpot_slo_ms=200)
    assert (s["completed"], s["failed"], s["good_requests"]) == (3, 1, 1)
    assert s["goodput"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["prefix_cache_hit_rate"] == pytest.approx(100 / 300)
    assert s["ttft_ms"]["median"] == pytest.approx(100)
    assert s["tpot_ms"]["median"] == pytest.approx(100)  # (0.5 - 0.1) / 4 s
    assert s["errors"] == {"429: predicted TTFT N ms": 1}
    assert summarize(results, 2.0)["good_requests"] == 3  # no SLO: every completed request counts


def test_pacing_defaults_and_poisson_arrivals():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--base-url", "http://x/v1", "--model", "m"]
    assert pacing(parser.parse_args(base)) == (1, None)  # the seed's sequential runs
    assert pacing(parser.parse_args([*base, "--workload", "trace"])) == (None, None)  # trace timestamps
    assert pacing(parser.parse_args([*base, "--request-rate", "2"])) == (None, 2.0)
    assert len(build_workload(parser.parse_args([*base, "--num-requests", "6", "--num-prefixes", "3"]))) == 6
    arrivals = poisson_arrivals(2000, rate=4.0, seed=1)
    assert arrivals == poisson_arrivals(2000, rate=4.0, seed=1) and arrivals[0] == 0.0
    assert arrivals[-1] / 1999 == pytest.approx(0.25, rel=0.1)


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps_and_judges_goodput():
    gaps = [0.02] * 18 + [0.5, 0.3]  # 20 gaps: the longest 10% are 0.5 and 0.3
    r = RequestResult(100, 21, ttft=0.1, latency=0.1 + sum(gaps), itl=gaps, output_tokens=21)
    assert r.tbt == pytest.approx(0.4) and r.tpot == pytest.approx(sum(gaps) / 20)
    assert within_slo(r, 1.0, 0.1) and not within_slo(r, 1.0, None, 0.3) and within_slo(r, 1.0, None, 0.45)
    rejected = RequestResult(100, 21, error="429: predicted TTFT N ms exceeds the SLO of N ms")
    strict = summarize([r, rejected], 1.0, ttft_slo_ms=1000, tbt_slo_ms=300)
    assert strict["tbt_ms"]["median"] == pytest.approx(400) and strict["slo_attainment"] == 0.0
    loose = summarize([r, rejected], 1.0, ttft_slo_ms=1000, tbt_slo_ms=450)
    assert loose["good_requests"] == 1 and loose["slo_attainment"] == 0.5  # the rejected one is a miss
    # 21 tokens in 3 chunks (a server that sends several tokens a chunk): no gap per token, the mean stands in
    coalesced = RequestResult(100, 21, ttft=0.1, latency=1.1, itl=[0.5, 0.5], output_tokens=21)
    assert coalesced.tbt == pytest.approx(coalesced.tpot) == pytest.approx(0.05)
    mixed = summarize([r, coalesced, rejected], 1.0)  # the summary says how many TBTs are of their tokens' gaps
    assert mixed["tbt_per_token"] == 0.5 and "TBT of 50% of the streams" in format_table(mixed)
    assert "streams" not in format_table(strict)


def test_the_client_times_the_chunks_that_carry_text_only(monkeypatch):
    """A chat stream: the role chunk and token 0 together, then tokens 1 and 2, a finish chunk, the usage."""
    from bench.serve import client

    clock = iter([1.0, 1.5, 1.8])  # the times of the three chunks with text
    monkeypatch.setattr(client.time, "perf_counter", lambda: next(clock))
    r = RequestResult(10, 3)
    timer = client._Timer(r, 0.0)
    for data in (
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {"choices": [{"delta": {"content": "c"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}},
    ):
        timer.on_data(data)
    timer.finish()
    assert r.ttft == 1.0 and r.itl == pytest.approx([0.5, 0.3]) and r.latency == 1.8
    assert r.output_tokens == 3 and r.gap_per_token and r.tbt == pytest.approx(0.5)
    empty = RequestResult(10, 3)
    timer = client._Timer(empty, 0.0)
    timer.on_data({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    timer.finish()
    assert empty.ttft is None and empty.error == "no tokens: the stream ended without a chunk of text"


def test_a_rate_scales_a_traces_own_arrivals_and_keeps_its_bursts():
    trace = [BenchRequest((65,), 1, t) for t in (0.0, 0.1, 0.2, 9.0)]
    assert arrival_times(trace, None, 0) == [0.0, 0.1, 0.2, 9.0]
    # 4 arrivals at a mean 1/s span 3 s, as Poisson arrivals would; the burst of three stays a burst
    assert arrival_times(trace, 1.0, 0) == pytest.approx([0.0, 0.1 / 3, 0.2 / 3, 3.0])
    plain = [BenchRequest((65,), 1) for _ in range(3)]
    assert arrival_times(plain, 2.0, 7) == poisson_arrivals(3, 2.0, 7)


def test_open_loop_sends_in_arrival_order_whatever_the_list_order():
    sent: list[int] = []

    async def one(i: int) -> None:
        sent.append(i)

    asyncio.run(_open_loop(one, [0.02, 0.0, 0.01], time.perf_counter()))
    assert sent == [1, 2, 0]


def test_parsing_bench_args_does_not_import_torch():
    code = (
        "import sys; from cli.main import _parser; "
        "_parser().parse_args(['bench', 'serve', '--base-url', 'http://x/v1', '--model', 'm']); "
        "_parser().parse_args(['bench', 'compare', '--requests', '4']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_unreachable_base_url_is_one_line(capsys):
    from cli.main import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach http://127.0.0.1:1/v1") and "\n" not in err


def test_the_recorded_command_hides_the_api_key():
    assert command_line(["bench", "serve", "--api-key", "sk-secret", "--model", "m"]) == (
        "kvconductor bench serve --api-key '***' --model m"
    )
    assert "sk-secret" not in command_line(["bench", "serve", "--api-key=sk-secret"])


def test_neighbours_hostile_bodies_sit_at_and_just_over_the_limits():
    from bench.serve.neighbours import KINDS, Limits, hostile_bodies

    limits = Limits(max_prompt_bytes=4096, max_request_bytes=8192, max_stop_strings=16, tokenized_bytes=1000)
    bodies = hostile_bodies(list(KINDS), "m", limits, stop_strings=1000)
    stops = json.loads(bodies["stops"][1])["stop"]
    assert len(set(stops)) == 1000
    assert len(json.loads(bodies["prompt-at-limit"][1])["prompt"].encode()) == 4096
    assert len(bodies["chat-at-limit"][1]) <= 8192 and bodies["chat-at-limit"][0] == "/chat/completions"
    assert len(json.loads(bodies["prompt-tokenized"][1])["prompt"].encode()) == 1000
    assert len(json.loads(bodies["prompt-over-limit"][1])["prompt"].encode()) == 4097
    assert len(bodies["body-over-limit"][1]) == 8193
    tight = hostile_bodies(["prompt-at-limit"], "m", Limits(1 << 20, 1 << 20, 16, 1 << 20), 1)  # the body limit binds
    assert len(tight["prompt-at-limit"][1]) <= 1 << 20


def test_neighbours_verdict_bounds_hostile_p99_by_the_quiet_spread():
    from bench.serve.neighbours import verdict

    def phase(name, p99, statuses=()):
        answers = [{"kind": "stops", "status": s} for s in statuses]
        return {"phase": name, "stats": {"p99": p99, "errors": []}, "answers": answers}

    quiet = [phase("quiet 1", 10.0), phase("quiet 3", 12.0), phase("quiet 2", 11.0)]  # median 11, spread 2
    ok = verdict([*quiet, phase("hostile 1", 17.0, (400, 413))])
    assert ok["passed"] and ok["bound_ms"] == 17.0
    assert not verdict([*quiet, phase("hostile 1", 17.1, (400,))])["within_noise"]
    accepted = verdict([*quiet, phase("hostile 1", 10.0, (400, 200))])
    assert accepted["within_noise"] and not accepted["refused"] and not accepted["passed"]
