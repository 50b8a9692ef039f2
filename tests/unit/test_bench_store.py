"""``bench.store.run``'s slice arithmetic: the working set and the infinite-cache hit rate."""

import json

from bench.store.run import keep_short, working_set


def test_working_set_and_infinite_hit_rate_of_a_slice(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 3]},  # reuses 2 blocks
        {"timestamp": 2, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},  # all but its last token
        {"timestamp": 3, "input_length": 900, "output_length": 4, "hash_ids": [9, 1]},  # a fresh first block
        {"timestamp": 4, "input_length": 99999, "output_length": 4, "hash_ids": [5]},
    ]
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert keep_short(trace, 32768) == 4
    ws = working_set(trace)
    assert ws["tokens"] == 4 * 512  # blocks 1, 2, 3, 9
    assert ws["infinite_hit_rate"] == (1024 + 1023) / (1024 + 1536 + 1024 + 900)
