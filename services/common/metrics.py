"""Prometheus metrics of every process (text format on ``/metrics``); docs/observability.md lists them.

The series live in the default registry of each process: the Conductor's request series, the workers'
KV-transfer series and a collector that reads the engine's live load at scrape time, the gateway's HTTP
series. gRPC processes serve ``/metrics`` on their own port (published in their etcd record), with
``/health`` beside it, for probes that cannot speak the gRPC health service over mutual TLS (a Kubernetes
kubelet): HTTPS when the cluster runs TLS, where only ``/metrics`` asks for a cluster certificate. The
gateway serves both beside the REST API (``/metrics`` behind its API keys).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

HANDSHAKE_TIMEOUT_S = 10.0  # a metrics connection that has not sent its request by then is dropped
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# The Conductor: per request.
REQUESTS = Counter("kvconductor_requests", "Requests by serving path and outcome", ["path", "outcome"])
RETRIES = Counter("kvconductor_retries", "Requests resumed on another worker after a worker failed", ["path"])
REJECTIONS = Counter("kvconductor_rejections", "SLO and capacity rejections by reason", ["reason"])
DEFERRALS = Counter(
    "kvconductor_deferrals",
    "Colocated prompts that would have pushed a decoding request past the TBT SLO, planned again when room was due",
)
TTFT = Histogram("kvconductor_ttft_seconds", "Time to first token at the Conductor", ["path"], buckets=LATENCY_BUCKETS)
TBT = Histogram("kvconductor_tbt_seconds", "Mean time between tokens of a request", ["path"], buckets=GAP_BUCKETS)
ITL = Histogram("kvconductor_itl_seconds", "Gaps between consecutive token messages", ["path"], buckets=GAP_BUCKETS)
E2E = Histogram("kvconductor_e2e_seconds", "Request latency, arrival to last token", ["path"], buckets=LATENCY_BUCKETS)
PROBES = Counter(
    "kvconductor_admission_probes",
    "Requests admitted on idle instances although the learned models predicted an SLO miss (they re-calibrate)",
)
CONDITIONAL_PATHS = Counter(
    "kvconductor_conditional_paths",
    "Conditional disaggregation: requests planned to prefill on their decode instance (local) or on a prefill "
    "instance (remote)",
    ["path"],
)
STALLS = Counter(
    "kvconductor_stalls", "Requests abandoned on a worker that made no progress (by phase)", ["phase", "instance"]
)
# The Conductor's own time per request before the worker is called: "tokenize" (text prompts, on a thread),
# "hash" (chained block hashes), "match" (on the replica of kvmeta's index), "decide" (Algorithm 1), "book".
STAGE = Histogram(
    "kvconductor_conductor_stage_seconds", "The Conductor's own time per request, by stage", ["stage"],
    buckets=STAGE_BUCKETS,
)  # fmt: skip
KV_INDEX_FOLLOWING = Gauge(
    "kvconductor_kv_index_following", "1 while the Conductor follows a kvmeta's index (0: no prefix matches soon)"
)
KV_INDEX_SNAPSHOTS = Counter(
    "kvconductor_kv_index_snapshots", "Snapshots of kvmeta's index the Conductor took (at start, then per lost stream)"
)
PROMPT_TOKENS = Counter("kvconductor_prompt_tokens", "Prompt tokens of admitted requests")
CACHED_TOKENS = Counter("kvconductor_cached_prompt_tokens", "Prompt tokens whose KV was reused (prefix cache or copy)")
PREDICTION_ERROR = Histogram(
    "kvconductor_prediction_relative_error",
    "Cost-model error |predicted - actual| / actual",
    ["metric"],
    buckets=ERROR_BUCKETS,
)

# Workers: a decode worker's token 0 that differs from its prefill worker's (vLLM, where decode samples it again):
# the attempt fails and the request resumes elsewhere.
DIVERGENCES = Counter("kvconductor_decode_divergences", "Decode attempts whose token 0 differed from prefill's")
ENGINE_ERRORS = Counter("kvconductor_engine_errors", "Requests the engine ended with an error (vLLM: KV not loaded)")

# Workers: KV movement through the transfer engine (the byte counts are read from it at scrape time).
KV_SECONDS = Histogram("kvconductor_kv_transfer_seconds", "Duration of one KV transfer", ["kind"], buckets=GAP_BUCKETS)
KV_GBPS = Histogram(
    "kvconductor_kv_transfer_gbps",
    "Bandwidth of one KV transfer, GB/s",
    ["kind"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10),
)

# The gateway.
HTTP_REQUESTS = Counter("kvconductor_http_requests", "REST requests by route and status", ["route", "status"])


def observe_transfer(kind: str, num_bytes: int, seconds: float) -> None:
    """Time one KV transfer (kind: send / copy / store_put)."""
    KV_SECONDS.labels(kind).observe(seconds)
    if seconds > 0:
        KV_GBPS.labels(kind).observe(num_bytes / seconds / 1e9)


class EngineSnapshot(Protocol):
    """An engine's load as the collector reads it (a worker's ``EngineLoad``)."""

    @property
    def num_waiting(self) -> int: ...  # noqa: D102
    @property
    def num_running(self) -> int: ...  # noqa: D102
    @property
    def num_free_blocks(self) -> int: ...  # noqa: D102
    @property
    def num_total_blocks(self) -> int: ...  # noqa: D102
    @property
    def prefix_cache_query_tokens(self) -> int: ...  # noqa: D102
    @property
    def prefix_cache_hit_tokens(self) -> int: ...  # noqa: D102


class EngineCollector(Collector):
    """The engine's load and prefix-cache counters, read at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """One snapshot."""
        stats = self.snapshot()
        free, total = stats.num_free_blocks, stats.num_total_blocks
        queue = GaugeMetricFamily("kvconductor_queue_length", "Requests in the engine by state", labels=["state"])
        queue.add_metric(["waiting"], stats.num_waiting)
        queue.add_metric(["running"], stats.num_running)
        blocks = GaugeMetricFamily("kvconductor_kv_blocks", "KV blocks by state", labels=["state"])
        blocks.add_metric(["free"], free)
        blocks.add_metric(["used"], total - free)
        queried = CounterMetricFamily("kvconductor_prefix_cache_query_tokens", "Prompt tokens looked up")
        queried.add_metric([], stats.prefix_cache_query_tokens)
        hits = CounterMetricFamily("kvconductor_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        hits.add_metric([], stats.prefix_cache_hit_tokens)
        yield from (queue, blocks, queried, hits)


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], serving: Callable[[], bool], tls: ssl.SSLContext | None) -> None:
        super().__init__(address, _Handler)
        self.serving = serving
        self.tls = tls

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept; with TLS the handshake waits for the request's own thread (a slow client stalls no other)."""
        conn, peer = super().get_request()
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, peer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed handshake or a client gone mid-request is the client's affair: no traceback."""


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsServer
    timeout = HANDSHAKE_TIMEOUT_S

    def setup(self) -> None:
        """The TLS handshake, bounded, on this request's thread."""
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def do_GET(self) -> None:  # noqa: N802
        """``/health``: 200 while the process's gRPC health status is SERVING, else 503; any other path: metrics.

        With TLS the metrics need a client certificate the cluster's CA signed (a Prometheus scrape config's
        ``tls_config``); ``/health`` says only serving or not, to anyone (the kubelet's probes carry none).
        """
        if self.path.split("?", 1)[0] == "/health":
            serving = self.server.serving()
            code, kind = (200 if serving else 503), "application/json"
            body = b'{"status": "serving"}' if serving else b'{"status": "not serving"}'
        elif isinstance(self.connection, ssl.SSLSocket) and not self.connection.getpeercert():
            code, kind = 401, "application/json"
            body = b'{"error": "metrics need a client certificate signed by the cluster CA"}'
        else:
            code, kind, body = 200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY)
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        """Scrapes and probes are not worth a log line."""


