"""Committed benchmark write-ups say what their JSON says.

Each write-up's tables are the generated ``.md`` tables, verbatim; each number in its prose is derived
here from the JSON beside it, formatted as the prose writes it, and must appear in the write-up. A
result whose JSON names uncommitted code is refused.
"""

import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare.capacity import knee_rows
from bench.freshness import committed_results, entry_module, examine, rerun_command
from bench.imports import reached_files

SIM = Path(__file__).resolve().parents[2] / "bench" / "results" / "sim"


def _load(name):
    return json.loads((SIM / name).read_text())


def _assert_quotes(text, claims, what):
    """Every claim appears in ``text``; ``what`` says which write-up disagrees with which JSON."""
    missing = [c for c in claims if c not in text]
    assert not missing, f"{what}: {missing}"


def _tables(markdown):
    return [line for line in markdown.splitlines() if line.startswith("|")]


def test_sim_results_name_clean_code_and_their_command():
    for name in ("policies.json", "policies-error-0.3.json", "overload.json", "store.json"):
        record = _load(name)
        assert record["command"].startswith("python -m bench.sim.")


def test_sim_readme_tables_are_the_generated_ones():
    readme = (SIM / "README.md").read_text()
    for generated in ("policies.md", "policies-error-0.3.md", "overload.md", "store.md"):
        for row in _tables((SIM / generated).read_text()):
            assert row in readme, f"README.md lacks (or changed) this row of {generated}: {row}"


def test_sim_readme_prose_numbers_come_from_the_json():
    readme = " ".join((SIM / "README.md").read_text().split())  # prose wraps anywhere
    policies = {p: r["summary"] for p, r in _load("policies.json")["policies"].items()}
    overload = {m: r["summary"] for m, r in _load("overload.json")["runs"].items()}
    ours, paper = policies["kvcache_centric"], _load("policies.json")["paper_figure5_mean_ttft_s"]
    capacity = {p: s["effective_capacity"]["tbt<=100ms"] for p, s in policies.items()}
    claims = [
        f"Algorithm 1 serves {capacity['kvcache_centric']:,} of {ours['requests']:,}",
        f"the Dynamo rule {capacity['dynamo']:,}",
        f"load-balancing {capacity['least_loaded']:,}",
        f"random {capacity['random']:,}",
        f"colocated {capacity['colocated']:,}",
        f"load-balancing ({policies['least_loaded']['ttft']['mean']:.2f} s)",
        f"local cache-aware ({policies['cache_aware']['ttft']['mean']:.2f} s)",
        f"ours {ours['ttft']['mean']:.2f} vs {paper['kvcache_centric']:.2f} s",
        f"random {policies['random']['ttft']['mean']:.2f} vs {paper['random']:.2f} s",
        f"random / ours is {policies['random']['ttft']['mean'] / ours['ttft']['mean']:.1f}x here and "
        f"{paper['random'] / paper['kvcache_centric']:.1f}x in the paper",
        f"load-balancing / ours {policies['least_loaded']['ttft']['mean'] / ours['ttft']['mean']:.2f}x vs "
        f"{paper['least_loaded'] / paper['kvcache_centric']:.2f}x",
        f"copies KV in {ours['kv_copies']:,} requests ({ours['kv_copy_bytes'] / 1e12:.1f} TB",
        f"Its hit rate ({ours['cache_hit_rate']:.1%})",
        f"load-balancing gets {policies['least_loaded']['cache_hit_rate']:.1%}",
        f"close behind ({policies['dynamo']['ttft']['mean']:.2f} s), with less reuse "
        f"({policies['dynamo']['cache_hit_rate']:.1%})",
        f"p99 TBT {policies['colocated']['tbt']['p99'] * 1e3:.1f} ms, and "
        f"{policies['colocated']['slo_attainment']['tbt<=100ms']:.1%}",
        f"rejection counts are equal ({sum(overload['plain']['rejections'].values())}",
        f"std {_load('overload.json')['runs']['prediction']['oscillation']['decode_step_std_s'] * 1e3:.2f} vs "
        f"{_load('overload.json')['runs']['plain']['oscillation']['decode_step_std_s'] * 1e3:.2f} ms",
        f"p99 TBT drops from {overload['plain']['tbt']['p99'] * 1e3:.1f} to "
        f"{overload['prediction']['tbt']['p99'] * 1e3:.1f} ms",
    ]
    noisy = {p: r["summary"]["ttft"]["mean"] for p, r in _load("policies-error-0.3.json")["policies"].items()}
    claims += [
        f"Algorithm 1 {noisy['kvcache_centric']:.2f} s, the Dynamo rule {noisy['dynamo']:.2f} s, "
        f"load-balancing {noisy['least_loaded']:.2f} s, local cache-aware {noisy['cache_aware']:.2f} s, the SGLang "
        f"rule {noisy['sglang']:.2f} s, round-robin {noisy['round_robin']:.2f} s, random {noisy['random']:.2f} s",
        f"({ours['ttft']['mean']:.2f} vs {policies['dynamo']['ttft']['mean']:.2f} s without error)",
    ]
    store = {name: run["summary"] for name, run in _load("store.json")["runs"].items()}
    claims += [
        f"The global pool reaches {store['global pool']['cache_hit_rate']:.1%} of prompt tokens reused against "
        f"{store['per-node']['cache_hit_rate']:.1%} for per-node caches: "
        f"{_load('store.json')['global_over_per_node']:.2f}x",
        f"as far as the pool ({store['per-node + copies']['cache_hit_rate']:.1%}) with the lowest TTFT "
        f"({store['per-node + copies']['ttft']['mean']:.2f} s against {store['global pool']['ttft']['mean']:.2f} s)",
    ]
    ranked = sorted((p for p in noisy if p != "colocated"), key=noisy.get)
    assert ranked == sorted((p for p in policies if p != "colocated"), key=lambda p: policies[p]["ttft"]["mean"])
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")
    assert sum(overload["plain"]["rejections"].values()) == sum(overload["prediction"]["rejections"].values())


def test_every_committed_result_names_clean_code_and_its_command():
    results = SIM.parent
    paths = committed_results()
    assert {p.parent for p in paths} >= {
        results / "neighbours" / "flood",
        results / "scale" / "pd-overload",
    }  # any depth
    for path in paths:
        record = json.loads(path.read_text())
        assert record.get("command"), f"{path.relative_to(results)} does not say which command made it"
        assert record.get("code") and "uncommitted" not in record["code"], (
            f"{path.relative_to(results)}: {record.get('code')}"
        )
        entry_module(record["command"])  # `kvconductor bench results` can tell what code it measures


