"""The ``kvconductor`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

from cli.serve import ROLES
from services.common.api_keys import use_api_key
from services.common.config import Config, ConfigError, check_trust, exposed_addresses, load_config
from services.common.rpc import Tls, use_tls

DESCRIPTION = """\
kvconductor: KVCache-centric, prefill/decode-disaggregated LLM serving with a global scheduler.

  kvconductor up --config deploy/config.toml            whole local cluster (embedded etcd), until Ctrl-C
  kvconductor serve prefill --config C --id prefill-0   one process, for multi-machine deployments
  kvconductor status --config C                         instances, load, cost models, prediction errors
  kvconductor explain REQUEST_ID --config C             why the Conductor placed (or refused) a request
  kvconductor make-model --out models/tiny-llama        the small random-weight model of the tests
  kvconductor generate --cluster --prompt "Hello"       one prompt through the running cluster's Conductor
  kvconductor generate --model M --prompt "Hello"       one prompt through the engine in this process
  kvconductor bench serve --base-url URL --model M      streaming load against any OpenAI-compatible URL
  kvconductor bench compare [--sweep]                   colocated vs. disaggregated on the same workload
  kvconductor plan --rate 6 --ttft-slo-ms 5000 --tbt-slo-ms 300   the smallest cluster for a rate (simulated)
"""
PLUGIN_GROUP = "kvconductor.commands"  # entry points: callables that add a subcommand to the parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (defaults apply to every missing key)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config key, e.g. --set prefill.node_count=2 (repeatable)",
    )  # fmt: skip


def _add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands other packages add (``bench`` does) through the ``kvconductor.commands`` entry points."""
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        entry.load()(sub)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconductor", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a whole local cluster and serve until Ctrl-C")
    _add_config_args(up)
    up.add_argument("--run-dir", help="directory for the log files (default: [cluster] run_dir/<timestamp>)")

    serve = sub.add_parser("serve", help="run one process of the cluster")
    serve.add_argument("role", choices=list(ROLES))
    serve.add_argument("--id", required=True, help="instance id, unique in the cluster (e.g. prefill-0)")
    _add_config_args(serve)

    status = sub.add_parser("status", help="instances, their load and their fitted cost models")
    status.add_argument(
        "--window-s", type=float, default=0.0,
        help="prediction errors and latencies over requests of the last N seconds (default 300)",
    )  # fmt: skip
    _add_config_args(status)

    explain = sub.add_parser("explain", help="the scheduling decision of a recent request: candidates and reason")
    explain.add_argument("request_id", help="the request id (x-request-id, or the id in the response)")
    _add_config_args(explain)

    roles = sub.add_parser(
        "etcd-roles",
        help="give each kvconductor role an etcd user that writes only its own records, and turn etcd's auth on",
        description="Run once against an etcd with TLS and client-certificate auth, presenting the certificate "
        "of etcd's root user (CN=root) as [cluster] etcd_cert_file/etcd_key_file. Each process then logs in with "
        "its own certificate (CN=ROLE): see docs/security.md.",
    )  # fmt: skip
    _add_config_args(roles)

    make = sub.add_parser("make-model", help="write the small random-weight model the tests use (Hugging Face layout)")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")

    gen = sub.add_parser(
        "generate", help="one prompt: through a running cluster (--cluster) or the engine in this process (--model)"
    )
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="run the engine in this process on this Hugging Face folder")
    where.add_argument("--cluster", action="store_true", help="send it to the Conductor of --config / --set")
    gen.add_argument(
        "--deployment",
        choices=["auto", "disaggregated", "colocated", "conditional"],
        default="auto",
        help="serving path (--cluster); conditional: each request prefills on a prefill worker or on its colocated "
        "decode worker, by [scheduler] disaggregation",
    )
    _add_config_args(gen)
    gen.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text (tokenized without BOS)")
    gen.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="temperature; 0 is greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sample from the top tokens of mass P")
    gen.add_argument("--seed", type=int, metavar="S", help="sampling seed: the same seed gives the same output")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (--model)")
    gen.add_argument("--json", action="store_true", help="print JSON: prompt and output token ids, text, finish reason")
    _add_plugin_commands(sub)
    return parser


def _setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _check_trust(config: Config, role: str) -> None:
    """Refuse an exposed address without its credential (ConfigError); warn when the opt-out allows it."""
    check_trust(config, role)
    exposed = exposed_addresses(config, role)
    if config.cluster.insecure_network and exposed:
        logging.getLogger("kvconductor.security").warning(
            "[cluster] insecure_network = true: %s reachable from the network without the credentials the "
            "trust model asks for (mutual TLS, etcd TLS, API keys); anyone on the network can call them",
            ", ".join(f"{key} {host}" for key, host in exposed),
        )


def _cluster_command(args: argparse.Namespace, config: Config) -> int:
    """The commands that run a cluster, or a part of one, or ask a running one."""
    if args.command == "up":
        from cli.launcher import up

        _setup_logging(config.telemetry.log_level, "up")
        _check_trust(config, "up")
        return up(args.config, args.set, args.run_dir)
    if args.command == "serve":
        from cli.serve import run

        _setup_logging(config.telemetry.log_level, args.id)
        _check_trust(config, args.role)
        return run(config, args.role, args.id)
    if args.command == "generate":
        from cli.client import generate_main as generate_remote

        return generate_remote(args, config)
    from cli.status import print_decision, print_status

    if args.command == "explain":
        return print_decision(config, args.request_id)
    return print_status(config, args.window_s)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvconductor`` console script."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "make-model":
            from engine.checkpoint import make_model

            make_model(args.out, seed=args.seed)
            print(f"wrote {args.out}")
            return 0
        if args.command == "generate" and args.model:
            from engine.generate_cli import main as generate_main

            return generate_main(args)
        if getattr(args, "plugin_main", None) is not None:  # bench, plan (bench/commands.py)
            return int(args.plugin_main(args))
        config = load_config(args.config, args.set)
        # whose certificate this process presents
        role = {"serve": getattr(args, "role", ""), "etcd-roles": "root"}.get(args.command, "admin")
        config.cluster = c = config.cluster.for_role(role)
        if args.command == "etcd-roles":
            from cli.etcd_roles import main as etcd_roles

            return etcd_roles(config)
        use_tls(Tls.from_files(c.tls_cert_file, c.tls_key_file, c.tls_ca_file, c.tls_server_name))
        use_api_key(config)
        return _cluster_command(args, config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
