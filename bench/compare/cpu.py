"""Where the CPU goes during a benchmark: every process's CPU seconds over each level of its run.

    python -m bench.compare.cpu --out DIR -- kvconductor bench compare --engine vllm --routers ...

runs the command, reads ``utime + stime`` of each of its descendant processes from ``/proc`` once a
second, and splits the samples into windows at the command's progress lines: a window opens at
``[routers] LABEL LEVEL: running`` and closes at the next ``[routers] LABEL LEVEL:`` result line. Each
process is named after the service it belongs to (the nearest ancestor that is ``cli.main serve ROLE``,
a stock ``bench.compare.vllm_server --role ROLE`` or etcd) and what it is inside it (the service process
itself, or vLLM's EngineCore and model runner children). ``DIR/cpu.json`` holds, per window, its wall time
and the CPU seconds per process name. The command's own output passes through unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.provenance import git_state

TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 1.0
STARTS = re.compile(r"^\[routers\] (\S+) (.+?): running")
ENDS = re.compile(r"^\[routers\] (\S+) (.+?): TTFT")
WORKER_ROLES = ("prefill", "decode", "colocated")


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, CPU ticks, comm) of one process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), comm


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def service_of(argv: list[str]) -> str | None:
    """The service a command line starts: ``prefill``, ``conductor``, ``etcd``, ... or None."""
    if "cli.main" in argv and "serve" in argv:
        i = argv.index("serve")
        return argv[i + 1] if i + 1 < len(argv) else None
    if "bench.compare.vllm_server" in argv and "--role" in argv:
        return argv[argv.index("--role") + 1]
    if argv and Path(argv[0]).name == "etcd":
        return "etcd"
    return None


def name_of(pid: int, parents: dict[int, int], comms: dict[int, str], argvs: dict[int, list[str]]) -> str:
    """``decode: vLLM model runner``, ``Conductor``, ``prefill: API server (vllm serve)``, ..."""
    own, node = pid, pid
    while node in parents:
        service = service_of(argvs.get(node, []))
        if service is not None:
            break
        node = parents[node]
    else:
        return f"other: {comms.get(own, '?')}"
    if service not in WORKER_ROLES:
        return {"conductor": "Conductor"}.get(service, service)
    if own != node:
        engine_core = "EngineCor" in comms.get(own, "")  # comm is cut at 15 characters
        kind = "vLLM EngineCore" if engine_core else "vLLM model runner"
        return f"{service}: {kind}"
    stock = "bench.compare.vllm_server" in argvs.get(node, [])
    return f"{service}: {'API server (vllm serve)' if stock else 'worker process (gRPC, AsyncLLM)'}"


class Sampler:
    """CPU seconds of every descendant of one process, once a second, on a thread; ``names`` holds each
    process's latest name (vLLM's processes retitle themselves after they start: ``VLLM::EngineCore``)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.names: dict[int, str] = {}
        self._named: dict[int, str] = {}  # pid -> the comm it was named with
        self._argvs: dict[int, list[str]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[int, float]:
        stats = {pid: s for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if (s := _stat(pid))}
        parents = {pid: s[0] for pid, s in stats.items()}
        comms = {pid: s[2] for pid, s in stats.items()}
        mine = {self.root}
        for pid in stats:
            node = pid
            while node in parents and node not in mine and node > 1:
                node = parents[node]
            if node in mine:
                mine.add(pid)
        below = {p: q for p, q in parents.items() if p in mine and p != self.root}
        for pid in mine - {self.root}:
            if self._named.get(pid) != comms[pid]:
                chain = pid
                while chain in below:
                    if chain not in self._argvs or chain == pid:
                        self._argvs[chain] = _cmdline(chain)
                    chain = below[chain]
                self.names[pid], self._named[pid] = name_of(pid, below, comms, self._argvs), comms[pid]
        return {pid: stats[pid][1] / TICKS for pid in mine - {self.root}}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._sample()))
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def windows(
    samples: list[tuple[float, dict[int, float]]], names: dict[int, str], marks: list[tuple[float, str]]
) -> dict[str, Any]:
    """Each level's CPU seconds per process name, from the first to the last sample inside it."""
    opened: dict[str, float] = {}
    out: dict[str, Any] = {}
    for t, line in marks:
        if m := STARTS.match(line):
            opened[f"{m[1]} {m[2]}"] = t
        elif (m := ENDS.match(line)) and (key := f"{m[1]} {m[2]}") in opened:
            inside = [s for s in samples if opened[key] <= s[0] <= t]
            if len(inside) < 2:
                continue
            (t0, first), (t1, last) = inside[0], inside[-1]
            cpu: dict[str, float] = defaultdict(float)
            for pid, seconds in last.items():
                cpu[names[pid]] += seconds - first.get(pid, 0.0)
            ranked = sorted(((k, round(v, 2)) for k, v in cpu.items() if v >= 0.005), key=lambda kv: -kv[1])
            out[key] = {"wall_s": round(t1 - t0, 1), "cpu_s": dict(ranked)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare.cpu", description=__doc__.split("\n\n")[0],
                                     epilog="Example: python -m bench.compare.cpu --out bench/results/compare/vllm -- "
                                            "kvconductor bench compare --engine vllm --routers")  # fmt: skip
    parser.add_argument("--out", required=True, help="folder for cpu.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --")
    code = git_state()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1)
    sampler = Sampler(process.pid)
    sampler.thread.start()
    marks: list[tuple[float, str]] = []
    assert process.stderr is not None
    for line in process.stderr:
        marks.append((time.monotonic(), line))
        sys.stderr.write(line)
    rc = process.wait()
    sampler.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "code": code,
        "command": shlex.join(["python", "-m", "bench.compare.cpu", "--out", args.out, "--", *command]),
        "method": "utime+stime of every descendant process from /proc/PID/stat, sampled once a second; each window "
                  "runs from the first to the last sample inside one level (from its 'running' progress line to "
                  "its result line)",
        "windows": windows(sampler.samples, sampler.names, marks),
    }  # fmt: skip
    (out / "cpu.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"[cpu] {len(record['windows'])} windows -> {out / 'cpu.json'}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
