"""``bench.scale.agent_trace``: a Mooncake-format tool-agent workload that ``bench serve`` replays."""

from __future__ import annotations

from bench.scale import agent_trace
from bench.serve.workloads import TraceScale, load_trace


def test_the_agent_trace_is_seeded_replayable_and_mostly_reusable(tmp_path, capsys):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert agent_trace.main(["--out", str(one), "--requests", "200"]) == 0
    assert agent_trace.main(["--out", str(two), "--requests", "200"]) == 0
    assert one.read_text() == two.read_text()  # the same flags, the same file
    printed = capsys.readouterr().out
    reusable = int(printed.split("average, ")[1].split("%")[0])
    assert 70 <= reusable <= 90, printed
    requests = load_trace(one, None, TraceScale(length_scale=1.0, max_output_tokens=32, max_input_tokens=1 << 20))
    assert len(requests) == 200
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 10
    # every prompt is whole (its length from input_length, the blocks its hash ids name) and starts with one of
    # the agents' system prompts, which other requests share
    starts = {r.prompt_ids[:512] for r in requests}
    assert len(starts) <= 6 and all(len(r.prompt_ids) > 4 * 512 for r in requests)
