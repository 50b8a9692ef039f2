"""The OpenAI request bodies the REST shim accepts, and OpenAI-shaped errors.

Unknown fields are accepted and ignored (clients and routers add their own, as with vLLM); known
fields are type- and range-checked, and a failure names the field. Counts and token ids travel to
the Conductor as protobuf ``uint32``, so they are bounded here rather than overflowing there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from services.common.config import LIMIT_RANGES

UINT32_MAX = 2**32 - 1
MAX_MESSAGES = 4096  # chat messages per request (the body is bounded too: [gateway] max_request_bytes)
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
# Lists the Conductor bounds by a [scheduler] key, and the most that key may be set to: a longer list is refused
# here, before its items are validated and copied into the Conductor's request on the gateway's loop (100,000
# stop strings: about 10 ms); the Conductor checks the configured bound.
_HIGHEST = {key: high for key, _, high in LIMIT_RANGES}
MOST_ITEMS = {field: (key, _HIGHEST[key]) for field, key in (("stop", "max_stop_strings"),
                                                             ("stop_token_ids", "max_stop_token_ids"))}  # fmt: skip


class OpenAIError(Exception):
    """An error returned as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    """``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=UINT32_MAX)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None  # refused when asked for: not returned (rather than silently dropped)
    top_logprobs: int | None = None

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _at_most_any_limit(cls, value: Any, info: ValidationInfo) -> Any:
        key, most = MOST_ITEMS[str(info.field_name)]
        if isinstance(value, list) and len(value) > most:
            raise ValueError(f"{len(value)} items exceed {most}, the most [scheduler] {key} allows")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError("n > 1 is not supported; send n separate requests")
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def limit(self) -> int:
        """The token limit (0 = up to the context length)."""
        return self.max_tokens or 0


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        batched = isinstance(self.prompt, list) and len(self.prompt) > 1 and isinstance(self.prompt[0], str)
        if batched:
            raise ValueError("prompt: batched prompts are not supported; send one prompt per request")
        if not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self


class ContentPart(BaseModel):
    """A text part of a chat message."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    def limit(self) -> int:
        """``max_completion_tokens`` wins over the older ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens or 0


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's extension): a ``prompt``, or chat ``messages`` rendered as a chat request is."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error body for a status code."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }
    kind = kinds.get(status, "invalid_request_error" if 400 <= status < 500 else "internal_error")
    return OpenAIError(status, message, kind, param).body
