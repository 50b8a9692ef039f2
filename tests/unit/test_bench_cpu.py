"""The CPU sampler of the vLLM comparison names processes after their service and splits levels right."""

from __future__ import annotations

from bench.compare.cpu import name_of, windows

ARGVS = {
    10: ["python", "-m", "cli.main", "serve", "decode", "--id", "decode-0"],
    11: ["VLLM::EngineCore"],
    12: ["VLLM::Worker"],
    20: ["python", "-m", "bench.compare.vllm_server", "--config", "c.toml", "--role", "prefill", "--port", "1"],
    30: ["python", "-m", "cli.main", "serve", "conductor", "--id", "conductor-0"],
    40: ["/x/bin/etcd", "--data-dir", "d"],
    50: ["sleep", "1"],
}
PARENTS = {10: 1, 11: 10, 12: 11, 20: 1, 30: 1, 40: 1, 50: 1}
COMMS = {10: "python", 11: "VLLM::EngineCor", 12: "VLLM::Worker", 20: "python", 30: "python", 40: "etcd", 50: "sleep"}


def test_processes_are_named_after_their_service_and_role_inside_it():
    names = {pid: name_of(pid, PARENTS, COMMS, ARGVS) for pid in ARGVS}
    assert names == {
        10: "decode: worker process (gRPC, AsyncLLM)",
        11: "decode: vLLM EngineCore",
        12: "decode: vLLM model runner",
        20: "prefill: API server (vllm serve)",
        30: "Conductor",
        40: "etcd",
        50: "other: sleep",
    }


def test_a_window_is_the_cpu_between_a_levels_running_and_result_lines():
    samples = [(t, {1: t * 0.5, 2: t * 0.25, 3: 1.0}) for t in range(10)]
    marks = [(1.5, "[routers] conductor c=1: running ...\n"),
             (6.5, "[routers] conductor c=1: TTFT p50 1.0 ms, ...\n"),
             (7.0, "[routers] conductor c=4: running ...\n")]  # fmt: skip
    assert windows(samples, {1: "a", 2: "a", 3: "b"}, marks) == {"conductor c=1": {"wall_s": 4.0, "cpu_s": {"a": 3.0}}}


def test_a_process_that_retitles_itself_is_named_again():
    import os
    import subprocess
    import sys
    import time

    from bench.compare.cpu import Sampler

    code = "import sys, setproctitle; sys.stdin.readline(); setproctitle.setproctitle('VLLM::EngineCore'); input()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    try:
        sampler = Sampler(os.getpid())
        deadline = time.monotonic() + 10
        while child.pid not in sampler._sample():  # seen once started
            assert time.monotonic() < deadline
        assert not sampler.names[child.pid].startswith("other: VLLM")
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        while sampler.names[child.pid] != "other: VLLM::EngineCor":  # vLLM's own title, as /proc's comm cuts it
            assert time.monotonic() < deadline, sampler.names[child.pid]
            sampler._sample()
    finally:
        child.kill()
        child.wait()