def test_a_result_is_stale_exactly_when_a_later_commit_changed_the_code_its_entry_point_reaches():
    sim = examine(SIM / "policies.json")
    measured = {str(f.relative_to(SIM.parents[2])) for f in reached_files([entry_module(sim.command)])}
    assert {"scheduler/policy.py", "scheduler/sim/simulator.py", "bench/sim/run.py"} <= measured
    assert not any(f.startswith(("services/", "cli/")) for f in measured)  # the simulator runs no process
    live = {str(f.relative_to(SIM.parents[2])) for f in reached_files(["bench.compare.cli"])}
    assert {"services/worker/engines/builtin.py", "services/gateway/gateway.py", "cli/serve.py"} <= live  # spawned
    if sim.status == "unknown":  # a clone without the result's commit (shallow) cannot tell
        return
    changes = subprocess.run(["git", "log", "--format=%h", f"{sim.code}..HEAD", "--", *sorted(measured)],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert sim.status == ("stale" if changes else "fresh") and list(sim.changes) == changes


def test_a_rerun_writes_over_the_committed_result():
    result = examine(SIM.parent / "scale" / "live_vs_sim.json")  # recorded with --out /tmp/lvs
    command = rerun_command(result)
    assert command[command.index("--out") + 1] == "bench/results/scale"
    conductor = rerun_command(examine(SIM.parent / "conductor" / "conductor.json"))
    assert conductor[:3] == [sys.executable, "-m", "bench.conductor.run"]
    assert conductor[conductor.index("--json") + 1] == "bench/results/conductor/conductor.json"
    compare = rerun_command(examine(SIM.parent / "compare" / "routers-run2.json"))
    assert compare[:4] == [sys.executable, "-m", "cli.main", "bench"]
    cpu = examine(SIM.parent / "compare" / "vllm" / "cpu.json")  # a wrapper: dated and rerun as what it wraps
    assert entry_module(cpu.command) == "bench.compare.cli"
    assert entry_module(".venv/bin/kvconductor bench compare --engine emulated") == "bench.compare.cli"  # a venv's
    with pytest.raises(ValueError, match="cannot tell"):
        entry_module("kvconductor bench")
    sampled = rerun_command(cpu)
    assert sampled[:3] == [sys.executable, "-m", "bench.compare.cpu"] and sampled.count("--out") == 2
    assert all(sampled[i + 1] == "bench/results/compare/vllm" for i, w in enumerate(sampled) if w == "--out")


def test_compare_readme_prose_numbers_come_from_the_json():
    folder = SIM.parent / "compare"
    readme = " ".join((folder / "README.md").read_text().split())
    table = json.loads((folder / "compare.json").read_text())["table"]
    ttft_at = {k: v["ttft_ms"]["median"] for k, v in table.items()}
    tpot = {k: v["tpot_ms"]["median"] for k, v in table.items()}
    goodput = {k: v["goodput"] for k, v in table.items()}
    runs = [json.loads((folder / f"{name}.json").read_text())["contenders"] for name in ("routers", "routers-run2")]

    def level(name):
        at = [{c["label"]: c["levels"][name]["summary"] for c in r.values()} for r in runs]
        ours = [r.pop("conductor (kvcache_centric)") for r in at]
        return at, ours, [max((s["goodput"], label) for label, s in r.items()) for r in at]

    at4, ours, best = level("c=4")
    spread = {label: abs(at4[0][label]["goodput"] - at4[1][label]["goodput"]) for label in at4[0]}
    gap = [b[0] - o["goodput"] for b, o in zip(best, ours, strict=True)]
    peer_tpot = sorted(s["tpot_ms"]["median"] for r in at4 for s in r.values())
    _, ours1, best1 = level("c=1")
    claims = [
        f"goodput is {ours[0]['goodput']:.2f} req/s in the first run and {ours[1]['goodput']:.2f} req/s in the second",
        f"the best peer reached {best[0][0]:.2f} req/s ({best[0][1]}) and "
        f"{best[1][0]:.2f} req/s ({best[1][1]}): {ours[0]['goodput'] / best[0][0]:.2f}x and "
        f"{ours[1]['goodput'] / best[1][0]:.2f}x",
        f"the first run's gap ({gap[0]:.2f} req/s) is smaller than the best peer's own change between the two runs "
        f"({spread[best[0][1]]:.2f} req/s; sglang-router cache_aware moved {spread['sglang-router cache_aware']:.2f})",
        f"{ours1[0]['goodput']:.2f} and {ours1[1]['goodput']:.2f} req/s against {best1[0][0]:.2f} and "
        f"{best1[1][0]:.2f} for the best peer ({best1[0][1]})",
        f"lowest TTFT p50 ({ours1[0]['ttft_ms']['median']:.1f} and {ours1[1]['ttft_ms']['median']:.1f} ms)",
        f"reuses {ours[0]['prefix_cache_hit_rate']:.1%} of the prompt tokens at c=4",
        f"its TPOT p50 ({ours[0]['tpot_ms']['median']:.2f} and {ours[1]['tpot_ms']['median']:.2f} ms) is inside the "
        f"peers' range ({peer_tpot[0]:.2f}-{peer_tpot[-1]:.2f} ms)",
    ]
    # issue 13's bar: the Conductor does not trail the best router at c=4 by more than the routers' own noise
    assert all(g <= spread[b[1]] for g, b in zip(gap, best, strict=True)), (gap, best, spread)
    assert all(o["goodput"] > b[0] for o, b in zip(ours1, best1, strict=True))  # "first in both runs" at c=1
    ranks = [1 + sum(s["goodput"] > o["goodput"] for s in r.values()) for r, o in zip(at4, ours, strict=True)]
    ordinal = {1: "first", 2: "Second", 3: "Third"}
    assert len(at4[0]) + 1 == 6
    claims.append(f"{ordinal[ranks[0]]} of six in the first run")
    claims.append(f"{ordinal[ranks[1]]} in the second")
    assert json.loads((folder / "routers.json").read_text())["workload"]["tbt_slo_ms"] == 200.0
    claims.append("Goodput limits: TTFT 2000 ms, TBT 200 ms")
    claims += [
        f"TTFT p50 {ttft_at['colocated c=1']:.1f} ms colocated vs {ttft_at['disaggregated c=1']:.1f} ms disaggregated",
        f"TPOT p50 {tpot['colocated c=1']:.2f} vs {tpot['disaggregated c=1']:.2f} ms",
        f"TTFT p50 {ttft_at['colocated c=4']:.1f} vs {ttft_at['disaggregated c=4']:.1f} ms",
        f"TPOT p50 {tpot['colocated c=4']:.2f} vs {tpot['disaggregated c=4']:.2f} ms",
        f"goodput {goodput['colocated c=4']:.2f} vs {goodput['disaggregated c=4']:.2f} req/s",
    ]
    for claim in claims:
        assert claim in readme, f"README.md no longer says: {claim}"


def test_vllm_compare_readme_prose_numbers_come_from_the_json():
    folder = SIM.parent / "compare" / "vllm"
    readme = " ".join((folder / "README.md").read_text().split())
    record = json.loads((folder / "routers.json").read_text())
    assert record["command"].startswith("kvconductor bench compare --engine vllm --routers")
    assert f"code {record['code']}" in readme
    runs = {
        (spec, level): c["levels"][level]["summary"]
        for spec, c in record["contenders"].items()
        for level in ("c=1", "c=4")
    }
    ttft = {k: s["ttft_ms"]["median"] for k, s in runs.items()}
    tpot = {k: s["tpot_ms"]["median"] for k, s in runs.items()}
    goodput = {k: s["goodput"] for k, s in runs.items()}
    peers = ("sglang:cache_aware", "vllm:cache_aware", "vllm:power_of_two")
    pd, stock = "conductor:disaggregated", "vllm-pd:cache_aware"
    sg, vc, vp = (ttft[(p, "c=1")] for p in peers)
    requests = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    gaps = {(r["contender"], r["level"]): 0.0 for r in requests}
    for r in requests:
        gaps[(r["contender"], r["level"])] = max(gaps[(r["contender"], r["level"])], max(r["itl"]))

    def median_ms(values, digits=0):
        return f"{statistics.median(values) * 1e3:,.{digits}f}"

    def of(spec, level):
        return [r for r in requests if (r["contender"], r["level"]) == (spec, level)]

    def verdict(level):
        ratio = goodput[(pd, level)] / goodput[(stock, level)]
        return f"met at {level} ({ratio:.2f}x)" if ratio >= 1 else f"missed by {1 - ratio:.0%} at {level}"

    hand_over = {k: median_ms(r["itl"][1] for r in of(*k)) for k in gaps}
    token1 = {k: median_ms(r["ttft"] + r["itl"][1] for r in of(*k)) for k in gaps}
    steady = {k: median_ms([x for r in of(*k) for x in r["itl"][2:]], 1) for k in gaps}
    claims = [
        f"TTFT p50 {ttft[('conductor', 'c=1')]:.1f} ms (Conductor) vs {sg:.1f} (sglang-router cache_aware), "
        f"{vc:.1f} (vllm-router cache_aware), {vp:.1f} ms (vllm-router power_of_two)",
        f"goodput {goodput[('conductor', 'c=1')]:.2f} vs " + ", ".join(f"{goodput[(p, 'c=1')]:.2f}" for p in peers),
        f"Goodput {goodput[('conductor', 'c=4')]:.2f} req/s (Conductor) against {goodput[(peers[0], 'c=4')]:.2f} "
        f"(sglang-router cache_aware) and {goodput[(peers[1], 'c=4')]:.2f} (vllm-router cache_aware), and "
        f"{goodput[(peers[2], 'c=4')]:.2f} for vllm-router power_of_two",
        f"(TPOT p50 {tpot[(peers[2], 'c=4')]:.2f} ms) than two engines sharing the cores "
        f"({tpot[('conductor', 'c=4')]:.2f} ms for the Conductor",
        f"At c=4 goodput {goodput[(pd, 'c=4')]:.2f} against {goodput[(stock, 'c=4')]:.2f} req/s "
        f"({goodput[(pd, 'c=4')] / goodput[(stock, 'c=4')]:.2f}x), TTFT p50 {ttft[(pd, 'c=4')]:.1f} against "
        f"{ttft[(stock, 'c=4')]:.1f} ms, TPOT p50 {tpot[(pd, 'c=4')]:.2f} against {tpot[(stock, 'c=4')]:.2f} ms",
        f"at c=1 TTFT p50 {ttft[(pd, 'c=1')]:.1f} against {ttft[(stock, 'c=1')]:.1f} ms, goodput "
        f"{goodput[(pd, 'c=1')]:.2f} against {goodput[(stock, 'c=1')]:.2f} req/s, "
        f"{runs[(pd, 'c=1')]['slo_attainment']:.0%} against {runs[(stock, 'c=1')]['slo_attainment']:.0%}",
        f"target (goodput at least vllm-router PD's) is {verdict('c=1')} and {verdict('c=4')}",
        f"{gaps[(pd, 'c=1')]:.2f} s at c=1 and {gaps[(pd, 'c=4')]:.2f} s at c=4 "
        f"({gaps[(stock, 'c=1')]:.2f} and {gaps[(stock, 'c=4')]:.2f} s for the stock pair)",
        f"(median inter-token gap {steady[(pd, 'c=1')]} against {steady[(stock, 'c=1')]} ms at c=1, "
        f"{steady[(pd, 'c=4')]} against {steady[(stock, 'c=4')]} ms at c=4",
        f"its median is {hand_over[(pd, 'c=1')]} ms at c=1 and {hand_over[(pd, 'c=4')]} ms at c=4 "
        f"({hand_over[(stock, 'c=1')]} and {hand_over[(stock, 'c=4')]} ms for the stock pair",
        f"Token 0 plus token 1 arrive {token1[(pd, 'c=1')]} against {token1[(stock, 'c=1')]} ms after the request "
        f"at c=1 and {token1[(pd, 'c=4')]} against {token1[(stock, 'c=4')]} ms at c=4",
    ]
    cpu = json.loads((folder / "cpu.json").read_text())
    assert cpu["code"] == record["code"]
    window = {(spec, level): cpu["windows"][f"{c['label']} {level}"]["cpu_s"]
              for spec, c in record["contenders"].items() for level in ("c=1", "c=4")}  # fmt: skip
    ours4, stock4 = window[(pd, "c=4")], window[(stock, "c=4")]
    engines = [k for k in ours4 if "vLLM" in k]
    services = sum(v for k, v in ours4.items() if k not in engines)
    servers = sum(v for k, v in stock4.items() if "vLLM" not in k)  # the two API servers and the router
    n = runs[(pd, "c=4")]["requests"]
    claims += [
        f"| decode: vLLM model runner | {window[(pd, 'c=1')]['decode: vLLM model runner']:.2f} | "
        f"{window[(stock, 'c=1')]['decode: vLLM model runner']:.2f} | "
        f"{ours4['decode: vLLM model runner']:.2f} | {stock4['decode: vLLM model runner']:.2f} |",
        f"| prefill: vLLM model runner | {window[(pd, 'c=1')]['prefill: vLLM model runner']:.2f} | "
        f"{window[(stock, 'c=1')]['prefill: vLLM model runner']:.2f} | "
        f"{ours4['prefill: vLLM model runner']:.2f} | {stock4['prefill: vLLM model runner']:.2f} |",
        f"used {services:.2f} s of CPU at c=4 against {servers:.2f} s for the two API servers and the router "
        f"({services / n * 1e3:.0f} against {servers / n * 1e3:.0f} ms per request)",
        f"({sum(ours4[k] for k in engines):.2f} against {sum(v for k, v in stock4.items() if 'vLLM' in k):.2f} s)",
    ]
    assert all(runs[(spec, level)]["completed"] == 20 for spec in (pd, stock) for level in ("c=1", "c=4"))
    assert "20/20 at c=1 and at c=4" in readme
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def test_conductor_results_name_clean_code_and_the_readme_says_what_the_json_says():
    folder = SIM.parent / "conductor"
    record = json.loads((folder / "conductor.json").read_text())
    assert record["command"].startswith("python -m bench.conductor.run")
    readme = (folder / "README.md").read_text()
    rows = {(r["instances"], r["tokens"]): r for r in record["rows"]}
    for case in ((64, 32768), (64, 100000), (256, 100000)):
        r = rows[case]
        numbers = " | ".join(f"{r[k]:.3f}" for k in ("hash_p50_ms", "match_p50_ms", "schedule_p50_ms",
                                                     "total_p50_ms", "total_p99_ms"))  # fmt: skip
        assert f"| {case[0]} | {case[1]:,} | {numbers} |" in readme
    target = rows[(64, 100000)]["total_p50_ms"]
    assert target <= 3.0 and f"Met: {target:.2f} ms" in " ".join(readme.split())
    assert f"(now {rows[(64, 32768)]['total_p50_ms']:.2f} ms)" in readme
    assert f"{rows[(256, 100000)]['total_p50_ms']:.1f} ms p50" in readme


def test_the_end_to_end_conductor_cost_readme_says_what_its_json_says():
    folder = SIM.parent / "conductor"
    runs = [json.loads((folder / name / "conductor-cost.json").read_text()) for name in (".", "run2")]
    assert [r["command"] for r in runs] == [
        "python -m bench.conductor.serve --out bench/results/conductor",
        "python -m bench.conductor.serve --out bench/results/conductor/run2",
    ]
    assert runs[0]["code"] == runs[1]["code"]
    readme = " ".join((folder / "README.md").read_text().split())
    assert f"--out bench/results/conductor` at commit {runs[0]['code']}" in readme
    latency = [{(r["instances"], r["prompt_tokens"]): r for r in run["rows"] if "sustained" not in r} for run in runs]
    sustained = [{r["instances"]: r["sustained"] for r in run["rows"] if "sustained" in r} for run in runs]
    first, second = (lat[(64, 100_000)] for lat in latency)
    s1 = first["stages_mean_ms"]
    after = [first["after_tokenization_mean_ms"], second["after_tokenization_mean_ms"]]
    verdict = "met" if max(after) <= 3 else "not met" if min(after) > 3 else "at the line"
    rates = {n: [sus[n]["requests_per_s"] for sus in sustained] for n in (16, 64, 256)}
    met = [n for n in (16, 64, 256) if min(rates[n]) >= 200]
    missed = [n for n in (16, 64, 256) if max(rates[n]) < 200]

    def both(n: int) -> str:
        return f"{rates[n][0]:.1f} and {rates[n][1]:.1f}"

    claims = [
        f"took {runs[0]['tokenize_ms']['100000']:.2f} ms in the first and {runs[1]['tokenize_ms']['100000']:.2f} ms",
        f"{verdict}, {after[0]:.2f} ms in the first run (hash {s1['hash']:.2f}, match "
        f"{s1['match']:.2f}, decide {s1['decide']:.2f}, book {s1['book']:.2f} ms) and "
        f"{after[1]:.2f} ms in the second (match {second['stages_mean_ms']['match']:.2f})",
        f"first token p50 is {first['ttft_ms']['p50']:.2f} and {second['ttft_ms']['p50']:.2f} ms",
        f"At 256 instances: {latency[0][(256, 100_000)]['after_tokenization_mean_ms']:.2f} and "
        f"{latency[1][(256, 100_000)]['after_tokenization_mean_ms']:.2f} ms",
        f"met at {' and '.join(map(str, met))} instances",
        f"at 64 instances {both(64)} requests/s ({sustained[0][64]['conductor_cpu_ms_per_request']:.2f} and "
        f"{sustained[1][64]['conductor_cpu_ms_per_request']:.2f} ms",
        f"at 16 instances ({both(16)}",
        f"at 256 instances {both(256)}",
    ]
    if missed:
        claims.append(f"not at {' and '.join(map(str, missed))}")
    for claim in claims:
        assert claim in readme, f"README.md no longer says: {claim}"
    for sus in sustained:
        assert all(s["errors"] == 0 and s["tokens"] == 16 * s["requests"] for s in sus.values())


def _capacity(markdown):
    """The SLO-capacity table of a rate sweep's write-up, and its Conductor / best peer ratio line."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| front end | capacity"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    ratio = next((line for line in lines if line.startswith("Best Conductor capacity")), None)
    return table, ratio


def test_scale_sweeps_name_clean_code_and_the_readme_quotes_their_capacities():
    from bench.compare.report import slo_capacity

    folder = SIM.parent / "scale"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    record = json.loads((folder / "trace" / "routers.json").read_text())
    assert record["command"].startswith("kvconductor bench compare --engine emulated --routers --workload trace")
    table, ratio = _capacity((folder / "trace" / "routers.md").read_text())
    assert all(line in readme for line in table), "README.md does not quote trace/routers.md's capacity table"
    ran = {c["spec"]: c for c in record["contenders"].values() if "levels" in c}
    caps = {spec: slo_capacity({v["rate"]: v["summary"] for v in c["levels"].values()}) for spec, c in ran.items()}
    peers = max(cap for spec, cap in caps.items() if not spec.startswith("conductor") and cap is not None)
    assert ratio == f"Best Conductor capacity / best peer capacity: {caps['conductor:disaggregated'] / peers:.2f}x"
    at12 = {spec: c["levels"]["rate=12"]["summary"] for spec, c in ran.items()}
    claims = [
        f"up to {caps['conductor:disaggregated']:g} req/s; the best peer, Dynamo's own stack, up to "
        f"{caps['dynamo:kv']:g} req/s: {caps['conductor:disaggregated'] / peers:.2f}x",
        f"At 12 req/s the split keeps {at12['conductor:disaggregated']['slo_attainment']:.0%} within SLO against "
        f"{at12['sglang:cache_aware']['slo_attainment']:.0%} for sglang-router, "
        f"{at12['vllm:cache_aware']['slo_attainment']:.0%} and {at12['vllm:kv_aware']['slo_attainment']:.0%} for "
        f"vllm-router, {at12['dynamo:kv']['slo_attainment']:.0%} for Dynamo",
        f"(TBT p90 {at12['conductor']['tbt_ms']['p90']:.0f} ms for our own colocated Conductor at 12 req/s, "
        f"{at12['sglang:cache_aware']['tbt_ms']['p90']:.0f} ms for sglang-router, "
        f"{at12['dynamo:kv']['tbt_ms']['p90']:.0f} ms for Dynamo)",
    ]
    _assert_quotes(flat, claims, "README.md disagrees with trace/routers.json")
    earlier, _ = _capacity((folder / "trace-worker-admission" / "routers.md").read_text())
    assert all(line in readme for line in earlier), "README.md does not quote the earlier run's capacity table"


def test_live_vs_sim_readme_says_what_its_json_says():
    folder = SIM.parent / "scale"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    record = json.loads((folder / "live_vs_sim.json").read_text())
    assert all(row in readme for row in _tables((folder / "live_vs_sim.md").read_text().split("Footprint")[0]))
    rows = record["policies"]
    worst = max(r["live"]["ttft_mean"] / r["sim"]["ttft_mean"] for r in rows.values())
    assert f"within {round((worst - 1) * 100)}% for all three policies" in flat
    assert all(not r["live"]["errors"] for r in rows.values())  # "None is lost now"
    rr = rows["round_robin"]
    assert f"simulator's {rr['sim']['hit_rate']:.1%}; {rr['live']['hit_rate']:.1%} now" in flat
    hit_off = max(abs(r["live"]["hit_rate"] / r["sim"]["hit_rate"] - 1) for r in rows.values())
    assert f"the hit rate within {round(hit_off * 100)}%" in flat
    assert worst - 1 <= 0.15 and hit_off <= 0.15  # "every policy is within the 15% asked"
    total = rows["kvcache_centric"]["live"]["footprint"]["total"]
    assert f"{total['rss_mib']:,.0f} MiB RSS in all" in flat and f"{total['cpu_cores']:.2f} cores busy" in flat


def test_the_shared_prefix_sweep_readme_says_what_its_json_says():
    from bench.compare.report import slo_capacity

    folder = SIM.parent / "scale" / "shared-prefix"
    readme = (folder.parent / "README.md").read_text()
    flat = " ".join(readme.split())
    record = json.loads((folder / "routers.json").read_text())
    table, ratio = _capacity((folder / "routers.md").read_text())
    assert all(line in readme for line in table)
    assert f"({ratio.rsplit(' ', 1)[1]} for the best Conductor)" in flat  # Dynamo's own stack is the best peer here
    at9 = {c["spec"]: c["levels"]["rate=9"]["summary"] for c in record["contenders"].values() if "levels" in c}
    caps = {spec: slo_capacity({9.0: s}) for spec, s in at9.items()}
    assert [spec for spec, cap in caps.items() if cap is None] == ["sglang:cache_aware", "vllm:cache_aware",
                                                                   "vllm:kv_aware"]  # fmt: skip
    claims = [
        f"(sglang-router {at9['sglang:cache_aware']['slo_attainment']:.0%} at 9 req/s, its circuit breaker again: "
        f"{at9['sglang:cache_aware']['failed']} of 400 failed; vllm-router cache_aware "
        f"{at9['vllm:cache_aware']['slo_attainment']:.0%}, kv_aware {at9['vllm:kv_aware']['slo_attainment']:.0%})",
        f"TTFT p50 {at9['vllm:kv_aware']['ttft_ms']['median'] / 1e3:.1f}-"
        f"{at9['vllm:cache_aware']['ttft_ms']['median'] / 1e3:.1f} s at 9 req/s against "
        f"{at9['conductor']['ttft_ms']['median'] / 1e3:.2f} s (colocated) and "
        f"{at9['conductor:disaggregated']['ttft_ms']['median'] / 1e3:.1f} s (PD)",
    ]
    _assert_quotes(flat, claims, "README.md disagrees with shared-prefix/routers.json")


def test_the_one_cost_model_sweeps_say_what_their_json_says():
    from bench.compare.report import slo_capacity

    folder = SIM.parent / "scale"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    runs = {}
    for name in ("shared-prefix-linear", "shared-prefix-linear-ts2"):
        record = json.loads((folder / name / "routers.json").read_text())
        assert 'emulation.profile="analytic-gpu-linear"' in record["command"]
        table, _ = _capacity((folder / name / "routers.md").read_text())
        assert all(line in readme for line in table), f"README.md does not quote {name}/routers.md's capacities"
        ran = {c["spec"]: c for c in record["contenders"].values() if "levels" in c}
        runs[name] = {spec: {v["rate"]: v["summary"] for v in c["levels"].values()} for spec, c in ran.items()}
    one, half = runs["shared-prefix-linear"], runs["shared-prefix-linear-ts2"]
    caps = {spec: slo_capacity(levels) for spec, levels in one.items()}
    ttft = {spec: [levels[r]["ttft_ms"]["median"] / 1e3 for r in sorted(levels)] for spec, levels in half.items()}
    claims = [
        f"colocated it holds 100% to {caps['conductor']:g} req/s, sglang-router "
        f"{one['sglang:cache_aware'][12.0]['slo_attainment']:.0%} at 12 and "
        f"{one['sglang:cache_aware'][16.0]['slo_attainment']:.0%} at 16 (capacity {caps['sglang:cache_aware']:g}: "
        f"{caps['conductor'] / caps['sglang:cache_aware']:.2f}x)",
        f"100% to {caps['dynamo:kv']:g} req/s ({caps['conductor'] / caps['dynamo:kv']:.2f}x for us)",
        f"(TTFT p50 {one['conductor'][16.0]['ttft_ms']['median'] / 1e3:.2f} s) and then missed (TTFT p50 "
        f"{one['conductor'][20.0]['ttft_ms']['median'] / 1e3:.1f} s, {one['conductor'][20.0]['slo_attainment']:.0%}",
        f"({ttft['dynamo:kv'][0]:.2f}-{ttft['dynamo:kv'][-1]:.2f} s wall against {ttft['conductor'][0]:.2f}-"
        f"{ttft['conductor'][-1]:.2f} s colocated and {ttft['conductor:disaggregated'][0]:.2f}-"
        f"{ttft['conductor:disaggregated'][-1]:.2f} s PD)",
    ]
    assert all(s["slo_attainment"] == 1.0 for levels in half.values() for s in levels.values())  # "all three hold 100%"
    _assert_quotes(flat, claims, "README.md disagrees with the one-cost-model sweeps")


PEERS = ("sglang:cache_aware", "vllm:cache_aware", "vllm:kv_aware")


def test_the_higher_grid_sweep_says_what_its_json_says():
    folder = SIM.parent / "scale" / "shared-prefix-linear-ts2-hi"
    flat = " ".join((folder.parent / "README.md").read_text().split())
    record = json.loads((folder / "routers.json").read_text())
    assert 'emulation.profile="analytic-gpu-linear"' in record["command"] and "time_scale=2" in record["command"]
    table, ratio = _capacity((folder / "routers.md").read_text())
    assert all(" ".join(line.split()) in flat for line in table)
    assert f"for 90% up to 12: {ratio.rsplit(' ', 1)[1]}" in flat
    run = {c["spec"]: {v["rate"]: v["summary"] for v in c["levels"].values()}
           for c in record["contenders"].values() if "levels" in c}  # fmt: skip
    pd, dyn, col = run["conductor:disaggregated"], run["dynamo:kv"], run["conductor"]
    hits = {spec: sorted(s["prefix_cache_hit_rate"] for s in levels.values()) for spec, levels in run.items()}
    reusable = (400 - 8) * 8192 / (400 * 12288)  # every prefix's first request computes it whole
    computed = [(1 - h) * 12288 for h in (hits["dynamo:kv"][-1], hits["dynamo:kv"][0])]
    claims = [
        f"{record['wall_s'] / 60:.1f} min for the 18 runs",
        f"(p50 {dyn[16.0]['ttft_ms']['median'] / 1e3:.2f} s, p90 {dyn[16.0]['ttft_ms']['p90'] / 1e3:.2f} s, against "
        f"{pd[16.0]['ttft_ms']['median'] / 1e3:.2f} s and {pd[16.0]['ttft_ms']['p90'] / 1e3:.2f} s for our split)",
        f"TBT p90 {dyn[16.0]['tbt_ms']['p90']:.0f} ms (over the 600 ms limit, {dyn[16.0]['slo_attainment']:.0%} within",
        f"(TBT p90 {pd[16.0]['tbt_ms']['p90']:.0f} ms)",
        f"({col[16.0]['slo_attainment']:.0%} at 16 req/s, TBT p90 {col[16.0]['tbt_ms']['p90']:.0f} ms)",
        "({:.0%}, {:.0%} and {:.0%})".format(*(run[s][12.0]["slo_attainment"] for s in PEERS)),
        f"hit rate ({hits['dynamo:kv'][0] * 100:.0f}-{hits['dynamo:kv'][-1]:.0%}) is close to ours "
        f"({hits['conductor:disaggregated'][0] * 100:.0f}-{hits['conductor:disaggregated'][-1]:.0%} on 12P+4D)",
        f"({dyn[20.0]['slo_attainment']:.0%} at 20, where our split is at {pd[20.0]['slo_attainment']:.0%})",
        f"At best {reusable:.1%} of the prompt tokens",
        f"{(1 - reusable) * 12288:,.0f} tokens computed per request",
        f"computes {computed[0]:,.0f}-{computed[1]:,.0f}, so",
        f"at most {computed[0] / ((1 - reusable) * 12288):.2f}-{computed[1] / ((1 - reusable) * 12288):.2f}x",
        f"our split refused {pd[20.0]['failed']} requests",
        f"and the colocated Conductor {col[20.0]['failed']};",
    ]
    _assert_quotes(flat, claims, "README.md disagrees with shared-prefix-linear-ts2-hi/routers.json")
    failed = sum(s["failed"] for levels in run.values() for s in levels.values())
    assert failed == pd[20.0]["failed"] + col[20.0]["failed"]  # "nothing else failed anywhere"


def test_the_store_benchmark_readme_says_what_its_json_says():
    folder = SIM.parent / "store"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    for name in ("store", "overloaded-2p"):
        record = json.loads((folder / f"{name}.json").read_text())
        assert record["code"] in readme and all(row in readme for row in _tables((folder / f"{name}.md").read_text()))
    record = json.loads((folder / "store.json").read_text())
    pools, store = record["runs"]["engine pools only"], record["runs"]["with the Store"]
    infinite = record["infinite_hit_rate"]
    pool_tokens = record["prefill_pool_mb"] * 2**20 // 64 * record["instances"]["prefill"]
    claims = [
        f"reuses {store['hit_rate'] / infinite:.1%} of what an infinite cache would ({store['hit_rate']:.1%} of the "
        f"prompt tokens against {infinite:.1%})",
        f"reach {pools['hit_rate'] / infinite:.0%} of it ({pools['hit_rate']:.1%})",
        f"({record['prefill_pool_mb'] * 2**20 // 64:,} tokens",
        f"{pool_tokens / record['working_set_tokens']:.0%} of the working set",
        f"Store segments of {record['segment_mb']} MiB each; {record['wall_s'] / 60:.1f} min for both runs",
        f"mean {pools['ttft_mean_s']:.2f} to {store['ttft_mean_s']:.2f} s, p90 {pools['ttft_p90_s']:.2f} to "
        f"{store['ttft_p90_s']:.2f} s",
        f"({record['working_set_tokens']:,} tokens of distinct trace blocks)",
    ]
    _assert_quotes(flat, claims, "bench/results/store/README.md disagrees with store.json")
    assert store["hit_rate"] >= 0.9 * infinite  # the target, met
    overloaded = json.loads((folder / "overloaded-2p.json").read_text())["runs"]["engine pools only"]
    assert overloaded["errors"] == {"transport: ReadError": 1} and "`transport: ReadError`" in flat


def test_the_pd_overload_run_lost_no_request_and_the_readme_says_so():
    folder = SIM.parent / "scale"
    flat = " ".join((folder / "README.md").read_text().split())
    record = json.loads((folder / "pd-overload" / "routers.json").read_text())
    assert f"(`pd-overload/`, code {record['code']})" in flat
    levels = [v["summary"] for c in record["contenders"].values() for v in c.get("levels", {}).values()]
    assert levels and all(s["failed"] == 0 and not s["errors"] for s in levels)
    worst = min(s["slo_attainment"] for s in levels)
    assert f"all {sum(s['completed'] for s in levels):,} requests completed, none failed" in flat
    assert f"({worst:.0%} within SLO at 24 req/s)" in flat


LIKE_FOR_LIKE = {"trace-linear": "the conversation trace", "shared-prefix-linear": "shared prefixes",
                 "agent-linear": "tool agent"}  # fmt: skip


def _ratios(markdown):
    """A ``--capacity`` routers.md's ratios by kind of deployment ("aggregated", "PD"), e.g. ``at least 1.46x``."""
    import re

    return dict(re.findall(r"against the best (aggregated|PD) peer, [^:]+: ((?:at least |about )?[0-9.]+x)", markdown))


def _like_for_like_runs(name):
    """A workload's run folders: the run of all four contenders, then its pairs' later runs (colocated, PD) if any."""
    run = SIM.parent / "scale" / "like-for-like" / name
    return [run, *(run / pair for pair in ("colocated", "pd") if (run / pair).is_dir())]


def test_like_for_like_runs_name_clean_code_and_the_readme_says_what_their_json_says():
    folder = SIM.parent / "scale"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    for name, workload in LIKE_FOR_LIKE.items():
        ratios = {}
        for run in _like_for_like_runs(name):  # a pair's later run, if any, gives its ratio
            record = json.loads((run / "routers.json").read_text())
            assert "--capacity" in record["command"] and "emulation.profile_error=0.2" in record["command"]
            assert "emulation.profile=analytic-gpu-linear" in record["command"]
            assert f"code {record['code']})" in readme and " ".join(record["command"].split()[4:12]) in flat
            markdown = (run / "routers.md").read_text()
            bisected = markdown[markdown.index("| front end | bisection 1") :].strip().splitlines()
            missing = [line for line in [*bisected, *knee_rows(record["contenders"])] if line and line not in readme]
            assert not missing, f"README.md does not quote {run}: {missing}"
            ratios.update(_ratios(markdown))
            failed = sorted(  # ours fail by refusing (429); any other failure the README counts
                sum(n for key, n in level["summary"]["errors"].items() if not key.startswith("429"))
                for spec in ("conductor", "conductor:disaggregated")
                if spec in record["contenders"]
                for level in record["contenders"][spec]["levels"].values()
            )
            failed = [n for n in failed if n]
            if failed:
                assert f"{', '.join(map(str, failed[:-1]))} and {failed[-1]} requests in those" in flat, (run, failed)
        assert f"| {workload} | {ratios['aggregated']} | {ratios['PD']} |" in readme
    for name in ("shared-prefix-linear", "agent-linear"):
        decided = {}
        for deployment in ("colocated", "disaggregated"):  # each from the latest run of that deployment
            path = next(r / f"decisions-{deployment}.json" for r in _like_for_like_runs(name)[::-1]
                        if (r / f"decisions-{deployment}.json").exists())  # fmt: skip
            decided[deployment] = json.loads(path.read_text())["conductors"]["conductor-0"]
        c, d = decided["colocated"], decided["disaggregated"]
        claim = (f"colocated, {c['below_best_prefix']:.0%} of choices went to an instance holding less than the "
                 f"longest prefix, recomputing {1 - c['reused_tokens'] / c['best_tokens']:.0%} of the reusable prompt "
                 f"tokens; 12P+4D {d['below_best_prefix']:.0%} and {1 - d['reused_tokens'] / d['best_tokens']:.0%}. "
                 f"TTFT actual / predicted median {c['ttft_actual_over_predicted_median']:.2f} (p90 "
                 f"{c['ttft_actual_over_predicted_p90']:.2f}) colocated, {d['ttft_actual_over_predicted_median']:.2f} "
                 f"(p90 {d['ttft_actual_over_predicted_p90']:.2f}) on 12P+4D")  # fmt: skip
        assert claim in flat, f"README.md disagrees with {name}/decisions-*.json: {claim}"


ERROR_ON_THEN = "4f24dac"  # the commit holding the error-on agent run of the error-free run's time (code bfb0d8e)


def test_the_error_free_run_is_the_agent_command_without_model_error_and_the_readme_quotes_it():
    folder = SIM.parent / "scale"
    flat = " ".join((folder / "README.md").read_text().split())
    off = json.loads((folder / "like-for-like" / "agent-linear-no-error" / "routers.json").read_text())
    on = json.loads((folder / "like-for-like" / "agent-linear" / "routers.json").read_text())
    assert f"code {off['code']})" in flat
    assert "profile_error" not in off["command"] and "emulation.profile_error=0.2" in on["command"]
    assert off["command"].split("--contenders")[0] == on["command"].split("--contenders")[0]  # the same workload
    markdown = (folder / "like-for-like" / "agent-linear-no-error" / "routers.md").read_text()
    assert all(line in flat for line in markdown[markdown.index("| front end | bisection 1") :].strip().splitlines())
    path = "bench/results/scale/like-for-like/agent-linear/routers.json"
    then = subprocess.run(["git", "show", f"{ERROR_ON_THEN}:{path}"], capture_output=True, text=True, cwd=folder)
    if then.returncode != 0:  # a clone without that commit (shallow) cannot tell
        pytest.skip("the error-on run of the error-free run's time is not in this clone")
    on = json.loads(then.stdout)

    def mean(record, spec):
        rates = [b["capacity"] for b in record["contenders"][spec]["capacity"]]
        return sum(rates) / len(rates)

    for spec, label in (("conductor", "colocated Conductor"), ("conductor:disaggregated", "split")):
        cost = 1 - mean(on, spec) / mean(off, spec)
        assert f"{label} {cost:.0%} ({mean(on, spec):.2f} against {mean(off, spec):.2f}" in flat


def test_plan_results_name_clean_code_and_the_readme_says_what_the_json_says():
    folder = SIM.parent / "plan"
    readme = " ".join((folder / "README.md").read_text().split())
    runs = {name: json.loads((folder / name / "plan.json").read_text())
            for name in ("conversation-16", "conversation-16-dynamo", "conversation-8rps")}  # fmt: skip
    for name, record in runs.items():
        assert record["code"] in readme
        assert (
            record["command"].startswith("kvconductor plan") and f"--out bench/results/plan/{name}" in record["command"]
        )
        assert record["command"] in (folder / name / "plan.toml").read_text()
    sixteen, dynamo, rate = (r["candidates"] for r in runs.values())
    cap = {label: c["capacity"] or 0.0 for label, c in sixteen.items()}
    dyn = {label: c["capacity"] or 0.0 for label, c in dynamo.items()}
    best = max(cap.values())
    assert runs["conversation-16"]["chosen"] == "12P+4D" and cap["12P+4D"] == best
    # every split of the mixed pool is at least the PD split of the same counts (the bisection's ties included)
    assert all(cap[f"{p}P+{16 - p}C"] >= cap[f"{p}P+{16 - p}D"] for p in range(1, 16))
    tuning = {s["knob"]: s["capacity"] for s in runs["conversation-16"]["tuning"]}
    best_dynamo = max(dyn, key=dyn.__getitem__)
    search = runs["conversation-8rps"]["search"]
    claims = [
        f"12P+4D, 13P+3D and the mixed pools 12P+4C and 13P+3C tie at {best:.2f} req/s",
        f"16 colocated instances reach {cap['16 colocated']:.2f} req/s",
        f"2048-token chunks lowered it to {tuning['max_num_batched_tokens']['2048']:.2f} req/s",
        f"32 or 64 requests per decode instance to {tuning['max_concurrent_requests']['32']:.2f} or "
        f"{tuning['max_concurrent_requests']['64']:.2f}",
        *(
            f"{p}P+{16 - p}C {cap[f'{p}P+{16 - p}C']:.2f} against {p}P+{16 - p}D {cap[f'{p}P+{16 - p}D']:.2f}"
            for p in (11,)
        ),  # fmt: skip
        f"6P+10C {cap['6P+10C']:.2f} against 6P+10D {cap['6P+10D']:.2f}",
        f"3P+13C {cap['3P+13C']:.2f} against 3P+13D {cap['3P+13D']:.2f}",
        f"Against Dynamo's rule in the same deployments: {best / dyn[best_dynamo]:.2f}x",
        f"reached at best {dyn[best_dynamo]:.2f} req/s ({best_dynamo}), against {best:.2f} for the cost rule",
        f"at 12P+4C {dyn['12P+4C']:.2f} against {cap['12P+4C']:.2f}",
        f"8 req/s needs {runs['conversation-8rps']['instances']} instances: {runs['conversation-8rps']['chosen']} at "
        f"{runs['conversation-8rps']['capacity']:.2f} req/s",
        "kept " + ", ".join(f"{s['attainment']:.1%}" for s in search[:-2]) + f" and {search[-2]['attainment']:.1%} "
        "of the requests within the SLOs (" + ", ".join(s["best"] for s in search[:-1]) + ")",
        f"({runs['conversation-16']['base_rate']:.2f} req/s as recorded",
    ]
    assert len(dyn) == 15 and rate["7P+2C"]["capacity"] == runs["conversation-8rps"]["capacity"]
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def test_the_plan_against_live_table_is_the_json():
    folder = SIM.parent / "plan" / "conversation-16-bed"
    readme = (folder.parent / "README.md").read_text()
    record = json.loads((folder / "plan.json").read_text())
    assert record["max_output_tokens"] == 32 and record["limit"] == 400 and f"code {record['code']})" in readme
    predicted = {label: c["capacity"] for label, c in record["candidates"].items()}

    def live(path, spec):
        rates = [b["capacity"] for b in json.loads((folder / path).read_text())["contenders"][spec]["capacity"]]
        return sum(rates) / len(rates)

    runs = {
        "14P+2D (chosen)": ("live-14p/routers.json", "conductor:disaggregated"),
        "14P+2C": ("live-14p/routers.json", "conductor:conditional"),
        "13P+3D": ("live-13p/routers.json", "conductor:disaggregated"),
        "12P+4D": ("../../scale/like-for-like/trace-linear/pd/routers.json", "conductor:disaggregated"),
        "12P+4C": ("../../scale/conditional/pair-final/routers.json", "conductor:conditional"),
        "16 colocated": ("../../scale/like-for-like/trace-linear/colocated/routers.json", "conductor"),
    }
    assert record["chosen"] == "14P+2D"
    for row, (path, spec) in runs.items():
        label, measured = row.removesuffix(" (chosen)"), live(path, spec)
        line = f"| {row} | {predicted[label]:.2f} | {measured:.2f} | {measured / predicted[label]:.2f} |"
        assert line in readme, f"bench/results/plan/README.md lacks {line}"
        if path.startswith("live-"):
            command = json.loads((folder / path).read_text())["command"]
            assert f"--prefill-workers {label[:2]}" in command and "--max-output-tokens 32 " in command


CONDITIONAL = SIM.parent / "scale" / "conditional"


def _conditional_run(name, readme):
    """A run under bench/results/scale/conditional: clean code the README names, a trace command."""
    record = json.loads((CONDITIONAL / name / "routers.json").read_text())
    assert record["code"] in readme
    assert record["command"].startswith("kvconductor bench compare --engine emulated --routers --workload trace")
    return record


def _cores(cpu, role):
    """Cores a role's processes used in each window of a ``bench.compare.cpu`` record, in level order."""
    return [sum(v for k, v in w["cpu_s"].items() if k.startswith(role)) / w["wall_s"] for w in cpu["windows"].values()]


def _summaries(record):
    """Each contender's summary per level: {spec: {"rate=R": summary}}."""
    return {spec: {lvl: v["summary"] for lvl, v in c["levels"].items()} for spec, c in record["contenders"].items()}


def test_conditional_results_name_clean_code_and_the_readme_says_what_the_json_says():
    readme = " ".join((CONDITIONAL / "README.md").read_text().split())
    now, dynamo = _conditional_run("trace", readme), _conditional_run("trace-dynamo-rule", readme)
    before = _conditional_run("before-fixes/trace", readme)
    assert "--set 'scheduler.disaggregation=\"dynamo\"'" in dynamo["command"]
    cap = {spec: c["capacity"][0]["capacity"] for spec, c in now["contenders"].items()}
    dyn = dynamo["contenders"]["conductor:conditional"]["capacity"][0]["capacity"]
    levels = _summaries(now)
    cond, pd = levels["conductor:conditional"], levels["conductor:disaggregated"]
    claims = [
        f"Cost against Dynamo's rule, same deployment: {cap['conductor:conditional'] / dyn:.2f}x",
        f"held {cap['conductor:conditional']:g} req/s; with Dynamo's rule",
        f"{dyn:g} req/s",
        f"PD (12P+4D) held {cap['conductor:disaggregated']:g} req/s, the mixed pool {cap['conductor:conditional']:g} "
        f"({cap['conductor:conditional'] / cap['conductor:disaggregated']:.2f}x), 16 colocated workers "
        f"{cap['conductor']:g}",
        f"at 20.92 req/s its TTFT p50 was {cond['rate=20.92']['ttft_ms']['median']:.0f} ms against "
        f"{pd['rate=20.92']['ttft_ms']['median']:.0f} ms for PD, at 13.86 req/s "
        f"{cond['rate=13.86']['ttft_ms']['median']:.0f} against {pd['rate=13.86']['ttft_ms']['median']:.0f} ms",
        f"({cond['rate=21.65']['slo_attainment']:.1%} within the SLOs at 21.65 req/s, where PD still held "
        f"{pd['rate=22.41']['slo_attainment']:.1%} at 22.41)",
        f"({cond['rate=21.65']['completed']} of {cond['rate=21.65']['requests']} at 21.65 req/s)",
        f"where the client saw {cond['rate=21.65']['ttft_ms']['median'] / 1e3:.1f} s",
        f"16 colocated workers held {before['contenders']['conductor']['capacity'][0]['capacity']:g} req/s before",
        f"and {cap['conductor']:g} now",
    ]
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def test_the_conditional_pair_again_names_clean_code_and_the_readme_says_what_the_json_says():
    readme = " ".join((CONDITIONAL / "README.md").read_text().split())
    cap, levels = {}, {}
    for name in ("pair-final", "pair-before-transfer-wait", "pair-before-link-fits"):
        record = _conditional_run(name, readme)
        assert "--contenders conductor:conditional conductor:disaggregated" in record["command"]
        cap[name] = {spec: c["capacity"][0]["capacity"] for spec, c in record["contenders"].items()}
        levels[name] = _summaries(record)
    now, spun, then = cap["pair-final"], cap["pair-before-transfer-wait"], cap["pair-before-link-fits"]
    cond, pd = levels["pair-final"]["conductor:conditional"], levels["pair-final"]["conductor:disaggregated"]
    c, p = now["conductor:conditional"], now["conductor:disaggregated"]
    old_cond = levels["pair-before-transfer-wait"]["conductor:conditional"]
    old_pd = levels["pair-before-transfer-wait"]["conductor:disaggregated"]
    knee, refused = "rate=23.19", lambda s: s["requests"] - s["completed"]
    top, pd_fail = (
        cond[f"rate={c:g}"],
        pd[f"rate={min(float(k[5:]) for k, v in pd.items() if v['slo_attainment'] < 0.9):g}"],
    )
    claims = [
        f"the mixed pool held **{c:g} req/s, PD {p:g} ({c / p:.2f}x)**",
        f"(TTFT p50 {cond['rate=20.92']['ttft_ms']['median']:.0f} ms against "
        f"{pd['rate=20.92']['ttft_ms']['median']:.0f} ms for PD at 20.92 req/s)",
        f"held {top['slo_attainment']:.1%} within the SLOs at {c:g} req/s ({refused(top)} refused), where PD held "
        f"{pd_fail['slo_attainment']:.1%} at",
        f"the mixed pool held {spun['conductor:conditional']:g} against {spun['conductor:disaggregated']:g} req/s for "
        f"PD ({spun['conductor:conditional'] / spun['conductor:disaggregated']:.2f}x)",
        f"({old_cond[knee]['slo_attainment']:.1%} within the SLOs at 23.19 req/s, TTFT p90 "
        f"{old_cond[knee]['ttft_ms']['p90'] / 1e3:.1f} s, {refused(old_cond[knee])} refused, where PD held "
        f"{old_pd[knee]['slo_attainment']:.1%} refusing {refused(old_pd[knee])})",
        f"{then['conductor:conditional']:g} against {then['conductor:disaggregated']:g} "
        f"({then['conductor:conditional'] / then['conductor:disaggregated']:.2f}x)",
    ]
    aging = {}
    for name in ("before", "after", "transfer-wait"):  # twelve probes in a row on one PD cluster
        record = _conditional_run(f"aging/{name}", readme)
        assert f"code {record['code']}" in readme
        assert (
            "--request-rates 21 21.1" in record["command"]
            and "--contenders conductor:disaggregated" in record["command"]
        )
        aging[name] = {k: v["slo_attainment"] for k, v in _summaries(record)["conductor:disaggregated"].items()}
    mids = [aging["after"][f"rate={x / 10:g}"] for x in range(211, 219)]
    claims.append(
        f"({aging['after']['rate=22']:.1%} and {aging['after']['rate=22.1']:.1%} within, against {min(mids):.1%}-"
        f"{max(mids):.1%} at 21.1-21.8 req/s; {aging['before']['rate=22']:.1%} and {aging['before']['rate=22.1']:.1%} "
        "before)"
    )
    spun = aging["transfer-wait"]
    cpu = json.loads((CONDITIONAL / "aging" / "transfer-wait" / "cpu.json").read_text())
    share = {role: _cores(cpu, role) for role in ("Conductor", "prefill")}
    claims += [
        f"the twelve probes held {min(spun.values()):.1%}-{max(spun.values()):.1%} within the SLOs, the last one "
        f"{spun['rate=22.1']:.1%}",
        f"the Conductor {min(share['Conductor']):.2f}-{max(share['Conductor']):.2f} of a core, the prefill workers "
        f"{min(share['prefill']):.2f}-{max(share['prefill']):.2f})",
    ]
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def _workload(command):
    """A bench compare command's flags other than its contenders, its output folder and the disaggregation rule."""
    words, kept, skip = shlex.split(command), [], False
    for i, word in enumerate(words):
        if word.startswith("--"):
            skip = word in ("--contenders", "--out") or words[i + 1 : i + 2] == ['scheduler.disaggregation="dynamo"']
        if not skip:
            kept.append(word)
    return sorted(kept)


def test_the_final_conditional_runs_and_the_readme_agree():
    """The mixed pool on the final code against PD, colocated (a2e4140) and Dynamo's rule in the same deployment."""
    readme = " ".join((CONDITIONAL / "README.md").read_text().split())
    pair, rule = _conditional_run("pair-final", readme), _conditional_run("dynamo-rule-final", readme)
    colocated = _conditional_run("trace", readme)["contenders"]["conductor"]["capacity"][0]["capacity"]
    assert "--set 'scheduler.disaggregation=\"dynamo\"'" in rule["command"]
    assert _workload(rule["command"]) == _workload(pair["command"])
    cost = pair["contenders"]["conductor:conditional"]["capacity"][0]["capacity"]
    pd = pair["contenders"]["conductor:disaggregated"]["capacity"][0]["capacity"]
    dyn = rule["contenders"]["conductor:conditional"]["capacity"][0]["capacity"]
    at = _summaries(rule)["conductor:conditional"][f"rate={dyn:g}"]
    claims = [
        f"Cost against Dynamo's rule, same deployment: {cost / dyn:.2f}x.** The mixed pool with the `cost` rule held "
        f"{cost:g} req/s; with Dynamo's rule {dyn:g} req/s, where {at['requests'] - at['completed']} of the 400",
        f"1.19x PD**, {cost:g} against {pd:g} req/s, and {cost / colocated:.2f}x 16 colocated workers ({colocated:g}",
    ]
    assert f"{cost / pd:.2f}x PD" in readme
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def test_the_transfer_wait_runs_name_clean_code_and_the_readme_says_what_the_json_says():
    """Nine probes in a row on one conditional cluster, before and after transfers stopped spinning."""
    readme = " ".join((CONDITIONAL / "README.md").read_text().split())
    within, ttft, prefill_cpu = {}, {}, {}
    for name in ("before", "after"):
        record = _conditional_run(f"transfer-wait/{name}", readme)
        assert "--contenders conductor:conditional --request-rates 21.5 21.6" in record["command"]
        cpu = json.loads((CONDITIONAL / "transfer-wait" / name / "cpu.json").read_text())
        assert cpu["code"] == record["code"] and record["command"].removeprefix("kvconductor ") in cpu["command"]
        levels = _summaries(record)["conductor:conditional"]
        within[name] = [s["slo_attainment"] for s in levels.values()]
        ttft[name] = [s["ttft_ms"]["median"] for s in levels.values()]
        prefill_cpu[name] = _cores(cpu, "prefill")
    b, a = within["before"], within["after"]
    claims = [
        f"probes fell to {b[3]:.1%}, {b[4]:.1%} and {b[5]:.1%} within the SLOs and recovered to {min(b[6:]):.1%}-"
        f"{max(b[6:]):.1%} after them",
        f"CPU rose from {prefill_cpu['before'][0]:.2f} to {max(prefill_cpu['before']):.2f} of a core",
        f"all nine probes held {min(a):.1%}-{max(a):.1%} within the SLOs, the prefill workers' CPU stayed at "
        f"{min(prefill_cpu['after']):.2f}-{max(prefill_cpu['after']):.2f} of a core",
        f"TTFT p50 of {min(ttft['after'][3:6]):.0f}-{max(ttft['after'][3:6]):.0f} ms (against "
        f"{min(ttft['before'][3:6]):.0f}-{max(ttft['before'][3:6]):.0f} ms before)",
    ]
    assert len(a) == len(b) == 9
    _assert_quotes(readme, claims, "README.md disagrees with the JSON")


def test_the_startup_readme_says_what_its_json_says():
    folder = SIM.parent / "engine" / "startup"
    readme = (folder / "README.md").read_text()
    flat = " ".join(readme.split())
    record = json.loads((folder / "startup.json").read_text())
    assert record["code"] in readme
    assert record["command"] in readme
    starts = {name: row["median_s"] for name, row in record["starts"].items()}
    for name, row in record["starts"].items():
        assert f"| {name} | {row['median_s']} | {', '.join(map(str, row['seconds']))} |" in readme
    ours, stock = starts["vllm colocated warm"], starts["stock vLLM server"]
    claims = [
        f"serves after {ours} s, the stock vLLM server after {stock} s ({ours - stock:.1f} s more, "
        f"{ours / stock - 1:.0%},",
        f"in {starts['vllm pd warm']} s",
        f"saves {starts['vllm colocated cold'] - ours:.1f} s of {starts['vllm colocated cold']} s",
        f"{starts['builtin pd cold'] - starts['builtin pd warm']:.1f} s of {starts['builtin pd cold']} s",
        f"(warm {starts['builtin pd warm']} s)",
    ]
    _assert_quotes(flat, claims, "bench/results/engine/startup/README.md disagrees with startup.json")


PER_TOKEN = SIM.parent / "scale" / "per-token"


def _capacities(record):
    """Each contender's bisected capacity: {spec: req/s}."""
    return {spec: c["capacity"][0]["capacity"] for spec, c in record["contenders"].items()}


PER_TOKEN_RUNS = ("trace", "trace-replan", "trace-routers", "trace-peers", "trace-defer", "trace-defer-2",
                  "trace-slack", "shared-prefix", "shared-prefix-rule", "shared-prefix-pd", "shared-prefix-slack",
                  "agent")  # fmt: skip


def _per_token_readme():
    return " ".join((PER_TOKEN / "README.md").read_text().split())


def _per_token(folder):
    """A per-token run: (its record, each contender's capacity, each contender's summary per level)."""
    record = json.loads((PER_TOKEN / folder / "routers.json").read_text())
    return record, _capacities(record), _summaries(record)


def _first_failing(record, spec):
    """(rate, summary) of the contender's first failing rate in its first bisection."""
    rate = record["contenders"][spec]["capacity"][0]["failing"]
    return rate, _summaries(record)[spec][f"rate={rate:g}"]


def _pushed_by_rule(summary):
    """Requests refused because Dynamo's rule put the prompt where it would push residents past the TBT SLO."""
    return sum(n for why, n in summary["errors"].items() if "would push" in why and "by Dynamo's rule" in why)


@pytest.mark.parametrize("folder", PER_TOKEN_RUNS)
def test_every_per_token_run_measures_every_stream_per_token_and_the_readme_names_its_code(folder):
    """TBT of the tokens' own gaps on both sides, at every level; the write-up names the commit each ran."""
    record, _, summaries = _per_token(folder)
    assert all(s["tbt_per_token"] == 1.0 for levels in summaries.values() for s in levels.values())
    assert record["code"] in _per_token_readme() and "uncommitted" not in record["code"]


def test_the_per_token_trace_run_says_what_its_json_says():
    readme = _per_token_readme()
    record, cap, summaries = _per_token("trace")
    assert record["command"].split(" --out ")[0] + " --out DIR" in readme
    mixed, pd, colocated = cap["conductor:conditional"], cap["conductor:disaggregated"], cap["conductor"]
    tbt = summaries["conductor:conditional"][f"rate={mixed:g}"]["tbt_ms"]["p90"]
    claims = [
        f"| 12 prefill + 4 decode | {pd:g} | {cap['dynamo-pd:kv']:g} | {pd / cap['dynamo-pd:kv']:.2f}x |",
        f"| 16 colocated (aggregated) | {colocated:g} | {cap['dynamo:kv']:g} | {colocated / cap['dynamo:kv']:.2f}x |",
        f"| 12 prefill + 4 colocated, cost rule | {mixed:g} |",
        f"**The mixed pool behind PD: {mixed:g} against {pd:g} req/s ({mixed / pd:.2f}x)**",
        f"TBT p90 was {tbt:.0f} ms at {mixed:g} req/s",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace/routers.json")


def test_the_per_token_trace_replan_run_says_what_its_json_says():
    readme = _per_token_readme()
    first, cap, _ = _per_token("trace")
    replan, again, levels = _per_token("trace-replan")
    assert "--set 'scheduler.disaggregation=\"dynamo\"'" in replan["command"]
    assert _workload(replan["command"].replace("--capacity 4 24", "--capacity 8 24")) == _workload(first["command"])
    mixed, replanned, rule = cap["conductor:conditional"], again["conductor"], again["conductor:conditional"]
    at = levels["conductor"][f"rate={replanned:g}"]
    _, failed = _first_failing(replan, "conductor:conditional")
    by_rule = _pushed_by_rule(failed)
    claims = [
        f"| 16 colocated, re-planning (`trace-replan/`) | {replanned:g} | {cap['dynamo:kv']:g} | "
        f"{replanned / cap['dynamo:kv']:.2f}x |",
        f"| 12 prefill + 4 colocated, Dynamo's rule (`trace-replan/`) | {rule:g} |",
        f"at {replanned:g} req/s its TBT p90 was {at['tbt_ms']['p90']:.0f} ms, and {at['failed']} of its 400",
        f"{mixed / replanned:.2f}x the 16 colocated workers of the same 16 slots ({replanned:g}",
        f"**{mixed / rule:.2f}x Dynamo's threshold rule in the same deployment** ({rule:g} req/s",
        f"failed with {failed['failed']} of 400 refused, {by_rule} of them because the rule",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-replan/routers.json")


def test_the_per_token_router_run_says_what_its_json_says():
    readme = _per_token_readme()
    first, _, _ = _per_token("trace")
    record, cap, _ = _per_token("trace-routers")
    assert _workload(record["command"].replace("--capacity 2 10", "--capacity 8 24")) == _workload(first["command"])
    ours = cap["conductor"]
    claims = [f"| our Conductor | {ours:g} | |"]
    for spec, name in (
        ("sglang:cache_aware", "sglang-router cache_aware"),
        ("vllm:cache_aware", "vllm-router cache_aware"),
    ):
        claims.append(f"| {name} | {cap[spec]:g} | {ours / cap[spec]:.2f}x |")
    failing = {spec: _first_failing(record, spec) for spec in cap}
    rate, s = failing["conductor"]
    claims.append(f"ours at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms, "
                  f"{s['failed']} of 400 refused")  # fmt: skip
    rate, s = failing["sglang:cache_aware"]
    claims.append(f"sglang-router at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} "
                  f"ms, TTFT p90 {s['ttft_ms']['p90']:.0f} ms, none refused")  # fmt: skip
    rate, s = failing["vllm:cache_aware"]
    claims.append(f"vllm-router at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 "
                  f"{s['tbt_ms']['p90']:.0f} ms, none refused")  # fmt: skip
    hits = [
        failing[spec][1]["prefix_cache_hit_rate"] for spec in ("conductor", "sglang:cache_aware", "vllm:cache_aware")
    ]
    claims.append("{:.1%} (ours), {:.1%} (sglang-router), {:.1%} (vllm-router)".format(*hits))
    assert all(failing[spec][1]["failed"] == 0 for spec in ("sglang:cache_aware", "vllm:cache_aware"))
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-routers/routers.json")


def test_the_per_token_slack_run_and_its_single_levels_say_what_their_json_says():
    readme = _per_token_readme()
    first, _, _ = _per_token("trace")
    record, cap, levels = _per_token("trace-slack")
    assert "--set 'scheduler.disaggregation=\"slack\"'" in record["command"]
    slack = " --set 'scheduler.disaggregation=\"slack\"'"
    same = record["command"].replace("--capacity 12 30", "--capacity 8 24").replace(slack, "")
    assert _workload(same) == _workload(first["command"])
    mixed, pd = cap["conductor:conditional"], cap["conductor:disaggregated"]
    at = levels["conductor:conditional"][f"rate={mixed:g}"]
    rate, failed = _first_failing(record, "conductor:conditional")
    pd_rate, pd_failed = _first_failing(record, "conductor:disaggregated")
    claims = [
        f"| 12 prefill + 4 colocated, slack rule | {mixed:g} |",
        f"| 12 prefill + 4 decode | {pd:g} |",
        f"**The mixed pool by the slack rule held {mixed / pd:.2f}x our split**",
        f"At {mixed:g} req/s it was {at['slo_attainment']:.1%} within the SLOs with TBT p90 "
        f"{at['tbt_ms']['p90']:.0f} ms",
        f"our split failed at {pd_rate:g} req/s ({pd_failed['slo_attainment']:.1%} within)",
        f"at {rate:g} req/s {failed['slo_attainment']:.1%} within, TTFT p90 {failed['ttft_ms']['p90'] / 1000:.1f} s "
        f"with only {failed['failed']} of 400 refused",
        f"Our split read {pd:g} req/s here",
    ]
    single = PER_TOKEN / "trace-slack" / "single-levels"
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(single.glob("*.json"))}
    assert all("uncommitted" not in r["code"] for r in runs.values())
    cost = [_summaries(runs[f"cost-{i}"]) for i in (1, 2, 3)]
    for spec in ("conductor:conditional", "conductor:disaggregated"):
        claims.append(", ".join(f"{c[spec]['rate=18.87']['slo_attainment']:.1%}" for c in cost[:2])
                      + f" and {cost[2][spec]['rate=18.87']['slo_attainment']:.1%}")  # fmt: skip
    slack = _summaries(runs["slack-1"])["conductor:conditional"]
    assert "--set 'scheduler.disaggregation=\"slack\"'" in runs["slack-1"]["command"]
    claims.append(f"read {slack['rate=18.87']['slo_attainment']:.1%} at 18.87 req/s and "
                  f"{slack['rate=20.92']['slo_attainment']:.1%} at 20.92")  # fmt: skip
    shared, s_cap, _ = _per_token("shared-prefix")
    _, slack_cap, _ = _per_token("shared-prefix-slack")
    rule, cost = slack_cap["conductor:conditional"], s_cap["conductor:conditional"]
    claims.append(f"one bisection): {rule:g} req/s, against {cost:g} for the `cost` rule in `shared-prefix/` (code "
                  f"{shared['code']}, a different run: {rule / cost:.2f}x) and "
                  f"{s_cap['conductor:disaggregated']:g} for our split there")  # fmt: skip
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-slack/ or shared-prefix-slack/")


def test_the_per_token_side_by_side_run_says_what_its_json_says():
    readme = _per_token_readme()
    first, _, _ = _per_token("trace")
    record, cap, _ = _per_token("trace-peers")
    assert _workload(record["command"].replace("--capacity 2 12", "--capacity 8 24")) == _workload(first["command"])
    ours, sglang, dynamo = cap["conductor"], cap["sglang:cache_aware"], cap["dynamo:kv"]
    assert sglang > dynamo  # the best aggregated peer, as the write-up says
    claims = [
        f"| 16 colocated, re-planning, side by side (`trace-peers/`) | {ours:g} | {dynamo:g} | {ours / dynamo:.2f}x |",
        f"| our Conductor | {ours:g} | |",
        f"| sglang-router cache_aware | {sglang:g} | {ours / sglang:.2f}x |",
        f"| Dynamo aggregated (KV router, mocker engines) | {dynamo:g} | {ours / dynamo:.2f}x |",
        f"our lead over it is {ours / sglang:.2f}x**",
        f"Side by side, Dynamo aggregated held {dynamo:g} req/s ({ours / dynamo:.2f}x)",
    ]
    rate, s = _first_failing(record, "conductor")
    pushed = sum(n for why, n in s["errors"].items() if "would push" in why)
    claims.append(f"ours at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms, "
                  f"{s['failed']} of 400 refused ({pushed} because every instance tried")  # fmt: skip
    for spec, name in (("sglang:cache_aware", "sglang-router"), ("dynamo:kv", "Dynamo")):
        rate, s = _first_failing(record, spec)
        assert s["failed"] == 0
        claims.append(f"{name} at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms")
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-peers/routers.json")


def test_the_per_token_deferring_run_says_what_its_json_says():
    readme = _per_token_readme()
    first, _, _ = _per_token("trace")
    earlier, before, _ = _per_token("trace-peers")
    record, cap, _ = _per_token("trace-defer")
    assert _workload(record["command"].replace("--capacity 4 14", "--capacity 8 24")) == _workload(first["command"])
    ours, sglang, dynamo = cap["conductor"], cap["sglang:cache_aware"], cap["dynamo:kv"]
    assert sglang > dynamo  # the best aggregated peer, as the write-up says
    claims = [
        f"| 16 colocated, deferring, side by side (`trace-defer/`) | {ours:g} | {dynamo:g} | {ours / dynamo:.2f}x |",
        f"| our Conductor | {ours:g} | |",
        f"| sglang-router cache_aware | {sglang:g} | {ours / sglang:.2f}x |",
        f"| Dynamo aggregated (KV router, mocker engines) | {dynamo:g} | {ours / dynamo:.2f}x |",
        f"**{ours / sglang:.2f}x the best aggregated peer, still under the 1.3x issue 29 asks.**",
        f"(sglang-router {sglang:g} against {before['sglang:cache_aware']:g}, Dynamo {dynamo:g} against "
        f"{before['dynamo:kv']:g}) and ours slightly more ({ours:g} against {before['conductor']:g})",
        f"(1.18x to {ours / sglang:.2f}x)",
    ]
    assert f"{before['conductor'] / before['sglang:cache_aware']:.2f}x" == "1.18x"
    rate, s = _first_failing(record, "conductor")
    pushed = sum(n for why, n in s["errors"].items() if "would push" in why)
    claims.append(f"ours at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms, "
                  f"{s['failed']} of 400 not served ({pushed} refused as pushing")  # fmt: skip
    held = _summaries(record)["conductor"][f"rate={ours:g}"]
    claims.append(f"Ours at its capacity: {held['slo_attainment']:.1%} within, TBT p90 {held['tbt_ms']['p90']:.0f} ms")
    for spec, name in (("sglang:cache_aware", "sglang-router"), ("dynamo:kv", "Dynamo")):
        rate, s = _first_failing(record, spec)
        assert s["failed"] == 0
        claims.append(f"{name} at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms")
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-defer/routers.json")


def test_the_per_token_deferring_run_again_says_what_its_json_says():
    readme = _per_token_readme()
    first, cap1, _ = _per_token("trace-defer")
    record, cap, _ = _per_token("trace-defer-2")
    assert _workload(record["command"]) == _workload(first["command"])
    ours, sglang, dynamo = cap["conductor"], cap["sglang:cache_aware"], cap["dynamo:kv"]
    assert sglang == dynamo and ours == cap1["conductor"]  # tied peers, ours unmoved: as the write-up says
    claims = [
        f"| 16 colocated, deferring, side by side again (`trace-defer-2/`) | {ours:g} | {dynamo:g} | "
        f"{ours / dynamo:.2f}x |",
        f"our Conductor {ours:g} req/s again, sglang-router {sglang:g} ({ours / sglang:.2f}x) and Dynamo aggregated "
        f"{dynamo:g} ({ours / dynamo:.2f}x)",
        f"while the best peer's moved by {cap1['sglang:cache_aware'] / sglang - 1:.0%} "
        f"({cap1['sglang:cache_aware']:g} and {sglang:g}): the lead is {ours / cap1['sglang:cache_aware']:.2f}x to "
        f"{ours / sglang:.2f}x",
    ]
    rate, s = _first_failing(record, "conductor")
    claims.append(f"Ours first failed at {rate:g} req/s, {s['slo_attainment']:.1%} within, TBT p90 "
                  f"{s['tbt_ms']['p90']:.0f} ms")  # fmt: skip
    for spec, name in (("sglang:cache_aware", "sglang-router"), ("dynamo:kv", "Dynamo")):
        rate, s = _first_failing(record, spec)
        claims.append(f"{name} at {rate:g} req/s {s['slo_attainment']:.1%} within, TBT p90 {s['tbt_ms']['p90']:.0f} ms")
    _assert_quotes(readme, claims, "per-token/README.md disagrees with trace-defer-2/routers.json")


def test_the_per_token_shared_prefix_run_says_what_its_json_says():
    readme = _per_token_readme()
    shared, cap, levels = _per_token("shared-prefix")
    assert shared["command"].split(" --out ")[0] + " --out DIR" in readme
    mixed, pd, colocated = cap["conductor:conditional"], cap["conductor:disaggregated"], cap["conductor"]
    (both,) = [  # the one rate both ran where PD failed
        lvl
        for lvl in set(levels["conductor:conditional"]) & set(levels["conductor:disaggregated"])
        if levels["conductor:disaggregated"][lvl]["slo_attainment"] < 0.9
    ]
    pd_failed = levels["conductor:disaggregated"][both]
    claims = [
        f"| 12 prefill + 4 decode | {pd:g} | {cap['dynamo-pd:kv']:g} | {pd / cap['dynamo-pd:kv']:.2f}x |",
        f"| 16 colocated (aggregated), re-planning | {colocated:g} | {cap['dynamo:kv']:g} | "
        f"{colocated / cap['dynamo:kv']:.2f}x |",
        f"| 12 prefill + 4 colocated, cost rule | {mixed:g} |",
        f"{mixed:g} req/s, {mixed / pd:.2f}x our PD split and {mixed / colocated:.2f}x our 16 colocated",
        f"at {both.removeprefix('rate=')} req/s its TTFT p50 was "
        f"{levels['conductor:conditional'][both]['ttft_ms']['median'] / 1000:.1f} s against "
        f"{pd_failed['ttft_ms']['median'] / 1000:.1f} s for PD, which failed there on TTFT with "
        f"{pd_failed['failed']} of 400",
        f"TBT p90 at {levels['conductor:conditional'][f'rate={mixed:g}']['tbt_ms']['p90']:.0f} ms at {mixed:g} req/s",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with shared-prefix/routers.json")


def test_the_per_token_shared_prefix_rule_run_says_what_its_json_says():
    readme = _per_token_readme()
    shared, cap, _ = _per_token("shared-prefix")
    rule_run, rule_cap, _ = _per_token("shared-prefix-rule")
    assert "--set 'scheduler.disaggregation=\"dynamo\"'" in rule_run["command"]
    assert _workload(rule_run["command"]) == _workload(shared["command"])
    mixed, rule = cap["conductor:conditional"], rule_cap["conductor:conditional"]
    failing, failed = _first_failing(rule_run, "conductor:conditional")
    by_rule = _pushed_by_rule(failed)
    assert by_rule == failed["failed"]
    claims = [
        f"| 12 prefill + 4 colocated, Dynamo's rule (`shared-prefix-rule/`) | {rule:g} |",
        f"**{mixed / rule:.2f}x Dynamo's threshold rule in the same deployment** ({rule:g} req/s",
        f"at {failing:g} req/s it failed with {failed['failed']} of 400 refused, all {by_rule} because",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with shared-prefix-rule/routers.json")


def _repeats(record):
    """Each contender's capacities over its repeats: {spec: [req/s, ...]}."""
    return {spec: [b["capacity"] for b in c["capacity"]] for spec, c in record["contenders"].items()}


def test_the_per_token_shared_prefix_pd_pair_leads_by_more_than_its_spread_and_says_so():
    readme = _per_token_readme()
    shared, cap, _ = _per_token("shared-prefix")
    pair, _, _ = _per_token("shared-prefix-pd")
    assert _workload(pair["command"]) == _workload(shared["command"].replace("--repeats 1", "--repeats 2"))
    runs = _repeats(pair)
    ours, theirs = runs["conductor:disaggregated"], runs["dynamo-pd:kv"]
    mean = {k: sum(v) / len(v) for k, v in runs.items()}
    lead = mean["conductor:disaggregated"] - mean["dynamo-pd:kv"]
    spread = [max(v) - min(v) for v in (ours, theirs)]
    assert lead > max(spread)
    pd = cap["conductor:disaggregated"]
    claims = [
        f"two repeats: {mean['conductor:disaggregated'] / mean['dynamo-pd:kv']:.2f}x Dynamo's split",
        f"ours {ours[0]:g} and {ours[1]:g} req/s, mean {mean['conductor:disaggregated']:.2f}, spread {spread[0]:.2f}",
        f"Dynamo's {theirs[0]:g} and {theirs[1]:g}, mean {mean['dynamo-pd:kv']:.2f}, spread {spread[1]:.2f}",
        f"the lead of {lead:.2f} req/s",
        f"it was {pd / cap['dynamo-pd:kv']:.2f}x ({pd:g} against {cap['dynamo-pd:kv']:g})",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with shared-prefix-pd/routers.json")


def test_the_per_token_agent_run_leads_by_more_than_its_spreads_and_says_what_its_json_says():
    readme = _per_token_readme()
    record, _, _ = _per_token("agent")
    assert record["command"].split(" --out ")[0].replace("\n", " ") + " --out DIR" in readme
    runs = _repeats(record)
    claims = []
    for row, ours, theirs in (
        ("12 prefill + 4 decode", "conductor:disaggregated", "dynamo-pd:kv"),
        ("16 colocated (aggregated), re-planning", "conductor", "dynamo:kv"),
    ):
        a, b = runs[ours], runs[theirs]
        mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
        spread = max(max(a) - min(a), max(b) - min(b))
        assert mean_a - mean_b > spread
        claims.append(
            f"| {row} | {a[0]:g}, {a[1]:g} (mean {mean_a:.2f}) | {b[0]:g}, {b[1]:g} (mean {mean_b:.2f}) | "
            f"{mean_a / mean_b:.2f}x | {mean_a - mean_b:.2f} | {spread:.2f} |"
        )
    (r_pd, pd), (r_dpd, dpd) = _first_failing(record, "conductor:disaggregated"), _first_failing(record, "dynamo-pd:kv")
    (r_col, col), (r_agg, agg) = _first_failing(record, "conductor"), _first_failing(record, "dynamo:kv")
    claims += [
        f"at {r_pd:g} req/s ours refused {pd['failed']} of 400 with TTFT p90 {pd['ttft_ms']['p90'] / 1000:.1f} s "
        f"and TBT p90 {pd['tbt_ms']['p90']:.0f} ms",
        f"at {r_dpd:g} req/s Dynamo's TTFT p90 was {dpd['ttft_ms']['p90'] / 1000:.1f} s "
        f"({dpd['slo_attainment']:.1%} within the SLOs), with TBT p90 {dpd['tbt_ms']['p90']:.0f} ms",
        f"(p90 {agg['tbt_ms']['p90']:.0f} ms at {r_agg:g} req/s, over the 600 ms SLO, "
        f"{agg['slo_attainment']:.1%} within)",
        f"p90 under it ({col['tbt_ms']['p90']:.0f} ms at {r_col:g} req/s) and fail on what they refuse "
        f"({col['failed']} of 400 there, {col['slo_attainment']:.1%} within)",
    ]
    _assert_quotes(readme, claims, "per-token/README.md disagrees with agent/routers.json")


def test_the_readme_front_door_quotes_the_per_token_runs_as_their_json_says():
    _, cap, _ = _per_token("trace")
    _, again, _ = _per_token("trace-replan")
    _, s_cap, _ = _per_token("shared-prefix")
    _, s_rule_cap, _ = _per_token("shared-prefix-rule")
    agent = {spec: sum(runs) / len(runs) for spec, runs in _repeats(_per_token("agent")[0]).items()}
    _, routers, _ = _per_token("trace-routers")
    _, peers, _ = _per_token("trace-defer")
    _, rerun, _ = _per_token("trace-defer-2")
    _, slack, _ = _per_token("trace-slack")
    _, slack_shared, _ = _per_token("shared-prefix-slack")
    mixed, pd, rule = cap["conductor:conditional"], cap["conductor:disaggregated"], again["conductor:conditional"]
    s_mixed, s_pd, s_rule = (
        s_cap["conductor:conditional"],
        s_cap["conductor:disaggregated"],
        s_rule_cap["conductor:conditional"],
    )
    front = " ".join((SIM.parents[2] / "README.md").read_text().split())
    front_claims = [
        f"its SLO capacity was {pd / cap['dynamo-pd:kv']:.2f}x Dynamo's on the same 12 prefill + 4 decode split.",
        f"it held {peers['conductor'] / peers['sglang:cache_aware']:.2f}x sglang-router's `cache_aware`, the best "
        f"aggregated peer there, and {peers['conductor'] / peers['dynamo:kv']:.2f}x Dynamo aggregated, run side by "
        f"side (one bisection each); run again, {rerun['conductor'] / rerun['sglang:cache_aware']:.2f}x both peers",
        f"held {mixed / rule:.2f}x Dynamo's threshold rule run in the same deployment, but {mixed / pd:.2f}x our own "
        "prefill/decode split;",
        f"the pool held {slack['conductor:conditional'] / slack['conductor:disaggregated']:.2f}x our split in one run, "
        f"and gave back {1 - slack_shared['conductor:conditional'] / s_cap['conductor:conditional']:.0%} on the "
        "shared-prefix workload",
        f"the same pool led: {s_mixed / s_pd:.2f}x our split, which held {s_pd / s_cap['dynamo-pd:kv']:.2f}x Dynamo's, "
        f"and {s_mixed / s_rule:.2f}x Dynamo's threshold rule",
        f"the Conductor held {agent['conductor:disaggregated'] / agent['dynamo-pd:kv']:.2f}x Dynamo's split and "
        f"{agent['conductor'] / agent['dynamo:kv']:.2f}x Dynamo aggregated",
        f"in another run, it held {routers['conductor'] / routers['vllm:cache_aware']:.2f}x vllm-router's "
        "`cache_aware`",
    ]
    _assert_quotes(front, front_claims, "README.md disagrees with bench/results/scale/per-token")
