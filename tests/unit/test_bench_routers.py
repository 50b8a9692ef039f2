"""``bench compare --routers``: contender specs and per-worker deltas (the live runs are in tests/e2e)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.compare import routers
from bench.compare.peers import parse_contender, router_command
from bench.compare.report import capacity_markdown, slo_capacity
from bench.compare.routers import Level, conductor_policy, levels, workers_markdown
from bench.compare.worker_metrics import worker_deltas


def test_contender_specs():
    assert parse_contender("conductor", "least_loaded").label == "conductor (least_loaded)"
    assert parse_contender("vllm:power_of_two").label == "vllm-router power_of_two"
    pd = parse_contender("conductor:disaggregated")
    assert (pd.label, pd.deployment, pd.router) == ("conductor PD (kvcache_centric)", "disaggregated", None)
    stock = parse_contender("vllm-pd:cache_aware")
    assert (stock.label, stock.deployment, stock.router) == ("vllm-router PD cache_aware", "vllm-pd", "vllm-pd")
    assert parse_contender("sglang:cache_aware").deployment == "colocated"
    dynamo = parse_contender("dynamo:kv")  # Dynamo's frontend over its own mocker workers
    assert (dynamo.label, dynamo.deployment, dynamo.router) == ("dynamo kv (its mocker workers)", "dynamo", "dynamo")
    dynamo_pd = parse_contender("dynamo-pd:kv")  # its disaggregated serving, on the split of conductor PD
    assert (dynamo_pd.label, dynamo_pd.deployment) == ("dynamo PD kv (its mocker workers)", "dynamo-pd")
    for bad in ("sglang:kv_aware", "vllm-pd:kv_aware", "conductor:pd", "dynamo:cache_aware"):
        with pytest.raises(ValueError, match="unknown contender"):
            parse_contender(bad)
    assert conductor_policy(["scheduler.policy=round_robin", "gateway.port=0"]) == "round_robin"
    assert conductor_policy([]) == "kvcache_centric"


def test_router_command_takes_the_deployments_worker_arguments():
    pd = [
        "--vllm-pd-disaggregation",
        "--kv-connector",
        "mooncake",
        "--prefill",
        "http://h:1",
        "9",
        "--decode",
        "http://h:2",
    ]
    command = router_command(parse_contender("vllm-pd:cache_aware"), pd, 8000, 29001)
    assert command[command.index("--vllm-pd-disaggregation") :][: len(pd)] == pd
    assert command[command.index("--policy") + 1] == "cache_aware" and "vllm_router.launch_router" in command


def test_worker_table_marks_workers_a_contender_did_not_use():
    level = {"c=1": {"workers": {"colocated-0": {"token_share": 1.0, "hit_rate": 0.5}}}}
    record = {"contenders": {
        "conductor": {"label": "conductor (kvcache_centric)", "levels": level,
                      "probe": {"token_share": {"colocated-0": 1.0}}},
        "vllm-pd:cache_aware": {"label": "vllm-router PD cache_aware", "levels": {"c=1": {"workers": {}}},
                                "probe": {"token_share": {}}},
    }}  # fmt: skip
    rows = workers_markdown(record, ["c=1"]).splitlines()
    assert rows[0].startswith("| run | colocated-0 tokens / hit | probe")
    assert rows[2] == "| conductor (kvcache_centric) c=1 | 100% / 50% | 100% |"
    assert rows[3] == "| vllm-router PD cache_aware c=1 | - | - |"


def test_worker_deltas_share_and_hit_rate():
    before = {"w0": {"query_tokens": 100.0, "hit_tokens": 0.0}, "w1": {"query_tokens": 0.0, "hit_tokens": 0.0}}
    after = {"w0": {"query_tokens": 400.0, "hit_tokens": 150.0}, "w1": {"query_tokens": 100.0, "hit_tokens": 0.0}}
    d = worker_deltas(before, after)
    assert d["w0"]["token_share"] == pytest.approx(0.75) and d["w0"]["hit_rate"] == pytest.approx(0.5)
    assert d["w1"]["token_share"] == pytest.approx(0.25) and d["w1"]["hit_rate"] == 0.0


def test_levels_are_request_rates_when_given_else_concurrency_levels():
    assert levels(argparse.Namespace(concurrency=[1, 4], request_rates=None)) == [Level(1), Level(4)]
    rates = levels(argparse.Namespace(concurrency=[1, 4], request_rates=[0.5, 2.0]))
    assert [level.label for level in rates] == ["rate=0.5", "rate=2"] and rates[0].concurrency is None


def test_slo_capacity_is_the_highest_rate_up_to_which_every_rate_held_90_percent():
    def run(attainment: float, goodput: float) -> dict[str, float]:
        return {"slo_attainment": attainment, "goodput": goodput}

    ours = {1.0: run(1.0, 1.0), 2.0: run(0.95, 1.9), 4.0: run(0.9, 3.6), 8.0: run(0.5, 4.0)}
    peer = {1.0: run(0.92, 0.9), 2.0: run(0.6, 1.2), 4.0: run(0.91, 3.6), 8.0: run(0.1, 0.8)}  # 4.0: a lucky run
    assert slo_capacity(ours) == 4.0 and slo_capacity(peer) == 1.0 and slo_capacity({1.0: run(0.5, 0.5)}) is None
    md = capacity_markdown({"conductor": ours, "peer": peer}, ["peer"])
    assert "| peer | 1.0 | 0.90 | 0.90 |" in md and "| conductor | 4.0 | 3.60 | 1.00 |" in md and "4.00x" in md


def test_dynamo_mocker_gets_the_cluster_configs_engine_shape(tmp_path):
    from bench.compare.dynamo_live import cluster_config, mocker_command
    from cli.local_cluster import REPO, TINY_MODEL

    args = argparse.Namespace(config=str(REPO / "deploy/emulated.toml"),
                              set=["colocated.max_concurrent_requests=64", "emulation.time_scale=2"],
                              model_overrides=(*TINY_MODEL, 'engine.backend="emulated"'), model="tiny-llama",
                              workers=16)  # fmt: skip
    command = mocker_command(args, cluster_config(args), tmp_path / "table.npz", tmp_path / "model")
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    # deploy/emulated.toml: a 186 MiB colocated pool at 64 bytes a token in 16-token blocks, 8192-token chunks
    assert flags["--num-workers"] == "16" and flags["--block-size"] == "16"
    assert flags["--num-gpu-blocks-override"] == str(186 * 2**20 // (64 * 16))
    assert flags["--max-num-seqs"] == "64" and flags["--max-num-batched-tokens"] == "8192"
    assert flags["--speedup-ratio"] == "0.5"  # twice as slow, as our emulated workers at time_scale 2
    assert flags["--model-path"] == str(tmp_path / "model") and flags["--planner-profile-data"].endswith("table.npz")
    assert "--disaggregation-mode" not in flags


def test_every_id_the_mocker_emits_detokenizes_to_a_chunk_of_its_own(tmp_path):
    """Dynamo's mocker samples ids past tiny-llama's vocabulary; its model folder makes each one text, and the
    prompts' ids (the served vocabulary's) keep their meaning."""
    from bench.compare.dynamo_live import MOCKER_IDS, mocker_model
    from cli.local_cluster import REPO
    from engine.tokenizer import load_tokenizer

    served = REPO / "models/tiny-llama"
    folder = mocker_model(served, tmp_path / "model")
    ours, theirs = load_tokenizer(served), load_tokenizer(folder)
    texts = [theirs.decode([i]) for i in MOCKER_IDS]
    assert all(t and "\ufffd" not in t for t in texts) and len(set(texts)) == len(texts)
    prompt = list(range(ours.get_vocab_size()))
    assert theirs.decode(prompt) == ours.decode(prompt)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] >= MOCKER_IDS.stop
    assert (folder / "tokenizer_config.json").read_bytes() == (served / "tokenizer_config.json").read_bytes()


def test_dynamo_pd_runs_the_split_and_pools_of_our_disaggregated_deployment(tmp_path):
    from bench.compare.dynamo_live import cluster_config, engine_counts, mocker_command
    from cli.local_cluster import REPO, TINY_MODEL

    args = argparse.Namespace(config=str(REPO / "deploy/emulated.toml"), set=[], prefill_workers=12, workers=16,
                              model_overrides=(*TINY_MODEL, 'engine.backend="emulated"'),
                              model="tiny-llama")  # fmt: skip
    counts = engine_counts(args, "dynamo-pd")
    assert counts == {"prefill": 12, "decode": 4} and engine_counts(args, "dynamo") == {"agg": 16}
    config = cluster_config(args)
    flags = {role: dict(zip(c[3::2], c[4::2], strict=True)) for role in counts
             for c in [mocker_command(args, config, tmp_path / "t.npz", tmp_path, role, counts[role])]}  # fmt: skip
    prefill, decode = flags["prefill"], flags["decode"]
    assert (prefill["--disaggregation-mode"], prefill["--num-workers"]) == ("prefill", "12")
    assert (decode["--disaggregation-mode"], decode["--num-workers"]) == ("decode", "4")
    # deploy/emulated.toml: prefill 186 MiB / decode 81 MiB at 64 bytes a token, 16-token blocks
    assert prefill["--num-gpu-blocks-override"] == str(186 * 2**20 // (64 * 16))
    assert decode["--num-gpu-blocks-override"] == str(81 * 2**20 // (64 * 16))
    assert decode["--max-num-seqs"] == "128"
    # the transfer takes the profile's link time for the emulated model's KV, as our workers' model_link does
    assert prefill["--kv-bytes-per-token"] == str(320 * 1024) and prefill["--kv-transfer-bandwidth"] == "12.5"
    args.set = ["emulation.model_link=false"]
    off = mocker_command(args, cluster_config(args), tmp_path / "t.npz", tmp_path, "decode", 4)
    assert off[off.index("--kv-transfer-bandwidth") + 1] == "0"


def test_bisection_finds_the_capacity_to_within_the_tolerance():
    from bench.compare.capacity import bisect, describe

    probed = []

    def attainment(rate):  # the true capacity: 9.3 req/s
        probed.append(rate)
        return 0.95 if rate <= 9.3 else 0.7

    found = bisect(attainment, 4, 20, 0.05)
    record = found.record()
    assert record["capacity"] <= 9.3 < record["failing"] <= record["capacity"] * 1.05
    assert len(probed) <= 6 and 4 not in probed and 20 not in probed  # log2(log(5) / log(1.05)) halvings
    assert describe(record) == f"{record['capacity']:g} ({record['failing']:g} failed)"
    above = bisect(lambda rate: 0.95 if rate <= 30 else 0.5, 4, 20).record()  # the bracket was too low: it grows
    assert above["expansions"] == 1 and above["capacity"] <= 30 < above["failing"] <= above["capacity"] * 1.05
    everything = bisect(lambda rate: 1.0, 4, 20).record()  # grown twice, still too low
    assert everything["at_least"] and describe(everything).startswith("at least") and everything["capacity"] > 76
    nothing = bisect(lambda rate: 0.0, 4, 20).record()
    assert nothing["capacity"] is None and describe(nothing) == f"below {nothing['failing']:g}" < "below 1.1"
    with pytest.raises(ValueError, match="LO < HI"):
        bisect(attainment, 5, 5)


def test_bisected_capacities_are_compared_within_each_kind_of_deployment():
    from bench.compare.capacity import markdown

    def bisections(*caps):
        return [{"capacity": c, "failing": round(c * 1.04, 2), "at_least": False} for c in caps]

    contenders = {
        "conductor": {"label": "conductor", "capacity": bisections(9.0, 9.4)},
        "dynamo:kv": {"label": "dynamo kv", "capacity": bisections(8.0, 8.2)},
        "conductor:disaggregated": {"label": "conductor PD", "capacity": bisections(12.0, 13.0)},
        "dynamo-pd:kv": {"label": "dynamo PD kv", "capacity": bisections(11.0, 13.5)},
    }
    md = markdown(contenders, {"conductor:disaggregated", "dynamo-pd:kv"})
    assert "| conductor | 9 (9.36 failed) | 9.4 (9.78 failed) | 9.20 | 0.40 |" in md
    assert "dynamo kv: 1.14x (9.20 vs 8.10 req/s; lead +1.10 req/s, larger than" in md
    assert "dynamo PD kv: 1.02x (12.50 vs 12.25 req/s; lead +0.25 req/s, not larger" in md
    capped = {"label": "conductor PD", "capacity": [
        {"capacity": 17.18, "failing": None, "at_least": True}, {"capacity": 16.39, "failing": 17.18, "at_least": False}
    ]}  # fmt: skip
    md = markdown({**contenders, "conductor:disaggregated": capped}, {"conductor:disaggregated", "dynamo-pd:kv"})
    assert "| conductor PD | at least 17.18 | 16.39 (17.18 failed) | at least 16.79 | 0.79 |" in md
    assert "dynamo PD kv: at least 1.37x (at least 16.79 vs 12.25 req/s" in md


def test_each_contender_is_shown_at_its_first_failing_rate():
    from bench.compare.capacity import knee_markdown

    def level(attainment, hit):
        return {"summary": {"slo_attainment": attainment, "ttft_ms": {"p90": 9500.0}, "tbt_ms": {"p90": 400.4},
                            "failed": 17, "prefix_cache_hit_rate": hit}}  # fmt: skip

    failed = {"label": "conductor", "capacity": [{"capacity": 11.49, "failing": 12.0, "at_least": False}],
              "levels": {"rate=11.49": level(0.93, 0.715), "rate=12": level(0.892, 0.666)}}  # fmt: skip
    never = {"label": "dynamo kv", "capacity": [{"capacity": 24.0, "failing": None, "at_least": True}],
             "levels": {"rate=24": level(0.95, 0.6)}}  # fmt: skip
    md = knee_markdown({"conductor": failed, "dynamo:kv": never})
    assert "| conductor | 12 | 89.2% | 9.5 | 400 | 17 | 66.6%-71.5% |" in md
    assert "dynamo kv" not in md  # it never failed a probe: no row
    assert knee_markdown({"dynamo:kv": never}) == ""


def test_a_deployment_that_fails_to_start_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    from contextlib import contextmanager

    from bench.compare import routers

    feeds = {}

    @contextmanager
    def deployment_up(deployment, args, root, kv_events):
        feeds[deployment] = kv_events
        if deployment == "dynamo":
            raise OSError("[Errno 2] No such file or directory: '.venv-dynamo/bin/python'")
        yield {"workers": [], "startup_s": 1.0, "kv_event_args": []}

    monkeypatch.setattr(routers, "deployment_up", deployment_up)
    monkeypatch.setattr(routers, "_one", lambda c, i, args, front, root: {"label": c.label, "levels": {}})
    monkeypatch.setattr(routers, "router_available", lambda router: "not installed" if router == "vllm" else None)
    args = argparse.Namespace(contenders=["conductor", "dynamo:kv", "vllm:cache_aware", "conductor:disaggregated",
                                          "sglang:cache_aware"], set=[], engine="emulated")  # fmt: skip
    result = routers.compare_routers(args, tmp_path)["contenders"]
    assert "levels" in result["conductor"] and "levels" in result["conductor:disaggregated"]
    assert "OSError" in result["dynamo:kv"]["failed"] and result["vllm:cache_aware"]["skipped"] == "not installed"
    assert feeds == {"colocated": False, "dynamo": False, "disaggregated": False}  # no vllm:kv_aware ran
    monkeypatch.setattr(routers, "router_available", lambda router: None)
    routers.compare_routers(argparse.Namespace(contenders=["conductor", "vllm:kv_aware", "conductor:conditional"],
                                               set=[], engine="emulated"), tmp_path)  # fmt: skip
    assert feeds["colocated"] is True and feeds["conditional"] is False  # the ZMQ feed only where it is read


def test_per_request_records_move_out_of_the_summary_json(tmp_path):
    run = {"summary": {"completed": 2}, "requests": [{"ttft": 0.5}, {"ttft": 0.7}]}
    record = {"contenders": {"conductor": {"levels": {"rate=6": run}}, "dynamo kv": {"failed": "no venv"}}}
    routers.write_requests(record, tmp_path / "requests.jsonl")
    assert record["contenders"]["conductor"]["levels"]["rate=6"] == {"summary": {"completed": 2}}
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert lines == [{"contender": "conductor", "level": "rate=6", "ttft": 0.5},
                     {"contender": "conductor", "level": "rate=6", "ttft": 0.7}]  # fmt: skip
