"""`bench.soak`: window aggregation, resource deltas and the verdict (pure parts), and the flags."""

from __future__ import annotations

import math
import os

import pytest

from bench.serve.client import RequestResult
from bench.soak import report
from bench.soak.probe import open_fds, rss_kib
from bench.soak.run import build_requests, parser, request_count


def _ok(start_s, ttft=0.1, latency=0.5, tokens=5):
    return RequestResult(prompt_len=10, max_tokens=tokens, start_s=start_s, ttft=ttft, latency=latency,
                         output_tokens=tokens)  # fmt: skip


def _failed(start_s, error="429: predicted TTFT N ms exceeds the SLO of N ms"):
    return RequestResult(prompt_len=10, max_tokens=5, start_s=start_s, error=error)


def _sample(label, t_s, rss_kib, fds, free, alive=True):
    processes = {"decode-0": {"role": "decode", "pid": 42, "rss_kib": rss_kib if alive else None,
                              "fds": fds if alive else None}}  # fmt: skip
    workers = {"decode-0": None if free is None else {"free_blocks": free, "total_blocks": 100, "running": 0,
                                                      "waiting": 0, "reserved": 0}}  # fmt: skip
    return {"label": label, "t_s": t_s, "processes": processes, "workers": workers}


def _samples(end_rss=110 * 1024, end_fds=20, end_free=100, alive=True):
    return [
        _sample("start", -5, 100 * 1024, 10, 100),
        _sample("warmup", -1, 105 * 1024, 15, 100),
        _sample("load", 5, 106 * 1024, 16, 80),
        _sample("load", 10, 107 * 1024, 17, 60),
        _sample("load", 15, 108 * 1024, 18, 90),
        _sample("end", 20, end_rss, end_fds, end_free, alive),
    ]


