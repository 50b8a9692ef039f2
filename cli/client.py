"""A small typed Python client of the Conductor's gRPC API, and ``kvconductor generate --cluster``.

    from cli.client import ConductorClient
    with ConductorClient("127.0.0.1:8998") as client:
        for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        result = client.complete([1, 2, 3], max_tokens=8, include_decision=True)
        print(result.token_ids, result.usage.cached_tokens, result.decision.prefill_instance)

Errors arrive as ``grpc.RpcError`` with the status the Conductor set (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED with the rejection reason, UNAVAILABLE).

Given several Conductor replicas (``ConductorClient(["host1:8998", "host2:8998"])``) the client spreads
requests over them round-robin, and a stream whose Conductor fails goes on at the next one without a gap or
a repeat (``services/common/failover.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from services.common.config import Config
from services.common.failover import FAILOVER, failover_request
from services.common.rpc import sync_channel

DEPLOYMENTS = {
    "auto": conductor_pb2.DEPLOYMENT_AUTO,
    "disaggregated": conductor_pb2.DEPLOYMENT_DISAGGREGATED,
    "colocated": conductor_pb2.DEPLOYMENT_COLOCATED,
    "conditional": conductor_pb2.DEPLOYMENT_CONDITIONAL,
}
FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass
class Completion:
    """A whole response."""

    request_id: str = ""  # the label sent (or, without one, the Conductor's id)
    conductor_request_id: str = ""  # the Conductor's own id of the request (after a failover: the last one's)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: conductor_pb2.Usage = field(default_factory=conductor_pb2.Usage)
    decision: conductor_pb2.Decision | None = None


class ConductorClient:
    """Synchronous client of ``kvconductor.v1.Conductor``."""

    def __init__(self, address: str | Sequence[str], timeout_s: float = 600.0, api_key: str | None = None) -> None:
        """Channels to ``address``: one Conductor, or several replicas.

        ``api_key``: sent as ``authorization: Bearer KEY`` (None: ``KVCONDUCTOR_API_KEY`` or the config's first).
        """
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("ConductorClient needs at least one Conductor address")
        self.channels = [sync_channel(a, api_key) for a in addresses]
        self.stubs = [conductor_pb2_grpc.ConductorStub(c) for c in self.channels]
        self.timeout_s = timeout_s
        self._turn = itertools.count()

    def _order(self) -> list[conductor_pb2_grpc.ConductorStub]:
        """The replicas for one call, starting at the one whose turn it is."""
        start = next(self._turn) % len(self.stubs)
        return self.stubs[start:] + self.stubs[:start]

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        deployment: str = "auto",
        request_id: str = "",
        include_decision: bool = False,
    ) -> Iterator[conductor_pb2.GenerateResponse]:
        """Stream one request's responses (max_tokens 0 = up to the context length)."""
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos
        )
        if seed is not None:
            sampling.seed = seed
        request = conductor_pb2.GenerateRequest(
            request_id=request_id, sampling=sampling, stop=list(stop), deployment=DEPLOYMENTS[deployment],
            include_decision=include_decision,
        )  # fmt: skip
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        streamed: list[int] = []
        stubs = self._order()
        for tried, stub in enumerate(stubs, 1):
            try:
                for message in stub.Generate(failover_request(request, streamed), timeout=self.timeout_s):
                    streamed += message.token_ids
                    yield message
                return
            except grpc.RpcError as e:
                if e.code() not in FAILOVER or tried == len(stubs):
                    raise

    def complete(self, prompt: str | Sequence[int], **kwargs: object) -> Completion:
        """Run one request to the end and gather its responses."""
        result = Completion()
        for message in self.generate(prompt, **kwargs):  # type: ignore[arg-type]
            result.request_id = message.request_id
            result.conductor_request_id = message.conductor_request_id or result.conductor_request_id
            result.token_ids += message.token_ids
            result.text += message.text
            if message.HasField("decision"):
                result.decision = message.decision
            if message.HasField("usage"):
                result.usage = message.usage
                result.finish_reason = FINISH_REASONS.get(message.finish_reason, "")
        return result

    def explain(self, request_id: str) -> conductor_pb2.Decision:
        """The recorded decision of a recent request."""
        request = conductor_pb2.ExplainDecisionRequest(request_id=request_id)
        stubs = self._order()
        for i, stub in enumerate(stubs):  # the replica that decided knows it
            try:
                decision: conductor_pb2.Decision = stub.ExplainDecision(request, timeout=10)
                return decision
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.NOT_FOUND, *FAILOVER) or i == len(stubs) - 1:
                    raise
        raise AssertionError("unreachable: the last replica's error is raised")

    def close(self) -> None:
        """Close the channels."""
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> ConductorClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def generate_main(args: argparse.Namespace, config: Config) -> int:
    """``kvconductor generate --cluster``: one prompt through the running cluster's Conductor."""
    options: dict[str, object] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
        "deployment": args.deployment, "include_decision": True,
    }  # fmt: skip
    with ConductorClient(config.cluster.scheduler_endpoint) as client:
        try:
            if args.json:
                r = client.complete(args.prompt, **options)
                usage = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                         "cached_tokens": r.usage.cached_tokens}  # fmt: skip
                decision = r.decision or conductor_pb2.Decision()
                route = {"prefill_instance": decision.prefill_instance, "decode_instance": decision.decode_instance}
                reply = {"request_id": r.request_id, "conductor_request_id": r.conductor_request_id,
                         "token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason, "usage": usage,
                         **route}  # fmt: skip
                print(json.dumps(reply))
            else:
                for message in client.generate(args.prompt, **options):  # type: ignore[arg-type]
                    print(message.text, end="", flush=True)
                print()
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
