"""OpenAI response bodies for one request: the JSON completion, its SSE chunks, and the streaming response.

The Conductor's ``GenerateResponse`` messages become OpenAI objects here: ``chat.completion`` /
``text_completion`` bodies, ``chat.completion.chunk`` SSE events ending in ``data: [DONE]``, ``usage`` with
``prompt_tokens_details.cached_tokens``. A streamed response always runs its cleanup when it ends, so a
client that leaves, even before the first byte, cancels the work on the workers.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi.responses import StreamingResponse

from kvconductor.v1 import common_pb2, conductor_pb2
from services.gateway.openai_protocol import error_body

HTTP_STATUS = {  # gRPC status of the Conductor -> HTTP status
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


class StreamingReply(StreamingResponse):
    """A streaming response that always runs ``cleanup`` when it ends: finished, failed, or the client left."""

    def __init__(self, body: AsyncIterator[str], headers: dict[str, str], cleanup: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Stream, then clean up however the stream ended."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


async def sse_events(
    call: Any, first: conductor_pb2.GenerateResponse, shaper: Shaper, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events for each Conductor message; an error mid-stream becomes an error event."""
    try:
        if shaper.chat:
            yield event(shaper.chunk({"role": "assistant", "content": ""}, None))
        message = first
        while True:
            finish = FINISH.get(message.finish_reason)
            if message.text or finish:
                yield event(shaper.chunk({"content": message.text}, finish))
            if finish:
                if include_usage:
                    yield event(shaper.usage_chunk(message.usage))
                break
            message = await call.read()
            if message is grpc.aio.EOF:
                break
    except grpc.aio.AioRpcError as e:
        yield event(error_body(HTTP_STATUS.get(e.code(), 500), e.details() or e.code().name))
    finally:
        call.cancel()
    yield "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    """One SSE event."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class Shaper:
    """Builds OpenAI response objects for one request."""

    def __init__(self, model: str, request_id: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = f"{kind}.chunk" if chunk and self.chat else kind
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        """One streamed chunk."""
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usage: conductor_pb2.Usage) -> dict[str, Any]:
        """The final chunk carrying usage (stream_options.include_usage)."""
        return {**self._envelope([], chunk=True), "usage": usage_body(usage)}

    def whole(self, text: str, finish: int, usage: conductor_pb2.Usage) -> dict[str, Any]:
        """A non-streamed response."""
        reason = FINISH.get(finish, "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._envelope([choice], chunk=False), "usage": usage_body(usage)}


def usage_body(usage: conductor_pb2.Usage) -> dict[str, Any]:
    """OpenAI ``usage``, with the prompt tokens whose KV was reused."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