def test_windows_group_by_start_time_and_keep_empty_windows():
    results = [_ok(0.0, ttft=0.1), _ok(29.9, ttft=0.3), _failed(31.0), _ok(95.0, ttft=0.2, latency=1.0)]
    w = report.windows(results, 30.0)
    assert [(x["start_s"], x["requests"], x["completed"]) for x in w] == [(0, 2, 2), (30, 1, 0), (60, 0, 0), (90, 1, 1)]
    assert w[0]["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert w[0]["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert w[0]["tpot_ms"]["p50"] == pytest.approx((0.5 - 0.1) / 4 * 1e3, rel=0.6)
    assert w[1]["errors"] == {"429: predicted TTFT N ms exceeds the SLO of N ms": 1}
    assert math.isnan(w[1]["ttft_ms"]["p50"]) and math.isnan(w[2]["e2e_ms"]["p90"])
    assert w[3]["e2e_ms"]["p50"] == pytest.approx(1000.0)
    assert report.windows([], 30.0) == []
    with pytest.raises(ValueError):
        report.windows(results, 0)


def test_resources_start_warmup_end_and_deltas():
    table = report.resources(_samples())
    p = table["processes"]["decode-0"]
    assert p["rss_mib"] == {"start": 100, "warmup": 105, "end": 110, "min": 100, "max": 110, "delta": 10,
                            "delta_after_warmup": 5}  # fmt: skip
    assert p["fds"]["delta"] == 10 and p["fds"]["delta_after_warmup"] == 5
    assert p["rss_slope_mib_per_min_under_load"] == pytest.approx(12.0)  # 1 MiB per 5 s
    w = table["workers"]["decode-0"]
    assert w["total_blocks"] == 100 and w["free_blocks"]["min"] == 60 and w["free_blocks"]["delta"] == 0


def test_slope_needs_three_points_and_a_time_span():
    assert report.slope_per_min([(0, 1), (1, 2)]) is None
    assert report.slope_per_min([(5, 1), (5, 2), (5, 3)]) is None
    assert report.slope_per_min([(0, 0), (30, 1), (60, 2)]) == pytest.approx(2.0)


def test_verdict_passes_with_no_errors_and_blocks_back():
    results = [_ok(i) for i in range(10)]
    v = report.verdict(10, results, report.resources(_samples()))
    assert v["passed"] and v["failures"] == [] and v["flags"] == []
    assert v["line"].startswith("PASS: 10/10 completed, 0 errors")


def test_verdict_fails_on_errors_missing_results_leaked_blocks_and_dead_processes():
    table = report.resources(_samples())
    v = report.verdict(10, [_ok(i) for i in range(9)] + [_failed(9)], table)
    assert not v["passed"] and v["failures"] == ["1 failed requests (1 kinds)"] and v["line"].startswith("FAIL")
    assert report.verdict(11, [_ok(i) for i in range(10)], table)["failures"] == ["10 results for 11 requests"]
    leaked = report.verdict(10, [_ok(i) for i in range(10)], report.resources(_samples(end_free=97)))
    assert leaked["failures"] == ["decode-0: 97 free KV blocks at the end, 100 at the start"]
    assert "97 free KV blocks" in leaked["line"]
    gone = report.verdict(10, [_ok(i) for i in range(10)], report.resources(_samples(alive=False, end_free=None)))
    assert not gone["passed"]
    assert gone["failures"] == ["decode-0 (pid 42) is gone at the end", "decode-0: free KV blocks unreadable at end"]


def test_rss_and_fd_growth_are_flagged_not_failed():
    results = [_ok(i) for i in range(10)]
    # 105 -> 140 MiB: +35 MiB > max(32 MiB, 10.5 MiB); fds 15 -> 30: +15 > 8
    v = report.verdict(10, results, report.resources(_samples(end_rss=140 * 1024, end_fds=30)))
    assert v["passed"]
    assert v["flags"] == [
        "decode-0 RSS +35.0 MiB after warm-up (105 -> 140 MiB)",
        "decode-0 open fds +15 after warm-up",
    ]
    assert "2 flagged" in v["line"]
    # the percentage wins when it is larger: 10 % of 105 MiB = 10.5 MiB
    strict = report.Thresholds(rss_flag_mib=1.0, rss_flag_pct=10.0, fd_flag=100)
    assert report.verdict(10, results, report.resources(_samples(end_rss=115 * 1024)), strict)["flags"] == []
    assert len(report.verdict(10, results, report.resources(_samples(end_rss=116 * 1024)), strict)["flags"]) == 1


def test_markdown_has_every_section():
    results = [_ok(i) for i in range(10)]
    from bench.serve.metrics import summarize

    table = report.resources(_samples())
    record = {
        "config": {"requests": 10, "workload": "shared-prefix", "arrivals": "poisson", "rate": 1.0, "seed": 0,
                   "warmup": 2},
        "cluster": {"description": "test"}, "code": "abc", "wall_s": 30.0, "drain_s": 0.5,
        "summary": summarize(results, 10.0), "windows": report.windows(results, 5.0), "resources": table,
        "thresholds": vars(report.Thresholds()), "verdict": report.verdict(10, results, table),
    }  # fmt: skip
    text = report.markdown(record)
    for heading in (
        "# Soak: PASS",
        "## Latency per window",
        "## Processes",
        "## Workers: free KV blocks",
        "## Verdict",
    ):
        assert heading in text
    assert "| decode-0 | 100.0 | 105.0 | 110.0 |" in text


def test_request_count_and_workload_flags():
    assert request_count(parser().parse_args([])) == 150
    assert request_count(parser().parse_args(["--rate", "2", "--duration-hint", "60"])) == 120
    for bad in (["--requests", "5", "--duration-hint", "9"], ["--rate", "0"], ["--requests", "0"]):
        with pytest.raises(ValueError):
            request_count(parser().parse_args(bad))
    args = parser().parse_args(["--arrivals", "constant", "--rate", "4", "--num-prefixes", "3"])
    requests = build_requests(args, 7, seed=0)
    assert len(requests) == 7 and [r.arrival_s for r in requests[:3]] == [0.0, 0.25, 0.5]
    assert requests[0].prompt_ids[:256] == requests[3].prompt_ids[:256] != requests[1].prompt_ids[:256]
    assert all(r.arrival_s is None for r in build_requests(parser().parse_args(["--workload", "random"]), 3, 0))


def test_proc_readers_on_this_process():
    assert rss_kib(os.getpid()) > 1000 and open_fds(os.getpid()) >= 3
    assert rss_kib(2**22 + 12345) is None and open_fds(2**22 + 12345) is None
