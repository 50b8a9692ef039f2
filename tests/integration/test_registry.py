"""Registry against a real etcd: registration, clean and unclean exits, etcd restarts."""

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cli.etcd_server import EmbeddedEtcd
from services.common.instance_record import InstanceRecord
from services.common.registry import InstanceEvent, Registry, _parse_endpoint, connect

REPO_ROOT = Path(__file__).resolve().parents[2]


class Events:
    """Collects watch events and waits for a condition on them."""

    def __init__(self) -> None:
        self.events: list[InstanceEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: InstanceEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[InstanceEvent], bool], timeout: float) -> InstanceEvent:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(predicate(e) for e in self.events), timeout)
            if not ok:
                raise AssertionError(f"no matching event within {timeout} s; got {self.events}")
            return next(e for e in self.events if predicate(e))

    def clear(self) -> None:
        with self._cond:
            self.events.clear()


def is_put(instance_id: str) -> Callable[[InstanceEvent], bool]:
    return lambda e: e.kind == "put" and e.instance_id == instance_id


def is_delete(instance_id: str) -> Callable[[InstanceEvent], bool]:
    return lambda e: e.kind == "delete" and e.instance_id == instance_id


def test_register_watch_update_close(etcd: EmbeddedEtcd, cluster: str) -> None:
    owner = Registry(etcd.endpoint, cluster, ttl=3)
    observer = Registry(["127.0.0.1:1", etcd.endpoint], cluster)  # first endpoint is dead
    events = Events()
    try:
        observer.watch(events, roles=["kvmeta"])
        record = InstanceRecord("kvmeta", "m0", "127.0.0.1:5000")
        owner.register(record)
        event = events.wait_for(is_put("m0"), 5)
        assert (event.role, event.record) == ("kvmeta", record)
        assert observer.list("kvmeta") == {("kvmeta", "m0"): record}

        owner.update(replace(record, metrics_address="127.0.0.1:5001"))
        events.wait_for(lambda e: e.record is not None and e.record.metrics_address == "127.0.0.1:5001", 5)

        # Another role is filtered out of the watch; a value that is not a record is skipped.
        other = Registry(etcd.endpoint, cluster)
        other.register(InstanceRecord("conductor", "c0", "127.0.0.1:5002"))
        assert ("conductor", "c0") in observer.list()
        other.close()
        client = connect([_parse_endpoint(etcd.endpoint)], 2.0)
        client.put(f"{owner.prefix}prefill/broken", json.dumps({"role": "prefill", "instance_id": "broken"}))
        client.close()
        assert ("prefill", "broken") not in observer.list()

        t0 = time.monotonic()
        owner.close()
        assert time.monotonic() - t0 < 2
        assert observer.list() == {}  # the broken value is still there, and still not a record
        events.wait_for(is_delete("m0"), 2)
        assert all(e.role == "kvmeta" for e in events.events)
    finally:
        owner.close()
        observer.close()


def test_killed_owner_expires(etcd: EmbeddedEtcd, cluster: str) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from services.common.instance_record import InstanceRecord
        from services.common.registry import Registry
        registry = Registry({etcd.endpoint!r}, {cluster!r}, ttl=2)
        registry.register(InstanceRecord("kvmeta", "victim", "127.0.0.1:1"))
        print("registered", flush=True)
        time.sleep(60)
        """
    )
    observer = Registry(etcd.endpoint, cluster)
    events = Events()
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"registered"
        observer.watch(events)
        events.wait_for(is_put("victim"), 5)
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        events.wait_for(is_delete("victim"), 2 + 1.5)
        assert time.monotonic() - t0 < 2 + 1
        assert observer.list() == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        observer.close()


def test_survives_etcd_restart(cluster: str, tmp_path: Path) -> None:
    with EmbeddedEtcd(run_dir=tmp_path) as server:
        owner = Registry(server.endpoint, cluster, ttl=3)
        observer = Registry(server.endpoint, cluster)
        events = Events()
        try:
            record = InstanceRecord("kvmeta", "p1", "127.0.0.1:1")
            owner.register(record)
            observer.watch(events)
            events.wait_for(is_put("p1"), 5)

            server.kill()
            time.sleep(1.0)
            owner.update(replace(record, address="127.0.0.1:2"))  # published once etcd is back
            events.clear()
            server.start()
            events.wait_for(lambda e: is_put("p1")(e) and e.record == replace(record, address="127.0.0.1:2"), 8)
            assert observer.list() == {("kvmeta", "p1"): replace(record, address="127.0.0.1:2")}

            # The recovered registration is still a live lease: a clean close removes it.
            owner.close()
            events.wait_for(is_delete("p1"), 3)
        finally:
            owner.close()
            observer.close()


def test_reregisters_after_etcd_wipe(cluster: str, tmp_path: Path) -> None:
    """A new etcd (lost data) on the same port: the lease is gone, the owner registers anew."""
    first = EmbeddedEtcd(run_dir=tmp_path / "a")
    first.start()
    owner = Registry(first.endpoint, cluster, ttl=2)
    try:
        owner.register(InstanceRecord("conductor", "d9", "127.0.0.1:1"))
        first.close()
        with EmbeddedEtcd(first.client_port, first.peer_port, run_dir=tmp_path / "b") as second:
            observer = Registry(second.endpoint, cluster)
            events = Events()
            observer.watch(events)
            try:
                events.wait_for(is_put("d9"), 8)
            finally:
                observer.close()
            second.stop()
            t0 = time.monotonic()
            owner.close()  # etcd is down: revoke fails, but close() stays bounded
            assert time.monotonic() - t0 < 4
    finally:
        owner.close()
        first.close()
