"""Multi-host faults with network namespaces: KV crosses a veth link, the link is cut mid-transfer.

Topology (names and subnets unique per run, from the pid; all removed in teardown)::

    root namespace = host A                       netns B = host B         netns C = host C
    hub address 10.X.0.1/32 on lo:
      etcd, kvmeta, Conductor, prefill-0 ── veth (10.X.1.1 <-> 10.X.1.2) ── decode-b
                                         └─ veth (10.X.2.1 <-> 10.X.2.2) ── decode-c

Each decode worker reaches the hub through its own link (its default route), so cutting one link
isolates one decode "host" and nothing else. The hub address sits on lo, not on either link, so it
stays up whichever link is cut. Every prompt's KV goes from prefill-0 through the Mooncake Transfer
Engine (TCP) over a veth link into a decode worker.

The links are throttled with ``tc tbf`` (root -> namespace, the KV direction) to a slow "network",
so that a long prompt's KV takes about a second and a half to cross: the test watches the link's
byte counter and cuts the link while the KV is visibly in flight. The cut is ``ip link set DEV
down`` on the namespace side: a cable pull, both directions dead, the root side left without
carrier (this kernel has neither ``sch_netem`` nor iptables, so no packet-loss or DROP rules).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from helpers import grpc_generate, reference_tokens, wait_registered

from cli.etcd_server import EmbeddedEtcd
from kvconductor.v1 import conductor_pb2
from services.common.net import free_port

PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
ROOT = Path(__file__).resolve().parents[2]
KV_TIMEOUT_S = 3.0
LINK_RATE = "32mbit"  # 4 MB/s: a 1,536-token prompt's 6 MiB of KV take about 1.5 s to cross
LONG_PROMPT = 1536
MAX_TOKENS = 12
# Shorter than the KV timeout: the cut worker leaves the Conductor's view (and its channel closes) before the
# write times out, the case where a release on the closed channel once escaped as INTERNAL.
LEASE_TTL_S = 2
CUT_AFTER_BYTES = 512 * 1024  # KV bytes seen on the link before the cut (the prompt has 6 MiB)
# A cut request must end (completed elsewhere, or failed) within this long after the cut: the KV write
# times out after kv_transfer_timeout_s; the rest is the retry (reserve, prefill from the prefix cache,
# KV over the other link). The release of the cut host's reservation runs in the background.
CUT_BOUND_S = KV_TIMEOUT_S + 10.0


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and veth pairs needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is missing"
    return None


if (_reason := _skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class Net:
    """This run's namespaces, veth pairs, hub address and throttles; `close` undoes all of it."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.tag = f"kv{pid}"  # interface names stay within 15 characters
        self.octet = 100 + pid % 150
        self.hub = f"10.{self.octet}.0.1"
        self.hosts: dict[str, dict[str, str]] = {}
        self._undo: list[tuple[str, ...]] = []

    def setup(self, *hosts: str) -> None:
        _sh("ip", "addr", "add", f"{self.hub}/32", "dev", "lo")
        self._undo.append(("ip", "addr", "del", f"{self.hub}/32", "dev", "lo"))
        for index, name in enumerate(hosts, start=1):
            ns, outer, inner = f"{self.tag}-{name}", f"{self.tag}{name}r", f"{self.tag}{name}n"
            gateway, address = f"10.{self.octet}.{index}.1", f"10.{self.octet}.{index}.2"
            _sh("ip", "netns", "add", ns)
            self._undo.append(("ip", "netns", "del", ns))
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self._undo.append(("ip", "link", "del", outer))
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "addr", "add", f"{gateway}/24", "dev", outer)
            _sh("ip", "link", "set", outer, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "-n", ns, "route", "add", "default", "via", gateway)
            _sh("tc", "qdisc", "add", "dev", outer, "root", "tbf", "rate", LINK_RATE, "burst", "64kb",
                "latency", "400ms")  # fmt: skip
            self.hosts[name] = {"ns": ns, "outer": outer, "inner": inner, "address": address}

    def tx_bytes(self, name: str) -> int:
        """Bytes sent from the root namespace into host ``name`` (the KV direction)."""
        return int(Path(f"/sys/class/net/{self.hosts[name]['outer']}/statistics/tx_bytes").read_text())

    def cut(self, name: str) -> None:
        h = self.hosts[name]
        _sh("ip", "-n", h["ns"], "link", "set", h["inner"], "down")

    def restore(self, name: str) -> None:
        h = self.hosts[name]
        _sh("ip", "-n", h["ns"], "link", "set", h["inner"], "up")
        # Taking the device down dropped its routes; the default route must come back with it.
        _sh("ip", "-n", h["ns"], "route", "replace", "default", "via", h["address"].rsplit(".", 1)[0] + ".1")

    def close(self) -> list[str]:
        errors = []
        for command in reversed(self._undo):
            result = _sh(*command, check=False)
            if result.returncode != 0 and "Cannot find device" not in result.stderr:
                errors.append(f"{' '.join(command)}: {result.stderr.strip()}")
        self._undo.clear()
        return errors


