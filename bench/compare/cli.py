"""``kvconductor bench compare``: the seed's validation, colocated baseline vs. disaggregated, side by side.

    kvconductor bench compare                        # 20 shared-prefix chat requests, c=1 and c=4
    kvconductor bench compare --requests 40 --concurrency 1 2 8 --out /tmp/compare
    kvconductor bench compare --sweep                # tuning order on the disaggregated cluster
    kvconductor bench compare --routers --requests 30 --num-prefixes 3   # Conductor vs. sglang/vllm routers
    kvconductor bench compare --engine vllm --routers   # the same on vLLM workers
    kvconductor bench compare --engine emulated --routers --request-rates 1 2 4   # 16 emulated GPU workers

Both clusters run the same number of worker processes with the same torch threads (colocated: two
colocated workers; disaggregated: one prefill and one decode worker) and get the identical workload:
by default the seed's steps 1-3, 20 streaming chat requests over 2 shared 512-token prefixes, at
concurrency 1 (the seed's sequential runs) and 4 (some interference between prefill and decode). Each
cluster starts cold. Writes ``compare.json``, ``compare.md`` and ``compare.png`` under ``--out``
(``sweep.*`` with ``--sweep``); cluster logs stay under ``runs/``. ``--routers`` puts one colocated
cluster's workers behind our gateway and behind third-party routers from PyPI, one after the other
(``bench/compare/routers.py`` describes it), and writes ``routers.*``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.compare import report
from bench.compare.cluster import colocated, disaggregated
from bench.compare.measure import measure
from bench.compare.routers import DEFAULT_CONTENDERS
from bench.provenance import command_line, fresh_out, git_state
from bench.serve.cli import add_slo_arguments, add_workload_arguments
from bench.serve.metrics import jsonable
from cli.local_cluster import REPO, TINY_MODEL

DEFAULT_OUT = "a fresh folder under runs/bench/"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench compare``."""
    p.add_argument("--out", help=f"output directory (default {DEFAULT_OUT}; bench/results/compare to update those)")
    p.add_argument("--config", help="cluster config (default deploy/config.toml; deploy/vllm.toml with --engine vllm)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for both clusters (repeatable)",
    )
    p.add_argument(
        "--model",
        help="served model name (default tiny-llama, a small random model; SmolLM2-135M-Instruct with --engine vllm)",
    )
    p.add_argument(
        "--engine",
        choices=("builtin", "vllm", "emulated"),
        default="builtin",
        help="worker engine of every cluster ([engine] backend; vllm serves the config's real model; emulated: "
        "deploy/emulated.toml's GPU profile on 16 worker slots)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="worker slots of every deployment: N colocated, or N/2 prefill + N/2 decode (default 2; 16 emulated)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        metavar="P",
        help="prefill workers of a disaggregated deployment's slots, the rest decode (default half)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4],
        metavar="C",
        help="closed-loop levels run on each cluster (default 1 4)",
    )
    p.add_argument("--sweep", action="store_true", help="tuning sweep on the disaggregated cluster instead")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    r = p.add_argument_group("peer routers (--routers)")
    r.add_argument(
        "--routers", action="store_true", help="Conductor vs. sglang-router / vllm-router on one colocated cluster"
    )
    r.add_argument(
        "--contenders",
        nargs="+",
        metavar="SPEC",
        help="conductor, conductor:disaggregated, conductor:conditional (prefill workers beside colocated ones) or "
        "ROUTER:POLICY (ROUTER: sglang, vllm, vllm-pd, dynamo, dynamo-pd; default "
        f"{' '.join(DEFAULT_CONTENDERS['builtin'])}; with --engine vllm {' '.join(DEFAULT_CONTENDERS['vllm'])})",
    )
    r.add_argument("--cluster-json", help="use this running cluster's cluster.json instead of starting one")
    r.add_argument(
        "--request-rates",
        type=float,
        nargs="+",
        metavar="R",
        help="open-loop levels instead of --concurrency: Poisson arrivals at R requests/s (a rate sweep)",
    )
    r.add_argument(
        "--capacity",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        help="instead of fixed levels, bisect each contender's SLO capacity (90%% of requests within SLO) between LO "
        "and HI requests/s to within --tolerance (bench/compare/capacity.py)",
    )
    r.add_argument("--tolerance", type=float, default=0.05, help="--capacity's precision (default 0.05: 5%%)")
    r.add_argument("--repeats", type=int, default=1, help="--capacity's bisections per contender (default 1)")
    add_workload_arguments(p, requests_flag="--requests")
    add_slo_arguments(p, default="the config's prefill.max_ttft_ms and decode.max_tbt_ms, as the Conductor admits")


