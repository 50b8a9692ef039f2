"""Service registry on etcd: instances announce themselves under a lease, others watch.

One key per live instance, its value the JSON of its ``InstanceRecord``::

    /kvconductor/<cluster>/instances/<role>/<instance_id>  ->  {"role": ..., "address": ..., ...}

A key lives while its owner keeps the lease alive: `close()` revokes it (the key goes at
once), a crashed owner's key expires within `ttl`. The owner never gives up: while etcd is
unreachable or the lease is lost, a daemon thread retries with backoff and registers anew.
A watcher gets a "put" for every present key, then every change; when the stream breaks
it re-lists (a "delete" for each key that vanished meanwhile, a "put" for each present).

pyetcd behaviour this relies on (observed with etcd 3.5.1): when etcd dies, a watch
callback receives the grpc.RpcError (UNAVAILABLE) at once, no hang, no silent end. After
such an error a pyetcd client marks its endpoint failed for 300 s and raises ValueError
even once etcd is back, so reconnecting always means a fresh client. Refreshing an
unknown lease does not raise; it answers TTL 0.
"""

import builtins
import json
import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyetcd

from services.common.instance_record import InstanceRecord, RecordError

_log = logging.getLogger(__name__)

InstanceKey = tuple[str, str]

# Pings detect a hung (not dead) etcd; etcd refuses pings more often than every 5 s.
_GRPC_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]


@dataclass(frozen=True)
class InstanceEvent:
    """One change of the registry as seen by a watcher."""

    kind: Literal["put", "delete"]
    role: str
    instance_id: str
    record: InstanceRecord | None


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be 'host:port', got {endpoint!r}")
    return host, int(port)


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"{kind} must be non-empty and contain no '/', got {name!r}")


def _backoff(failures: int, cap: float) -> float:
    return cap if failures == 0 else float(min(cap, 0.1 * 2**failures))


def _decode(
    prefix: str, kvs: Sequence[Any], roles: Collection[str] | None = None
) -> dict[InstanceKey, InstanceRecord | None]:
    """Map the registry keys among `kvs` to their records (None for a delete), skipping foreign and bad keys."""
    records: dict[InstanceKey, InstanceRecord | None] = {}
    for kv in kvs:
        parts = kv.key.decode()[len(prefix) :].split("/")
        if len(parts) != 2 or (roles is not None and parts[0] not in roles):
            continue
        if not kv.value:  # a delete
            records[(parts[0], parts[1])] = None
            continue
        try:
            records[(parts[0], parts[1])] = InstanceRecord.from_json(json.loads(kv.value))
        except (ValueError, RecordError) as e:
            _log.warning("registry: ignoring %s, its value is not an instance record (%s)", kv.key.decode(), e)
    return records


@dataclass(frozen=True)
class EtcdAuth:
    """TLS files and credentials for an etcd that asks for them (all optional)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = None

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `pyetcd.client`."""
        return {"ca_cert": self.ca_file, "cert_cert": self.cert_file, "cert_key": self.key_file,
                "user": self.user, "password": self.password}  # fmt: skip


def connect(endpoints: Sequence[tuple[str, int]], timeout: float, auth: EtcdAuth | None = None) -> Any:
    """Return a pyetcd client on the first endpoint that answers a read within `timeout`."""
    errors = []
    credentials = auth.client_kwargs() if auth is not None else {}
    for host, port in endpoints:
        client = pyetcd.client(host, port, timeout=timeout, grpc_options=_GRPC_OPTIONS, **credentials)
        try:
            client.get_response("/kvconductor/")
            return client
        except Exception as exc:  # pyetcd raises grpc, pyetcd and ValueError types alike
            client.close()
            errors.append(f"{host}:{port}: {exc!r}")
    raise ConnectionError("no etcd endpoint reachable: " + "; ".join(errors))


