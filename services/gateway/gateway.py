"""The OpenAI-compatible REST shim: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

It validates the body, renders chat messages with the model's chat template, and calls the
Conductor's ``Generate`` over gRPC; tokens come back as SSE chunks (``stream``) or one JSON body.
gRPC status codes become OpenAI-shaped errors: INVALID_ARGUMENT 400, NOT_FOUND 404,
RESOURCE_EXHAUSTED 429 (SLO rejection, with the Conductor's reason and ``x-should-retry: false``, so OpenAI
SDKs do not retry it on their own), UNAVAILABLE 503. A client that
disconnects cancels the gRPC call, and with it the work on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenizers import Tokenizer

from engine.config import ModelConfig
from engine.tokenizer import TooManyTokens, check_prompt_bytes, load_tokenizer, tokenize_off_loop, too_long
from kvconductor.v1 import common_pb2, conductor_pb2
from services.common import metrics
from services.common.config import Config
from services.common.telemetry import extract_context, tracer
from services.gateway.chat_template import ChatTemplate
from services.gateway.conductors import Conductors
from services.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    SamplingFields,
    TokenizeRequest,
    error_body,
)
from services.gateway.openai_responses import HTTP_STATUS, Shaper, StreamingReply, sse_events

log = logging.getLogger(__name__)
ROUTES = ("/health", "/metrics", "/tokenize", "/get_load", "/v1/models", "/v1/completions", "/v1/chat/completions")


def _error(
    status: int, message: str, param: str | None = None, request_id: str = "", retry: bool = True
) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else {}
    if not retry:
        headers["x-should-retry"] = "false"  # OpenAI SDKs otherwise retry a 429 twice, with backoff
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# The error type of a Conductor's rejection, by its kind (trailing metadata kvconductor-rejection).
REJECTION_TYPES = {"ttft_slo": "slo_rejection_error", "tbt_slo": "slo_rejection_error", "capacity": "capacity_error"}


def _grpc_error(e: grpc.aio.AioRpcError, request_id: str) -> JSONResponse:
    status, message = HTTP_STATUS.get(e.code(), 500), e.details() or e.code().name
    trailing = {k: v for k, v in (e.trailing_metadata() or ()) if isinstance(v, str)}
    kind = trailing.get("kvconductor-rejection")
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or kind not in REJECTION_TYPES:
        return _error(status, message, request_id=request_id)
    # An SLO rejection is the Conductor's considered answer for the current load: an SDK's automatic
    # retries would add load at the worst moment. The client decides, told when waiting would help.
    headers = {"x-should-retry": "false"} | ({"x-request-id": request_id} if request_id else {})
    if "retry-after" in trailing:
        headers["retry-after"] = trailing["retry-after"]
    body = OpenAIError(status, message, REJECTION_TYPES[kind], code=kind).body
    return JSONResponse(body, status_code=status, headers=headers)


class Gateway:
    """The shim's state: config, chat template, Conductor channel."""

    def __init__(self, config: Config, discover: bool = True) -> None:
        self.config = config
        self.conductors = Conductors(config, discover)
        self.model = config.model.name
        self.template = ChatTemplate(config.model.path)
        self.keys = [k.encode() for k in config.gateway.api_keys]
        self._tokenizer: Tokenizer | None = None
        self.in_flight = 0  # requests being generated (the event loop is the only writer)
        self._max_model_len = 0
        if (Path(config.model.path) / "tokenizer.json").is_file():
            self.tokenizer()  # at start-up, not on the first request's loop turn (about 0.5 s)

    def tokenizer(self) -> tuple[Tokenizer, int]:
        """The served model's tokenizer and context length (loaded on first use).

        The context is the one the workers serve: the model's, or ``[emulation] max_model_len`` on emulated
        engines (which load only the model's tokenizer and config, whatever context it declares).
        """
        if self._tokenizer is None:
            raw = json.loads((Path(self.config.model.path) / "config.json").read_text())
            self._tokenizer = load_tokenizer(self.config.model.path)
            self._max_model_len = (
                self.config.emulation.max_model_len
                if self.config.engine.backend == "emulated"
                else ModelConfig.from_hf_config(raw, self.model).max_model_len
            )
        return self._tokenizer, self._max_model_len

    def refuse_long_prompt(self, prompt: str | list[int]) -> None:
        """Refuse a text prompt whose bytes alone prove it longer than the model's context (``OpenAIError``).

        A flood of 1 MiB prompts then costs the Conductor nothing, and this process no gRPC message: the
        Conductor checks again (for gRPC clients) against its workers' context, which may be shorter.
        """
        if self._tokenizer is None or not isinstance(prompt, str):
            return
        try:
            check_prompt_bytes(self._tokenizer, prompt, self._max_model_len - 1)
        except TooManyTokens as e:
            message = too_long(e.count, self._max_model_len, at_least=True)
            raise OpenAIError(400, message, "invalid_request_error") from None

    def key_refusal(self, headers: dict[str, str]) -> OpenAIError | None:
        """The 401 for a request without one of the keys (constant time per key); None when it has one."""
        if not self.keys:
            return None
        given = headers.get("authorization", "").removeprefix("Bearer ").strip().encode()
        if any(hmac.compare_digest(given, key) for key in self.keys):
            return None
        return OpenAIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def grpc_request(
        self, body: SamplingFields, request_id: str, prompt: str | list[int]
    ) -> conductor_pb2.GenerateRequest:
        """The Conductor request for a validated body."""
        if body.model != self.model:
            raise OpenAIError(404, f"model {body.model!r} does not exist; served: {self.model!r}",
                              "not_found_error", "model", "model_not_found")  # fmt: skip
        sampling = common_pb2.SamplingParams(
            max_tokens=body.limit(),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
        )
        if body.seed is not None:
            sampling.seed = body.seed
        request = conductor_pb2.GenerateRequest(
            request_id=request_id, sampling=sampling, stop=body.stop_list(), model=body.model
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request


router = APIRouter()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return _error(400, f"{param or 'body'}: {first.get('msg')}", param)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """The framework's own errors (unknown path, wrong method, unparsable or too large body) in OpenAI's shape."""
    if not isinstance(exc, HTTPException):
        return await _unexpected(request, exc)
    response = _error(exc.status_code, str(exc.detail))
    response.headers.update(exc.headers or {})
    return response


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, OpenAIError):
        return await _unexpected(request, exc)
    return JSONResponse(exc.body, status_code=exc.status)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}")