def slo_defaults(args: argparse.Namespace) -> None:
    """Unset TTFT and TBT limits of goodput: the ones the cluster's Conductor admits by (config plus ``--set``)."""
    from services.common.config import load_config

    config = load_config(args.config, args.set)
    if args.ttft_slo_ms is None:
        args.ttft_slo_ms = float(config.prefill.max_ttft_ms)
    if args.tbt_slo_ms is None:
        args.tbt_slo_ms = float(config.decode.max_tbt_ms)


def _labelled(measurements: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"colocated c=1": summary, "disaggregated c=1": summary, ...}``, levels interleaved."""
    levels = next(iter(measurements.values()))["levels"]
    return {f"{name} {level}": m["levels"][level]["summary"] for level in levels for name, m in measurements.items()}


def compare(args: argparse.Namespace, out: Path, root: Path) -> dict[str, Any]:
    """Both clusters, one after the other; writes the outputs; the JSON record."""
    t0, code = time.monotonic(), git_state()
    measurements = {
        name: measure(args, name, overrides, args.concurrency, root / name)
        for name, overrides in (
            ("colocated", colocated(args.workers)),
            ("disaggregated", disaggregated(args.workers, args.prefill_workers)),
        )
    }
    runs = _labelled(measurements)
    record = {"kind": "compare", "code": code, "command": args.command_line, "wall_s": time.monotonic() - t0,
              "table": runs, "clusters": measurements}  # fmt: skip
    title = (f"bench compare: {args.workload}, {args.num_requests} requests, 2 workers x 1 torch thread "
             "(blue colocated, orange disaggregated)")  # fmt: skip
    (out / "compare.json").write_text(json.dumps(jsonable(record), indent=2, default=str) + "\n")
    (out / "compare.md").write_text(
        f"{title}; code {record['code']}; `{record['command']}`\n\n{report.markdown_table(runs)}"
    )
    report.plot(runs, out / "compare.png", title)
    print(report.text_table(runs))
    return record


def run_sweep(args: argparse.Namespace, out: Path, root: Path) -> dict[str, Any]:
    """The tuning sweep; writes ``sweep.json`` and ``sweep.md``."""
    from bench.compare.sweep import markdown, sweep

    t0, code = time.monotonic(), git_state()
    result = sweep(args, root)
    record = {"kind": "sweep", "code": code, "command": args.command_line, "wall_s": time.monotonic() - t0, **result}
    (out / "sweep.json").write_text(json.dumps(jsonable(record), indent=2, default=str) + "\n")
    (out / "sweep.md").write_text(f"Code {code}; `{args.command_line}`\n\n{markdown(result)}")
    print(markdown(result))
    return record


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace) -> int:
    """Run ``bench compare``; 0 on success, 1 on a clear error."""
    args.command_line = command_line()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the clusters and routers it started, as on Ctrl-C
    # builtin: a small random model (fast to start, nothing to convert); vllm: the config's real model
    # (deploy/vllm.toml: SmolLM2-135M-Instruct, 32-token blocks); the user's --set overrides come last.
    vllm, emulated = args.engine == "vllm", args.engine == "emulated"
    args.config = args.config or str(REPO / f"deploy/{'config' if args.engine == 'builtin' else args.engine}.toml")
    args.model = args.model or ("SmolLM2-135M-Instruct" if vllm else "tiny-llama")
    args.model_overrides = {"vllm": ('engine.backend="vllm"',), "emulated": (*TINY_MODEL, 'engine.backend="emulated"'),
                            "builtin": TINY_MODEL}[args.engine]  # fmt: skip
    args.workers = args.workers or (16 if emulated else 2)
    if args.workers < 2:
        print("error: --workers must be at least 2", file=sys.stderr)
        return 1
    if args.capacity and not args.routers:
        print("error: --capacity needs --routers", file=sys.stderr)
        return 1
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 1
    args.contenders = args.contenders or list(DEFAULT_CONTENDERS[args.engine])
    slo_defaults(args)
    out = Path(args.out or fresh_out("compare"))
    out.mkdir(parents=True, exist_ok=True)
    root = REPO / "runs" / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if args.routers:
            from bench.compare import routers

            record = routers.main(args, out, root, git_state())
        else:
            record = (run_sweep if args.sweep else compare)(args, out, root)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}/{record['kind']}.{{json,md{',png' if record['kind'] != 'sweep' else ''}}} "
          f"in {record['wall_s']:.0f} s; cluster logs under {root}")  # fmt: skip
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.compare.cli", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
