"""The worker-facing interface: validation, limits, abort/release/reserve and KV events."""

from pathlib import Path

import pytest
import torch
from conftest_engine import make_tiny_model, random_prompt

from engine.block_hash import prefix_block_hashes
from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def test_add_request_rejects_bad_requests(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", [1] * 512, GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("c", [1] * 60, GREEDY)  # 68 tokens need 5 blocks, the pool has 4
    with pytest.raises(ValueError, match=r"\[0, 261\)"):
        engine.add_request("d", [261], GREEDY)
    engine.add_request("e", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine(model_dir, num_blocks=4, dtype="float16")


def test_kv_pool_layout(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, kv_cache_bytes=10 * 2**20, block_size=16)
    pool = engine.kv_pool
    # layers * (K, V) * tokens * kv heads * head_dim * fp32 bytes
    assert pool.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert pool.num_blocks == 10 * 2**20 // pool.bytes_per_block and pool.nbytes == pool.data.nbytes
    # The worker's KVLayout addresses block b at base + b * bytes_per_block: the pool must lie so.
    assert pool.data[3].data_ptr() == pool.base_address + 3 * pool.bytes_per_block and pool.data[3].is_contiguous()


def test_admission_waits_for_blocks_and_max_num_seqs(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=4, block_size=16, max_num_seqs=1)
    for i in range(3):
        engine.add_request(f"r{i}", random_prompt(20, seed=i), GREEDY)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["r0"]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["r0", "r1", "r2"] and engine.num_free_blocks == 4


def test_abort_frees_blocks(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8)
    engine.add_request("a", random_prompt(20, seed=1), GREEDY)
    engine.add_request("b", random_prompt(20, seed=2), GREEDY)
    engine.step()
    assert engine.num_free_blocks < 8
    engine.abort("a")
    engine.abort("b")
    engine.abort("unknown")
    assert engine.num_free_blocks == 8 and not engine.has_unfinished_requests()


def test_prefill_only_holds_blocks_until_release(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8)
    prompt = random_prompt(40, seed=3)
    engine.add_request("p", prompt, GREEDY, prefill_only=True)
    (out,) = engine.step()
    assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
    assert len(out.block_ids) == 3 and engine.num_free_blocks == 5
    engine.release("p")
    assert engine.num_free_blocks == 8


def test_reserve_returns_none_when_full_and_abort_frees_reservation(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=4, block_size=16)
    params = SamplingParams(max_tokens=16, temperature=0)
    assert engine.reserve("a", 30, params) is not None  # 46 tokens: 3 blocks
    assert engine.reserve("b", 30, params) is None
    with pytest.raises(ValueError, match="no reservation"):
        engine.add_prefilled_request("b", [1] * 30, 5, params)
    with pytest.raises(ValueError, match="does not match"):
        engine.add_prefilled_request("a", [1] * 10, 5, params)
    engine.abort("a")
    assert engine.num_free_blocks == 4


def test_kv_events_and_eviction(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=4, block_size=16)
    prompt = random_prompt(40, seed=4)
    output = generate(engine, prompt, GREEDY)
    stored, removed = engine.pop_kv_events()
    # the last sampled token never gets KV, so 47 computed tokens give 2 full blocks
    assert [b.block_hash for b in stored] == prefix_block_hashes((prompt + output)[:-1], 16) and removed == []
    generate(engine, random_prompt(50, seed=5), GREEDY)  # needs all 4 blocks: evicts every cached one
    stored2, removed2 = engine.pop_kv_events()
    assert set(removed2) == {b.block_hash for b in stored} and len(stored2) == 3


def test_bfloat16_engine_generates(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8, dtype="bfloat16")
    assert engine.kv_pool.data.dtype == torch.bfloat16
    assert len(generate(engine, random_prompt(20, seed=6), GREEDY)) == 8


def test_more_work_than_the_pool_holds_waits_and_frees_every_block(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=12, block_size=16, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="needs 13 KV blocks but the pool has 12"):
        engine.add_request("never-fits", random_prompt(200, seed=0), GREEDY)
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 150, (16,), generator=rng).tolist()
    prompts = {f"r{i}": random_prompt(n, seed=30 + i) for i, n in enumerate(lengths)}
    for rid, prompt in prompts.items():  # together about 8x what the pool holds
        engine.add_request(rid, prompt, GREEDY, prefill_only=rid in ("r3", "r7"))
    tokens: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 3:
            assert engine.scheduler.running[0].request_id == "r0" and engine.scheduler.waiting[-1].request_id == "r15"
            engine.abort("r0")  # running
            engine.abort("r15")  # still waiting
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.block_ids:
                engine.release(out.request_id)  # a prefill-only request after its KV was sent
        if not engine.has_unfinished_requests():
            break
    assert engine.num_free_blocks == 12 and not engine.scheduler.held
    expected_len = {rid: 1 if rid in ("r3", "r7") else GREEDY.max_tokens for rid in prompts}
    assert {rid: len(t) for rid, t in tokens.items() if rid not in ("r0", "r15")} == {
        rid: n for rid, n in expected_len.items() if rid not in ("r0", "r15")
    }
    roomy = LLMEngine(model_dir, num_blocks=64)
    assert tokens["r9"] == generate(roomy, prompts["r9"], GREEDY)  # pressure and eviction change nothing


def test_prefill_only_reports_chunk_progress_for_kv_streaming(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=16, block_size=16, max_num_batched_tokens=20)
    engine.add_request("p", random_prompt(70, seed=7), GREEDY, prefill_only=True)
    engine.add_request("plain", random_prompt(70, seed=8), GREEDY)  # gets no progress outputs
    progress, snapshots = [], []
    while not progress or not progress[-1].finished:
        for out in engine.step():
            assert out.request_id == "p" or out.new_token_ids
            if out.request_id == "p":
                progress.append(out)
                done = out.num_computed_tokens // 16
                snapshots.append(engine.kv_pool.data[out.block_ids[:done]].clone())
    *chunks, last = progress
    assert [o.num_computed_tokens for o in chunks] == [20, 40, 60] and last.num_computed_tokens == 70
    assert all(o.new_token_ids == [] and not o.finished and o.finish_reason is None for o in chunks)
    assert [len(o.block_ids) for o in chunks] == [2, 3, 4] and len(last.block_ids) == 5
    assert all(last.block_ids[: len(o.block_ids)] == o.block_ids for o in chunks)
    assert len(last.new_token_ids) == 1 and last.finished
    for out, snapshot in zip(progress, snapshots, strict=True):  # finished blocks never change afterwards
        assert torch.equal(engine.kv_pool.data[out.block_ids[: len(snapshot)]], snapshot)


def test_one_prefill_at_a_time_runs_prompts_first_come_first_served(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=64, max_num_batched_tokens=64, max_num_prefills=1)
    params = SamplingParams(max_tokens=1)
    engine.add_request("a", list(range(100)), params, prefill_only=True)
    engine.add_request("b", list(range(100, 150)), params, prefill_only=True)
    finished = []
    for step in range(1, 10):
        finished += [(out.request_id, step) for out in engine.step() if out.finished]
    # a's 100 tokens take two 64-token steps alone; b's 50 run after, though they would fit beside a's 36.
    assert finished == [("a", 2), ("b", 3)]
    packed = LLMEngine(model_dir, num_blocks=64, max_num_batched_tokens=64)
    packed.add_request("a", list(range(100)), params, prefill_only=True)
    packed.add_request("b", list(range(100, 150)), params, prefill_only=True)
    assert [out.request_id for out in packed.step() if out.finished] == []
    assert sorted(out.request_id for out in packed.step() if out.finished) == ["a"]


def _import(engine: LLMEngine, prompt: list[int], num_blocks: int) -> list[int]:
    """A KV copy's blocks for ``prompt``'s first ``num_blocks`` blocks, cached and still referenced."""
    blocks = engine.allocate_blocks(num_blocks)
    assert blocks is not None
    hashes = prefix_block_hashes(prompt[: num_blocks * 16], 16)
    engine.commit_imported_blocks(blocks, hashes, prompt[: num_blocks * 16], keep_reference=True)
    return blocks


def test_a_copied_prefix_pinned_for_a_waiting_request_outlives_the_requests_ahead(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8, block_size=16, max_num_seqs=1)
    prompt = random_prompt(40, seed=7)  # 3 blocks with its outputs, the first 2 copied in
    pinned = _import(engine, prompt, 2)
    for name in ("a", "b"):  # 70 + 8 tokens: 5 blocks each; b evicts what a left behind, and no more
        engine.add_request(name, random_prompt(70, seed=ord(name)), GREEDY)
    engine.add_request("p", prompt, GREEDY, pinned=pinned)
    cached = {}
    while engine.has_unfinished_requests():
        cached.update({o.request_id: o.num_cached_tokens for o in engine.step()})
    assert cached["p"] == 32  # without the pins b's blocks would have evicted the copy (the oldest cached)
    assert engine.num_free_blocks == 8  # and every reference was given back


def test_pins_never_hold_up_the_head_of_the_queue(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8, block_size=16)
    prompt = random_prompt(40, seed=8)
    pinned = _import(engine, prompt, 2)
    engine.add_request("head", random_prompt(100, seed=9), GREEDY)  # 7 blocks: more than the 6 not pinned
    engine.add_request("p", prompt, GREEDY, pinned=pinned)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["head"]  # the pins gave way
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == 8


def test_aborting_a_waiting_request_gives_back_its_pins(model_dir: Path) -> None:
    engine = LLMEngine(model_dir, num_blocks=8, block_size=16, max_num_seqs=1)
    prompt = random_prompt(40, seed=10)
    engine.add_request("first", random_prompt(20, seed=11), GREEDY)
    engine.add_request("p", prompt, GREEDY, pinned=_import(engine, prompt, 2))
    engine.abort("p")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == 8