class _AroundRequest:
    """Every request: a server span continued from the caller's trace context, the API key, the size limit, metrics.

    The key is checked before anything of the request is read: a caller without one learns nothing (only
    ``/health``, serving or not, is open, for probes).

    Plain ASGI (not Starlette's ``BaseHTTPMiddleware``, which re-streams every chunk of a streamed response
    through a memory stream of its own): the response's messages pass straight through, and the span covers
    the whole response, its stream included.
    """

    def __init__(self, app: ASGIApp, limit: int, gateway: Gateway) -> None:
        self.app, self.limit, self.gateway = app, limit, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status = 500  # what an exception escaping the app becomes

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        parent = extract_context(headers)
        with tracer.start_as_current_span(f"{scope['method']} {route}", context=parent, kind=SpanKind.SERVER) as span:
            try:
                size = headers.get("content-length")
                refusal = self.gateway.key_refusal(headers) if scope["path"] != "/health" else None
                if refusal is not None:
                    await JSONResponse(refusal.body, status_code=refusal.status)(scope, receive, watched)
                elif size is not None and size.isdigit() and int(size) > self.limit:
                    await _error(413, f"request body exceeds {self.limit} bytes")(scope, receive, watched)
                else:
                    await self.app(scope, receive, watched)
            finally:
                span.set_attribute("http.response.status_code", status)
                metrics.HTTP_REQUESTS.labels(route, str(status)).inc()


