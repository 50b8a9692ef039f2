from pathlib import Path

import pytest
import torch
from conftest_engine import make_tiny_model, prefill_then_decode, random_prompt

from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams, sample

SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
PROMPT = random_prompt(37, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_p", {"top_p": float("nan")}),
        ("top_k", {"top_k": -1}),
        ("seed", {"seed": -3}),
        ("stop_token_ids", {"stop_token_ids": (-1,)}),
    ],
)
def test_invalid_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_token_depends_only_on_logits_seed_and_index() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    first = sample(logits, params, [0, 1, 2])
    assert sample(logits, params, [0, 1, 2]) == first
    assert sample(logits[1:2], params[:1], [1]) == first[1:2]  # batch position does not matter
    draws = {sample(logits[:1], params[:1], [i])[0] for i in range(30)}
    assert len(draws) > 3  # the index changes the draw


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(top_k=1, seed=3)] * 4, [0, 1, 2, 3]) == greedy
    assert sample(logits, [SamplingParams(top_p=1e-6, seed=3)] * 4, [0, 1, 2, 3]) == greedy


def test_seeded_sampling_is_reproducible(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=32)
    first = generate(engine, PROMPT, SEEDED)
    assert generate(LLMEngine(model_dir, num_blocks=32), PROMPT, SEEDED) == first
    other = SamplingParams(**{**SEEDED.__dict__, "seed": 99})
    assert generate(engine, PROMPT, other) != first


def test_seeded_sampling_identical_across_prefill_decode_split(model_dir: Path) -> None:
    single = generate(LLMEngine(model_dir, num_blocks=32), PROMPT, SEEDED)
    prefill = LLMEngine(model_dir, num_blocks=32)
    decode = LLMEngine(model_dir, num_blocks=32)
    assert prefill_then_decode(prefill, decode, "r", PROMPT, SEEDED) == single


def test_stop_token_and_eos(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=32)
    greedy = generate(engine, PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_at = greedy[3]
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True)
    engine.add_request("s", PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == greedy[: greedy.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"


def test_logprobs_of_chosen_tokens(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=16)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("with", PROMPT, SamplingParams(**{**greedy.__dict__, "logprobs": True}))
    engine.add_request("without", PROMPT, greedy)
    engine.add_request("sampled", PROMPT, SamplingParams(**{**SEEDED.__dict__, "logprobs": True}))
    outputs: dict[str, list[tuple[int, list[float]]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append((out.new_token_ids[0], out.logprobs))
    assert all(lp == [] for _, lp in outputs["without"])
    assert [t for t, _ in outputs["with"]] == [t for t, _ in outputs["without"]]
    # The first token's logprob is that of the prompt's last position under the raw distribution.
    full = LLMEngine(model_dir, num_blocks=16, max_num_batched_tokens=len(PROMPT))
    full.add_request("ref", PROMPT, greedy)
    scheduled = full.scheduler.schedule()
    assert scheduled is not None
    expected = torch.log_softmax(full.runner.run(scheduled)[0], -1)
    first_token, (first_lp,) = outputs["with"][0]
    assert first_lp == pytest.approx(float(expected.max())) and first_token == int(expected.argmax())
    sampled = [lp for _, lps in outputs["sampled"] for lp in lps]
    assert len(sampled) == SEEDED.max_tokens and all(lp <= 0 for lp in sampled)