class RegistryWatch:
    """A running watch over a cluster's instances; see `Registry.watch`."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str,
        callback: Callable[[InstanceEvent], None],
        roles: Collection[str] | None,
        timeout: float,
        auth: EtcdAuth | None = None,
    ) -> None:
        self._endpoints = endpoints
        self._auth = auth
        self._prefix = prefix
        self._callback = callback
        self._roles = set(roles) if roles is not None else None
        self._timeout = timeout
        self._known: dict[InstanceKey, InstanceRecord] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; the callback is not called after this returns."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                client = connect(self._endpoints, self._timeout, self._auth)
                failures = 0
                try:
                    self._follow(client)
                finally:
                    client.close()
            except Exception as exc:  # any failure means: reconnect, re-list, re-watch
                _log.log(logging.WARNING if failures == 0 else logging.DEBUG, "registry watch: %r", exc)
            failures += 1
            self._stop.wait(_backoff(failures, 2.0))

    def _follow(self, client: Any) -> None:
        """List, then apply the watch stream from the listed revision until it breaks."""
        listing = client.get_prefix_response(self._prefix)
        self._resync(listing.kvs)
        responses: queue.Queue[Any] = queue.Queue()
        client.add_watch_prefix_callback(self._prefix, responses.put, start_revision=listing.header.revision + 1)
        while not self._stop.is_set():
            try:
                response = responses.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(response, BaseException):
                raise ConnectionError(f"etcd watch stream ended: {type(response).__name__}")
            for event in response.events:
                for key, record in _decode(self._prefix, [event], self._roles).items():
                    if isinstance(event, pyetcd.events.DeleteEvent):
                        self._known.pop(key, None)
                        self._emit(InstanceEvent("delete", *key, None))
                    elif record is not None:
                        self._known[key] = record
                        self._emit(InstanceEvent("put", *key, record))

    def _resync(self, kvs: Sequence[Any]) -> None:
        present = {k: r for k, r in _decode(self._prefix, kvs, self._roles).items() if r is not None}
        for role, instance_id in set(self._known) - set(present):
            self._emit(InstanceEvent("delete", role, instance_id, None))
        self._known = present
        for (role, instance_id), record in present.items():
            self._emit(InstanceEvent("put", role, instance_id, record))

    def _emit(self, event: InstanceEvent) -> None:
        if self._stop.is_set():
            return
        try:
            self._callback(event)
        except Exception:  # a faulty callback must not end the watch
            _log.exception("registry watch callback failed on %s", event)


class Registry:
    """Registers at most one instance under a lease and watches/lists a cluster's instances."""

    def __init__(
        self, endpoints: str | Sequence[str], cluster: str, ttl: int = 3, auth: EtcdAuth | None = None
    ) -> None:
        names = [endpoints] if isinstance(endpoints, str) else builtins.list(endpoints)
        if not names:
            raise ValueError("Registry needs at least one etcd endpoint")
        _check_name("cluster", cluster)
        if ttl < 2:
            raise ValueError(f"ttl must be at least 2 s (etcd's minimum lease TTL), got {ttl}")
        self._endpoints = [_parse_endpoint(name) for name in names]
        self._auth = auth
        self.prefix = f"/kvconductor/{cluster}/instances/"
        self.ttl = ttl
        self._rpc_timeout = max(1.0, ttl / 3)
        self._lock = threading.Lock()
        self._client: Any = None
        self._lease_id: int | None = None
        self._key: str | None = None
        self._record: InstanceRecord | None = None
        self._dirty = False
        self._failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watches: builtins.list[RegistryWatch] = []

    def register(self, record: InstanceRecord) -> None:
        """Publish `record` under a lease and keep it alive from a daemon thread.

        Does not raise when etcd is unreachable: the keep-alive thread retries until
        etcd answers. Raises RuntimeError if this registry already registered.
        """
        _check_name("role", record.role)
        _check_name("instance_id", record.instance_id)
        if self._key is not None:
            raise RuntimeError(f"this Registry already registered {self._key}")
        self._key = f"{self.prefix}{record.role}/{record.instance_id}"
        self._record = record
        self._try_sync()
        self._thread = threading.Thread(target=self._keepalive_loop, name="registry-lease", daemon=True)
        self._thread.start()

    def update(self, record: InstanceRecord) -> None:
        """Replace the published record (under the current lease; retried if etcd is down)."""
        if self._key is None:
            raise RuntimeError("update() before register()")
        with self._lock:
            self._record = record
            self._dirty = True
        self._try_sync()

    def close(self) -> None:
        """Stop keep-alive and watches, and revoke the lease so the key goes at once.

        Bounded in time when etcd is down (one connection attempt, one revoke call).
        """
        self._stop.set()
        for watch in self._watches:
            watch.stop()
        if self._thread is not None:
            self._thread.join(2 * self._rpc_timeout + 1)
        with self._lock:
            try:
                if self._lease_id is not None:
                    self._client = self._client or connect(self._endpoints, self._rpc_timeout, self._auth)
                    self._client.revoke_lease(self._lease_id)
            except Exception as exc:  # etcd down: the lease expires on its own after ttl
                _log.warning("registry: could not revoke lease of %s: %r", self._key, exc)
            finally:
                self._drop_client()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def watch(self, callback: Callable[[InstanceEvent], None], roles: Collection[str] | None = None) -> RegistryWatch:
        """Call `callback` for every present instance, then for every change, from a thread.

        `roles` restricts the events to those roles. Stop with the returned handle's stop().
        """
        handle = RegistryWatch(self._endpoints, self.prefix, callback, roles, self._rpc_timeout, self._auth)
        self._watches.append(handle)
        return handle

    def list(self, role: str | None = None) -> dict[InstanceKey, InstanceRecord]:
        """Return {(role, instance_id): record} of the instances registered now; ConnectionError if etcd fails."""
        prefix = self.prefix if role is None else f"{self.prefix}{role}/"
        client = connect(self._endpoints, self._rpc_timeout, self._auth)
        try:
            kvs = client.get_prefix_response(prefix).kvs
        except Exception as exc:  # pyetcd raises grpc, pyetcd and ValueError types alike
            raise ConnectionError(f"etcd read of {prefix} failed: {exc!r}") from exc
        finally:
            client.close()
        return {k: r for k, r in _decode(self.prefix, kvs).items() if r is not None}

    def _keepalive_loop(self) -> None:
        # Refresh three times per TTL; after a failure retry sooner, backing off up to that.
        while not self._stop.wait(_backoff(self._failures, self.ttl / 3)):
            self._try_sync()

    def _try_sync(self) -> None:
        """Refresh the lease (re-registering if it is gone) and publish a changed record."""
        with self._lock:
            if self._stop.is_set():
                return
            try:
                self._sync()
                self._failures = 0
            except Exception as exc:  # any failure: new client and lease check on the next try
                level = logging.WARNING if self._failures == 0 else logging.DEBUG
                _log.log(level, "registry: etcd unavailable for %s (%r); retrying", self._key, exc)
                self._failures += 1
                self._drop_client()

    def _sync(self) -> None:
        if self._client is None:
            self._client = connect(self._endpoints, self._rpc_timeout, self._auth)
        if self._lease_id is not None:
            answers = builtins.list(self._client.refresh_lease(self._lease_id))
            if not answers or answers[0].TTL <= 0:
                _log.warning("registry: lease of %s lost; registering again", self._key)
                self._lease_id = None
        if self._lease_id is None:
            self._lease_id = self._client.lease(self.ttl).id
            self._dirty = True
        if self._dirty and self._record is not None:
            self._client.put(self._key, json.dumps(self._record.to_json()), lease=self._lease_id)
            self._dirty = False

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
