"""One streaming request against an OpenAI-compatible server, timed chunk by chunk.

Timing follows the seed's validation script: TTFT is the time to the first SSE data chunk that has a
choice (for chat, the server's role chunk, which kvconductor and vLLM send with the first token); the
inter-token latencies (ITL) are the gaps between later chunks; the end is the last chunk. Output tokens
come from ``usage.completion_tokens`` (``stream_options.include_usage``) because a chunk can carry more
or fewer than one token (a byte-level tokenizer holds back partial UTF-8 characters); without usage,
content chunks are counted.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from bench.serve.workloads import BenchRequest
from scheduler.sim.metrics import request_tbt

Endpoint = Literal["chat", "completions"]
_NUMBER = re.compile(r"\d+(\.\d+)?")


@dataclass
class RequestResult:
    """What one request did. ``error`` is None on success; times are seconds."""

    prompt_len: int
    max_tokens: int
    start_s: float = 0.0  # offset from the start of the run
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None  # reason key, e.g. "429: predicted TTFT N ms exceeds the SLO of N ms"

    @property
    def tpot(self) -> float | None:
        """(end - first token) / (tokens - 1); None with fewer than two tokens."""
        if self.error or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def tbt(self) -> float | None:
        """The paper's TBT: the mean of the longest 10% of the gaps between tokens; None with fewer than two.

        A stream that carried fewer chunks than tokens (a server that sends several tokens a chunk, or
        none for tokens that detokenize to nothing) has no gap per token: its mean gap (TPOT) stands in.
        """
        if self.error or self.output_tokens < 2 or not self.itl:
            return None
        return request_tbt(self.itl) if self.gap_per_token else self.tpot

    @property
    def gap_per_token(self) -> bool:
        """Whether the stream carried a chunk per token, so that ``tbt`` is of the tokens' own gaps."""
        return len(self.itl) + 1 >= self.output_tokens


def error_reason(status: int, body: str) -> str:
    """A countable reason: status plus the OpenAI error message with numbers replaced by N."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip()[:200] or httpx.codes.get_reason_phrase(status)
    return f"{status}: {_NUMBER.sub('N', str(message))}"


def request_body(request: BenchRequest, model: str, endpoint: Endpoint) -> dict[str, Any]:
    """The JSON body: greedy, ``ignore_eos`` so outputs have the requested length, usage in the stream."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.text}]
    else:
        body["prompt"] = list(request.prompt_ids)
    return body


class _Timer:
    """Times of the chunks of one stream that carry text.

    A chunk without text is no token: the chat role chunk (sent just before token 0 by some servers, ours
    among them, and with token 0 by others), a finish chunk after the last token. Timing it would add a gap
    of a few microseconds, which lowers TBT (the mean of the longest tenth of the gaps) wherever it adds one
    to that tenth. vLLM's benchmark client times the same chunks.
    """

    def __init__(self, result: RequestResult, t0: float) -> None:
        self.result, self.t0, self.last = result, t0, t0
        self.content_chunks = 0

    def on_data(self, data: dict[str, Any]) -> None:
        r = self.result
        if isinstance(err := data.get("error"), dict):  # an error event mid-stream
            r.error = f"stream {err.get('type') or 'error'}: {_NUMBER.sub('N', str(err.get('message')))}"
            return
        choice = data["choices"][0] if data.get("choices") else {}
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            now = time.perf_counter()
            if r.ttft is None:
                r.ttft = now - self.t0
            else:
                r.itl.append(now - self.last)
            self.last = now
            self.content_chunks += 1
        usage = data.get("usage")
        if usage:
            r.prompt_tokens = usage.get("prompt_tokens")
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def finish(self) -> None:
        r = self.result
        r.latency = self.last - self.t0
        if r.output_tokens == 0:
            r.output_tokens = self.content_chunks
        if r.error is None and r.ttft is None:
            r.error = "no tokens: the stream ended without a chunk of text"


async def send(
    client: httpx.AsyncClient, request: BenchRequest, model: str, endpoint: Endpoint, run_start: float
) -> RequestResult:
    """Stream one request; never raises for server-side failures (they land in ``result.error``)."""
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    result = RequestResult(len(request.prompt_ids), request.max_tokens)
    t0 = time.perf_counter()
    result.start_s = t0 - run_start
    timer = _Timer(result, t0)
    try:
        async with client.stream("POST", path, json=request_body(request, model, endpoint)) as response:
            if response.status_code != 200:
                result.error = error_reason(response.status_code, (await response.aread()).decode(errors="replace"))
                return result
            async for line in response.aiter_lines():
                if line.startswith("data:") and (payload := line[5:].strip()) != "[DONE]":
                    timer.on_data(json.loads(payload))
    except httpx.TransportError as e:
        result.error = f"transport: {type(e).__name__}"
        return result
    except json.JSONDecodeError:
        result.error = "bad SSE payload"
        return result
    timer.finish()
    return result
