"""A request as the Conductor runs it, and the failures that make it resume elsewhere.

A ``Job`` is one validated request across its attempts: an attempt prefills the prompt plus the tokens
already streamed (``tokens``) with what is left of ``max_tokens``. Calls to a worker run under
``blame(instance_id)``: an error that another worker may not have (it died, drained, lost its link)
becomes a ``WorkerFailure`` of that instance, which the Conductor answers with a new attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import common_pb2
from scheduler.policy import Plan
from services.conductor.decisions import DecisionRecord


@dataclass
class Job:
    """A validated request.

    ``request_id`` is the Conductor's own id (unique: every worker RPC, booking and ledger entry is keyed by it);
    ``label`` is the client's id for it, shown in logs, traces, responses and explain, never used as a key.
    """

    request_id: str
    prompt: Sequence[int]  # a list, or the request's repeated field (read into no list: bench/conductor/serve.py)
    sampling: common_pb2.SamplingParams
    stop: list[str]
    block_hashes: list[bytes] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    path: str = ""  # "disaggregated" or "colocated"
    plan: Plan | None = None
    decision: DecisionRecord | None = None
    generated: list[int] = field(default_factory=list)  # tokens streamed so far (a resumed attempt continues them)
    failed: set[str] = field(default_factory=set)  # instances that failed this request
    attempt: int = 1  # the current attempt, from 1
    phase: str = ""  # what the current attempt waits for: "prefill", "decode" or "colocated" (watchdog, metrics)
    worker_ttft: float | None = None  # seconds the prefill worker reported for token 0 (queue included)
    deferred_s: float = 0.0  # seconds it waited to be planned again (``Rejection.retry_in``), in its TTFT
    label: str = ""  # the client's request id ("" = none given)
    _resumed_hashes: tuple[int, list[bytes]] = (0, [])  # (tokens generated, hashes of prompt + them) last computed

    @property
    def tokens(self) -> Sequence[int]:
        """What the current attempt prefills: the prompt, plus the tokens already streamed."""
        return [*self.prompt, *self.generated] if self.generated else self.prompt

    @property
    def name(self) -> str:
        """How logs name the request: the client's label with the Conductor's id."""
        return f"{self.label} [{self.request_id}]" if self.label else self.request_id

    @property
    def client_id(self) -> str:
        """The id the client sees in responses: its own label, else the Conductor's id."""
        return self.label or self.request_id

    @property
    def worker_request_id(self) -> str:
        """The id workers know this attempt by: the request id, then ``<id>.<attempt>`` for a resumed one.

        A resumed attempt may land on a worker the previous one used (the decode worker of a stalled
        prefill, a stalled worker that moved again) while that attempt's reservation or request is still
        being released there; distinct ids keep the two apart.
        """
        return self.request_id if self.attempt <= 1 else f"{self.request_id}.{self.attempt}"

    @property
    def fixed_length(self) -> bool:
        """Nothing but ``max_tokens`` can end it: ``ignore_eos``, no stop token ids, no stop strings."""
        return self.sampling.ignore_eos and not self.sampling.stop_token_ids and not self.stop

    @property
    def attempt_sampling(self) -> common_pb2.SamplingParams:
        """The sampling parameters of the current attempt (max_tokens less what was streamed)."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens -= len(self.generated)
        return sampling

    def attempt_hashes(self, block_size: int) -> list[bytes]:
        """Chained block hashes of ``tokens``."""
        if not self.generated:
            return self.block_hashes
        if self._resumed_hashes[0] != len(self.generated):  # a resumed attempt: once for its match, decision, booking
            self._resumed_hashes = (len(self.generated), prefix_block_hashes(self.tokens, block_size))
        return self._resumed_hashes[1]


class WorkerFailure(Exception):
    """A worker failed a request in a way another worker may not (it died, drained, or its link broke).

    ``stalled``: the worker made no progress within the watchdog's bound (it may be alive but frozen).
    """

    def __init__(self, instance_id: str, cause: grpc.aio.AioRpcError, stalled: bool = False) -> None:
        super().__init__(f"{instance_id}: {cause.code().name}: {cause.details()}")
        self.instance_id = instance_id
        self.cause = cause
        self.stalled = stalled

    @classmethod
    def stall(cls, instance_id: str, phase: str, seconds: float) -> WorkerFailure:
        """No progress of ``phase`` on ``instance_id`` for ``seconds``."""
        details = f"no {phase} progress for {seconds:.1f} s (watchdog)"
        cause = grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )
        return cls(instance_id, cause, stalled=True)


RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
     grpc.StatusCode.DEADLINE_EXCEEDED}
)  # fmt: skip


@contextlib.contextmanager
def blame(instance_id: str) -> Iterator[None]:
    """Turn a retryable error of a call to ``instance_id`` into a WorkerFailure of that instance.

    A call cancelled under us (its channel closed) surfaces as CancelledError although this task is not
    being cancelled: that too is the instance's failure, not the client's departure.
    """
    try:
        yield
    except grpc.aio.AioRpcError as e:
        if e.code() in RETRYABLE:
            raise WorkerFailure(instance_id, e) from e
        raise
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        cause = grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "call cancelled"
        )
        raise WorkerFailure(instance_id, cause) from e


@dataclass
class Piece:
    """Tokens from a worker, with what the first one knows about the request."""

    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    cached_tokens: int = 0
