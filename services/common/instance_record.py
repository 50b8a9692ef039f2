"""The record a live instance publishes in etcd: what others know of it without asking it.

Every process registers an ``InstanceRecord`` (role, id, gRPC and metrics addresses); an engine worker
registers a ``WorkerRecord``, which adds what the Conductor schedules on (the engine's shape and KV
layout, the learned cost models and the start-up profile) and what tools reach it by (the transfer
engine endpoint, the colocated worker's own OpenAI URL); the store service registers a ``StoreRecord``
(the Mooncake Store master's address). The JSON form is flat and stable; ``from_json`` names the missing
or malformed key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scheduler.cost_model import DecodeModel, PrefillModel

WORKER_ROLES = ("prefill", "decode", "colocated")


class RecordError(ValueError):
    """A registry value that is not a well-formed record."""


@dataclass(frozen=True)
class KVShape:
    """How one KV block is laid out (workers that exchange KV must agree on it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_block: int


@dataclass(frozen=True)
class CostModels:
    """The worker's current (refit) cost models and the start-up profile they began from."""

    prefill: PrefillModel
    decode: DecodeModel
    # the start-up profile alone: admission's reference for a request on an idle instance (None: not profiled)
    profile: tuple[PrefillModel, DecodeModel] | None = None

    def to_json(self) -> dict[str, Any]:
        """The record's ``cost_model`` object."""
        data: dict[str, Any] = {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}
        if self.profile is not None:
            data["profile"] = {"prefill": self.profile[0].to_dict(), "decode": self.profile[1].to_dict()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModels:
        """Inverse of ``to_json``."""
        profile = data.get("profile")
        return cls(
            PrefillModel.from_dict(data["prefill"]), DecodeModel.from_dict(data["decode"]),
            (PrefillModel.from_dict(profile["prefill"]), DecodeModel.from_dict(profile["decode"])) if profile else None,
        )  # fmt: skip


@dataclass(frozen=True)
class InstanceRecord:
    """Any registered process."""

    role: str
    instance_id: str
    address: str  # gRPC host:port
    metrics_address: str = ""  # host:port of its Prometheus /metrics ("" when off)

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored in etcd."""
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> InstanceRecord:
        """A ``WorkerRecord`` for an engine worker's value, an ``InstanceRecord`` for any other."""
        if not isinstance(data, dict):
            raise RecordError(f"an instance record is a JSON object, got {type(data).__name__}")
        try:
            if data.get("role") in WORKER_ROLES:
                return WorkerRecord.from_worker_json(data)
            if data.get("role") == "store":
                return StoreRecord(str(data["role"]), str(data["instance_id"]), str(data["address"]),
                                   str(data.get("metrics_address", "")), master_address=str(data["master_address"]),
                                   generation=int(data["generation"]))  # fmt: skip
            return InstanceRecord(str(data["role"]), str(data["instance_id"]), str(data["address"]),
                                  str(data.get("metrics_address", "")))  # fmt: skip
        except KeyError as e:
            raise RecordError(f"instance record without {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise RecordError(f"malformed instance record: {e}") from None


@dataclass(frozen=True, kw_only=True)
class WorkerRecord(InstanceRecord):
    """An engine worker (prefill, decode or colocated)."""

    kv_layout: KVShape
    cost_model: CostModels
    model: str = ""
    transfer_endpoint: str = ""  # the Mooncake transfer engine's host:port
    block_size: int = 0
    num_blocks: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    max_num_batched_tokens: int = 0
    max_concurrent_requests: int = 0
    openai_url: str = ""  # a colocated worker's own OpenAI endpoint ("" for others)
    engine: str = "builtin"  # [engine] backend: "builtin", "vllm" or "emulated"
    kv_bootstrap: str = ""  # a vLLM prefill worker's KV connector bootstrap server (http://host:port)
    kv_events_endpoint: str = ""  # its KV events in vLLM's ZMQ format ([engine] zmq_kv_events), tcp://host:port

    @property
    def moves_kv_itself(self) -> bool:
        """Whether its engine's own KV connector moves KV (vLLM's), instead of the worker's transfer engine."""
        return self.engine == "vllm"

    @property
    def exports_kv(self) -> bool:
        """Whether its cached blocks can be copied to a peer (and a peer's to it).

        The built-in pool (emulated too), or vLLM's through its KV connector (prefill workers only: the
        connector exports by running a request).
        """
        return not self.moves_kv_itself or bool(self.kv_bootstrap)

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored in etcd."""
        data = asdict(self)
        data["cost_model"] = self.cost_model.to_json()
        return data

    @classmethod
    def from_worker_json(cls, data: dict[str, Any]) -> WorkerRecord:
        """Inverse of ``to_json`` (KeyError names a missing key)."""
        return cls(
            role=str(data["role"]), instance_id=str(data["instance_id"]), address=str(data["address"]),
            metrics_address=str(data.get("metrics_address", "")), model=str(data["model"]),
            transfer_endpoint=str(data["transfer_endpoint"]), block_size=int(data["block_size"]),
            num_blocks=int(data["num_blocks"]), max_model_len=int(data["max_model_len"]),
            vocab_size=int(data["vocab_size"]), max_num_batched_tokens=int(data["max_num_batched_tokens"]),
            max_concurrent_requests=int(data["max_concurrent_requests"]), kv_layout=KVShape(**data["kv_layout"]),
            cost_model=CostModels.from_json(data["cost_model"]), openai_url=str(data.get("openai_url", "")),
            engine=str(data.get("engine", "builtin")), kv_bootstrap=str(data.get("kv_bootstrap", "")),
            kv_events_endpoint=str(data.get("kv_events_endpoint", "")),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StoreRecord(InstanceRecord):
    """The store service: where the Mooncake Store's master listens, and which start of it that is."""

    master_address: str  # host:port of mooncake_master's RPC
    generation: int = 1  # which start of the master (its wall-clock µs): a new one holds none of the objects put before
