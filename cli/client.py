"""A small typed Python client of the Conductor's gRPC API, and ``kvconductor generate --cluster``.

    from cli.client import ConductorClient
    with ConductorClient("127.0.0.1:8998") as client:
        for chunk in client.generate("Hello", max_tokens=16):
            print(chunk.text, end="")
        result = client.complete([1, 2, 3], max_tokens=8, include_decision=True)
        print(result.token_ids, result.usage.cached_tokens, result.decision.prefill_instance)

Errors arrive as ``grpc.RpcError`` with the status the Conductor set (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED with the rejection reason, UNAVAILABLE).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from services.common.config import Config
from services.common.rpc import sync_channel

DEPLOYMENTS = {
    "auto": conductor_pb2.DEPLOYMENT_AUTO,
    "disaggregated": conductor_pb2.DEPLOYMENT_DISAGGREGATED,
    "colocated": conductor_pb2.DEPLOYMENT_COLOCATED,
}
FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass
class Completion:
    """A whole response."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: conductor_pb2.Usage = field(default_factory=conductor_pb2.Usage)
    decision: conductor_pb2.Decision | None = None


class ConductorClient:
    """Synchronous client of ``kvconductor.v1.Conductor``."""

    def __init__(self, address: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        """``api_key``: sent as ``authorization: Bearer KEY`` (None: ``KVCONDUCTOR_API_KEY`` or the config's first)."""
        self.channel = sync_channel(address, api_key)
        self.stub = conductor_pb2_grpc.ConductorStub(self.channel)
        self.timeout_s = timeout_s

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
        yield from self.stub.Generate(request, timeout=self.timeout_s)

    def complete(self, prompt: str | Sequence[int], **kwargs: object) -> Completion:
        """Run one request to the end and gather its responses."""
        result = Completion()
        for message in self.generate(prompt, **kwargs):  # type: ignore[arg-type]
            result.request_id = message.request_id
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
        decision: conductor_pb2.Decision = self.stub.ExplainDecision(request, timeout=10)
        return decision

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

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
                reply = {"request_id": r.request_id, "token_ids": r.token_ids, "text": r.text,
                         "finish_reason": r.finish_reason, "usage": usage, **route}  # fmt: skip
                print(json.dumps(reply))
            else:
                for message in client.generate(args.prompt, **options):  # type: ignore[arg-type]
                    print(message.text, end="", flush=True)
                print()
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
