"""``bench.scale``'s tools: the tool-agent workload (Mooncake trace format) and the decisions summary of a run."""

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


def test_decisions_sums_what_the_conductor_chose_against_the_longest_prefix(tmp_path, capsys):
    import json

    from bench.scale import decisions

    def span(prefix_len, best_len, rejected=False):
        attributes = {"prefix_len": prefix_len, "best_len": best_len, "t_queue_ms": 10.0, "t_shared_ms": 5.0,
                      "predicted_ttft_ms": 100.0, "rejected": rejected}  # fmt: skip
        return {
            "name": "conductor.schedule",
            "attributes": {f"kvconductor.decision.{k}": v for k, v in attributes.items()},
        }

    (tmp_path / "traces").mkdir()
    spans = [span(512, 512), span(0, 1024), span(0, 0, rejected=True), {"name": "other", "attributes": {}}]
    spans[0]["attributes"]["kvconductor.decision.request_id"] = "a"
    spans.append({"name": "kvconductor.v1.Conductor/Generate",
                  "attributes": {"kvconductor.request_id": "a", "kvconductor.ttft_ms": 150.0}})  # fmt: skip
    (tmp_path / "traces" / "conductor-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    assert decisions.main([str(tmp_path), "--out", str(tmp_path / "d.json")]) == 0
    got = json.loads((tmp_path / "d.json").read_text())["conductors"]["conductor-0"]
    assert (got["decisions"], got["rejected"], got["below_best_prefix"]) == (2, 1, 0.5)
    assert (got["reused_tokens"], got["best_tokens"]) == (512, 1536)
    assert got["ttft_actual_over_predicted_median"] == 1.5  # the one request whose TTFT its span measured
    assert decisions.main([str(tmp_path / "nothing")]) == 1