class _BodyLimit:
    """413 for a body that grows past ``limit`` bytes as it arrives: chunked bodies declare no Content-Length."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, limited if scope["type"] == "http" else receive, send)


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format (behind the API keys like every route but /health: a scrape's ``authorization``)."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when a Conductor is SERVING: it answers and has workers that can serve a request."""
    conductors = _gateway(request).conductors
    problem = "unreachable"
    for address in conductors.addresses():
        try:
            stub = health_pb2_grpc.HealthStub(conductors.channel(address))
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            continue
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return JSONResponse({"status": "ok"})
        problem = "not serving"
    return _error(503, f"the Conductor is {problem}")


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """The served model."""
    gateway = _gateway(request)
    card = {"id": gateway.model, "object": "model", "created": 0, "owned_by": "kvconductor"}
    return JSONResponse({"object": "list", "data": [card]})


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Token ids of a prompt, as a vLLM server answers (routers use it for prefix affinity)."""
    gateway = _gateway(request)
    if body.model is not None and body.model != gateway.model:
        raise OpenAIError(404, f"model {body.model!r} does not exist", "not_found_error", "model", "model_not_found")
    tokenizer, max_model_len = gateway.tokenizer()
    prompt = await _chat_prompt(gateway, body.messages) if body.messages is not None else body.prompt or ""
    tokens = await tokenize_off_loop(tokenizer, prompt)
    return JSONResponse({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens})


@router.get("/get_load")
async def get_load(request: Request) -> JSONResponse:
    """Requests in flight behind this endpoint (for routers' load-based policies)."""
    gateway = _gateway(request)
    try:
        status = await gateway.conductors.status()
    except grpc.aio.AioRpcError as e:
        return _grpc_error(e, "")
    running = sum(i.num_running + i.num_foreign for i in status.instances)
    return JSONResponse({"load": running, "num_running": running, "num_instances": len(status.instances)})


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """Text completion."""
    gateway = _gateway(request)
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    return await _generate(gateway, body, request, prompt, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """Chat completion, prompted through the model's chat template."""
    gateway = _gateway(request)
    return await _generate(gateway, body, request, await _chat_prompt(gateway, body.messages), chat=True)


async def _chat_prompt(gateway: Gateway, messages: list[ChatMessage]) -> str:
    """The prompt text of chat messages, through the model's chat template (off the loop that streams)."""
    return await asyncio.to_thread(gateway.template.render, [{"role": m.role, "content": m.text()} for m in messages])


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    app.state.gateway.conductors.close()  # stop following etcd


def create_app(config: Config, discover: bool = True) -> FastAPI:
    """The FastAPI application; ``discover``: every Conductor registered in etcd, not only scheduler_endpoint."""
    app = FastAPI(title="kvconductor", description=__doc__, lifespan=_lifespan)
    app.state.gateway = Gateway(config, discover)
    if not config.gateway.api_keys:
        log.warning("no [gateway] api_keys configured: the REST API is open to anyone who can reach it")
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(_BodyLimit, limit=config.gateway.max_request_bytes)
    app.add_middleware(_AroundRequest, limit=config.gateway.max_request_bytes, gateway=app.state.gateway)  # outermost
    app.include_router(router)
    return app


async def _generate(
    gateway: Gateway, body: SamplingFields, request: Request, prompt: str | list[int], chat: bool
) -> Response:
    """Admit the request under ``[gateway] max_concurrent_requests`` and run it."""
    limit = gateway.config.gateway.max_concurrent_requests
    if gateway.in_flight >= limit:
        return _error(429, f"the gateway already serves {limit} requests ([gateway] max_concurrent_requests)")
    gateway.in_flight += 1
    streaming = False
    try:
        response = await _run(gateway, body, request, prompt, chat)
        streaming = isinstance(response, StreamingReply)
        return response
    finally:
        if not streaming:  # a stream releases its slot when it ends
            gateway.in_flight -= 1


async def _run(
    gateway: Gateway, body: SamplingFields, request: Request, prompt: str | list[int], chat: bool
) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    gateway.refuse_long_prompt(prompt)
    try:
        call = gateway.conductors.generate(gateway.grpc_request(body, request_id, prompt))
        first = await call.read()
    except grpc.aio.AioRpcError as e:
        return _grpc_error(e, request_id)
    headers = {"x-request-id": request_id}
    if first is grpc.aio.EOF:
        return _error(500, "the Conductor ended the stream without a response", request_id=request_id)
    shaper = Shaper(gateway.model, first.conductor_request_id or request_id, chat)  # a unique response id
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def cleanup() -> None:
            call.cancel()  # the client may have left before the stream began: stop the work on the workers
            gateway.in_flight -= 1

        return StreamingReply(sse_events(call, first, shaper, include_usage), headers, cleanup)
    text, finish, usage = first.text, first.finish_reason, first.usage
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            text += message.text
            finish, usage = message.finish_reason, message.usage
    except grpc.aio.AioRpcError as e:
        return _grpc_error(e, request_id)
    return JSONResponse(shaper.whole(text, finish, usage), headers=headers)


# How long an idle client connection is kept open. Longer than any client keeps one idle for reuse (httpx
# and the OpenAI SDKs 5 s, aiohttp 15 s, an AWS load balancer 60 s, Go 90 s): with equal timeouts (uvicorn's
# default is 5 s) the server closes a connection just as the client sends a request on it, and that request
# fails with a reset connection (ReadError / "server disconnected"); the client's timer starts later.
KEEP_ALIVE_S = 120


def server_config(app: FastAPI, host: str, port: int, cert_file: str, key_file: str, log_level: str) -> uvicorn.Config:
    """The uvicorn settings of a REST endpoint (the gateway's, a colocated worker's): HTTPS with a certificate."""
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5,
        ssl_certfile=cert_file or None, ssl_keyfile=key_file or None,
    )  # fmt: skip


def run_gateway(config: Config) -> None:
    """Serve the shim until SIGTERM/SIGINT."""
    g = config.gateway
    app = create_app(config)
    settings = server_config(app, g.host, g.port, g.tls_cert_file, g.tls_key_file, config.telemetry.log_level)
    uvicorn.Server(settings).run()
