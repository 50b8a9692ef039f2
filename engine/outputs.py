"""What one engine step reports per request."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepOutput:
    """Tokens a request produced in one step and whether it finished.

    ``finish_reason`` is "stop" (EOS or a stop token) or "length" (max_tokens or
    max_model_len); it is None while running, and for a prefill-only request that
    finished its prefill without meeting a stop condition (it continues on a decode
    worker). ``block_ids`` lists the KV blocks of a finished prefill-only request,
    held until ``LLMEngine.release``.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    block_ids: list[int] = field(default_factory=list)