class Processes:
    """Processes this test started, stopped by pid (SIGTERM, wait, SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, instance_id: str, args: list[str], netns: str | None = None) -> None:
        command = [sys.executable, "-m", "cli.main", "serve", role, "--id", instance_id, *args]
        if netns is not None:
            command = ["ip", "netns", "exec", netns, *command]  # `ip netns exec` execs: the pid is the server's
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with (self.log_dir / f"{instance_id}.log").open("ab") as log:
            self.children[instance_id] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )

    def log(self, instance_id: str) -> str:
        return (self.log_dir / f"{instance_id}.log").read_text(errors="replace")

    def stop(self, instance_id: str, timeout: float = 15.0) -> None:
        process = self.children.pop(instance_id)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        for instance_id in reversed(list(self.children)):
            self.stop(instance_id)

    def check_alive(self) -> None:
        for instance_id, process in self.children.items():
            if process.poll() is not None:
                raise RuntimeError(f"{instance_id} exited ({process.returncode}):\n{self.log(instance_id)[-3000:]}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[SimpleNamespace]:
    """The three-host cluster; torn down (processes, etcd, namespaces, links, address) whatever happens."""
    scratch = tmp_path_factory.mktemp("netns")
    net = Net()
    processes = Processes(scratch)
    etcd: EmbeddedEtcd | None = None
    try:
        try:
            net.setup("b", "c")
        except RuntimeError as e:
            pytest.skip(f"cannot build the namespaces here: {e}")
        etcd = EmbeddedEtcd(run_dir=scratch / "etcd", host=net.hub)
        etcd.start()
        conductor = f"{net.hub}:{free_port()}"
        common = [
            "--config", "deploy/config.toml", "--set", f'model.path="{model_dir}"', "--set", 'model.name="tiny-llama"',
            "--set", f'cluster.etcd_endpoints=["{etcd.endpoint}"]',
            "--set", f'cluster.scheduler_endpoint="{conductor}"',
            "--set", f"cluster.lease_ttl_s={LEASE_TTL_S}", "--set", f"cluster.kv_transfer_timeout_s={KV_TIMEOUT_S:g}",
            "--set", "cluster.drain_grace_s=1", "--set", "prefill.kv_cache_memory_mb=64",
            "--set", "decode.kv_cache_memory_mb=64", "--set", "prefill.max_num_batched_tokens=256",
            "--set", "scheduler.reject_on_slo_violation=false",
            "--set", f'telemetry.trace_dir="{scratch / "traces"}"',
        ]  # fmt: skip

        def on(address: str) -> list[str]:
            return [*common, "--set", f'cluster.host="{address}"']

        processes.start("kvmeta", "kvmeta-0", on(net.hub))
        processes.start("conductor", "conductor-0", on(net.hub))
        processes.start("prefill", "prefill-0", on(net.hub))
        for name in ("b", "c"):
            processes.start("decode", f"decode-{name}", on(net.hosts[name]["address"]), net.hosts[name]["ns"])
        cluster = SimpleNamespace(conductor=conductor, manifest={"etcd": [etcd.endpoint], "cluster": "local"})
        deadline = time.monotonic() + 180
        for role, instance_id in [("kvmeta", "kvmeta-0"), ("conductor", "conductor-0"), ("prefill", "prefill-0"),
                                  ("decode", "decode-b"), ("decode", "decode-c")]:  # fmt: skip
            while True:
                processes.check_alive()
                try:
                    wait_registered(cluster, role, instance_id, timeout=2)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        yield SimpleNamespace(
            net=net, processes=processes, cluster=cluster, common=common, on=on, model_dir=model_dir, scratch=scratch
        )
    finally:
        processes.stop_all()
        if etcd is not None:
            etcd.close()
        errors = net.close()
        assert not errors, f"teardown left network state behind: {errors}"


def _prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def _generate(hosts: SimpleNamespace, prompt: list[int], request_id: str = "") -> tuple[list[int], str]:
    tokens, decision, _ = grpc_generate(hosts.cluster, prompt, PD, max_tokens=MAX_TOKENS, request_id=request_id)
    return tokens, decision.decode_instance


def test_kv_crosses_the_links_and_greedy_output_is_exact(hosts):
    prompts = _prompts(1, 4, 40, 300)
    expected = reference_tokens(hosts.model_dir, prompts, max_tokens=MAX_TOKENS)
    before = {name: hosts.net.tx_bytes(name) for name in hosts.net.hosts}
    served = set()
    for prompt, want in zip(prompts, expected, strict=True):
        tokens, decode = _generate(hosts, prompt)
        assert tokens == want
        served.add(decode)
    kv_bytes = sum(len(p) for p in prompts) * 4096  # 4 KiB of KV per token (tiny-llama, fp32)
    crossed = sum(hosts.net.tx_bytes(name) - before[name] for name in hosts.net.hosts)
    assert crossed >= kv_bytes, f"only {crossed} bytes crossed the links for {kv_bytes} bytes of KV"
    assert served <= {"decode-b", "decode-c"}


def _cut_mid_transfer(hosts: SimpleNamespace, prompt: list[int], request_id: str) -> SimpleNamespace:
    """Send a long prompt; cut the link that its KV is crossing once it is visibly crossing it."""
    result = SimpleNamespace(tokens=None, decode=None, error=None, ended=None)

    def run() -> None:
        try:
            result.tokens, result.decode = _generate(hosts, prompt, request_id)
        except grpc.RpcError as e:
            result.error = e
        finally:
            result.ended = time.monotonic()

    names = list(hosts.net.hosts)
    before = {name: hosts.net.tx_bytes(name) for name in names}
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    cut = None
    while cut is None and thread.is_alive() and time.monotonic() < deadline:
        for name in names:
            if hosts.net.tx_bytes(name) - before[name] >= CUT_AFTER_BYTES:
                hosts.net.cut(name)
                cut = name
                break
        time.sleep(0.01)
    assert cut is not None, "the KV never visibly crossed a link (the request ended, or never started, first)"
    result.cut, result.cut_at = cut, time.monotonic()
    result.sent_before_cut = hosts.net.tx_bytes(cut) - before[cut]
    thread.join(CUT_BOUND_S + 30)
    assert not thread.is_alive(), f"the request still hangs {CUT_BOUND_S + 30:.0f} s after the cut"
    return result


def test_link_cut_mid_transfer_resumes_on_the_reachable_decode_worker(hosts):
    prompt = _prompts(2, 1, LONG_PROMPT, LONG_PROMPT + 1)[0]
    expected = reference_tokens(hosts.model_dir, [prompt], max_tokens=MAX_TOKENS)[0]
    result = _cut_mid_transfer(hosts, prompt, "netns-cut-1")
    hosts.cut_host = result.cut
    elapsed = result.ended - result.cut_at
    assert result.sent_before_cut < len(prompt) * 4096, "the link was cut after the whole KV had crossed"
    assert result.error is None, f"request failed {elapsed:.1f} s after the cut: {result.error}"
    assert result.tokens == expected
    assert result.decode == f"decode-{'c' if result.cut == 'b' else 'b'}"
    assert elapsed < CUT_BOUND_S, f"the resumed request took {elapsed:.1f} s after the cut"
    log = hosts.processes.log("conductor-0")
    assert "KV transfer failed" in log and "netns-cut-1" in log
    print(f"cut decode-{result.cut} after {result.sent_before_cut} bytes; completed on {result.decode} "
          f"{elapsed:.1f} s after the cut")  # fmt: skip


def _cut_host(hosts: SimpleNamespace) -> str:
    cut = getattr(hosts, "cut_host", None)
    if cut is None:
        pytest.skip("needs the link cut by test_link_cut_mid_transfer_resumes_on_the_reachable_decode_worker")
    return str(cut)


def test_restored_link_serves_again(hosts):
    cut = _cut_host(hosts)
    other = "c" if cut == "b" else "b"
    hosts.net.restore(cut)
    wait_registered(hosts.cluster, "decode", f"decode-{cut}", timeout=30)
    # With the other decode host drained away, every request must cross the restored link.
    hosts.processes.stop(f"decode-{other}")
    wait_registered(hosts.cluster, "decode", f"decode-{other}", present=False, timeout=30)
    prompts = _prompts(3, 2, 40, 300)
    expected = reference_tokens(hosts.model_dir, prompts, max_tokens=MAX_TOKENS)
    deadline = time.monotonic() + LEASE_TTL_S + 10
    for prompt, want in zip(prompts, expected, strict=True):
        while True:
            try:
                tokens, decode = _generate(hosts, prompt)
                break
            except grpc.RpcError:  # the Conductor may still quarantine the restored host for a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert (tokens, decode) == (want, f"decode-{cut}")


def test_link_cut_with_no_other_decode_worker_fails_clearly_within_the_bound(hosts):
    cut = _cut_host(hosts)
    prompt = _prompts(4, 1, LONG_PROMPT, LONG_PROMPT + 1)[0]
    result = _cut_mid_transfer(hosts, prompt, "netns-cut-2")
    elapsed = result.ended - result.cut_at
    assert result.cut == cut
    assert result.error is not None, "the request completed although its only decode host was cut off"
    assert result.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "internal error" not in result.error.details()
    assert elapsed < CUT_BOUND_S, f"the failure came {elapsed:.1f} s after the cut"
    print(f"failed {elapsed:.1f} s after the cut: {result.error.code().name}: {result.error.details()}")
    with contextlib.suppress(Exception):
        hosts.net.restore(cut)
