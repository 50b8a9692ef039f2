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

    Chunk-level KV streaming: after each prefill chunk that does not end its prompt, a
    prefill-only request reports progress: ``new_token_ids == []``, ``finished`` False,
    ``num_computed_tokens`` tokens with KV in the pool, and ``block_ids`` the blocks
    holding them (the last one partial unless ``num_computed_tokens`` is a multiple of
    the block size). Blocks ``block_ids[:num_computed_tokens // block_size]`` are final,
    so a worker can send them while the next chunk computes.

    ``logprobs`` has the log-probability of each new token under the model's raw
    distribution (before temperature, top-k and top-p) when the request asked for it.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of the request with KV in the pool after this step
    logprobs: list[float] = field(default_factory=list)
