"""``kvconductor bench``: registered with the command line through the ``kvconductor.commands`` entry point."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvconductor bench serve``, ``compare``, ``results`` and ``kvconductor plan`` (flags: each module's
    ``add_arguments``; each runs its ``main`` as the parsed arguments' ``plugin_main``)."""
    from bench import freshness, plan
    from bench.compare import cli as compare_cli
    from bench.serve import cli as serve_cli

    bench = sub.add_parser("bench", help="benchmarks: load against an OpenAI-compatible URL, colocated vs. PD")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_ in (
        ("serve", serve_cli, "streaming requests against an OpenAI-compatible base URL: TTFT, TPOT, goodput"),
        ("compare", compare_cli, "colocated baseline vs. disaggregated cluster on the identical workload"),
        ("results", freshness, "the committed results, stale ones flagged (their code changed since); re-run them"),
    ):
        p = kinds.add_parser(name, help=help_, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        module.add_arguments(p)
        p.set_defaults(plugin_main=module.main)
    planner = sub.add_parser(
        "plan",
        help="size a cluster with the simulator: the P:D split, instances and knobs",
        description=plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_arguments(planner)
    planner.set_defaults(plugin_main=plan.main)