def serve_metrics(
    host: str, port: int, serving: Callable[[], bool] = lambda: True, tls: ssl.SSLContext | None = None
) -> str:
    """Serve ``/metrics`` and ``/health`` (``serving()``) from a background thread; returns "host:port".

    With ``tls`` the port speaks HTTPS and ``/metrics`` needs a client certificate the context's CA signed.
    """
    server = _MetricsServer((host, port), serving, tls)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return f"{host}:{server.server_port}"


def register_engine(snapshot: Callable[[], EngineSnapshot]) -> None:
    """Expose an engine's live load (``snapshot`` is called from the scrape thread)."""
    REGISTRY.register(EngineCollector(snapshot))


class TransferCounts(Protocol):
    """What a transfer engine counts (``services.worker.kv.transfer.TransferCounts``)."""

    retries: int

    def by_direction(self) -> dict[str, int]:
        """Bytes by direction: sent, copied_in, received."""


class TransferCollector(Collector):
    """KV bytes by direction (sent, copied_in, received) and refused transfers tried again, from the engine's counts."""

    def __init__(self, counts: Callable[[], TransferCounts]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        """One reading."""
        counts = self.counts()
        moved = CounterMetricFamily(
            "kvconductor_kv_transfer_bytes", "KV bytes moved by the transfer engine", labels=["direction"]
        )
        for direction, num_bytes in counts.by_direction().items():
            moved.add_metric([direction], num_bytes)
        yield moved
        yield CounterMetricFamily(
            "kvconductor_kv_transfer_retries",
            "Transfers the engine refused (a full TCP lane queue, a peer gone) and that were tried again",
            value=counts.retries,
        )


def register_transfer(counts: Callable[[], TransferCounts]) -> None:
    """Expose a transfer engine's counts (called from the scrape thread)."""
    REGISTRY.register(TransferCollector(counts))
