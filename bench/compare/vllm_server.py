"""A stock vLLM OpenAI server running the engine one kvconductor worker runs, for third-party PD routers.

    python -m bench.compare.vllm_server --config deploy/vllm.toml --role prefill --port 8100

``vllm-router``'s prefill/decode mode drives vLLM servers over HTTP, passing ``kv_transfer_params`` in
the request body; our workers speak gRPC to the Conductor, so that router cannot drive them. This process
is vLLM's own OpenAI server (``vllm.entrypoints.launchers``) with the engine arguments our worker builds
for the same config and role (``services.worker.engines.vllm_engine.engine_arguments``: model, dtype, block size,
KV cache bytes, batch limits, the MooncakeConnector with its CPU shim), so the comparison changes the front
end and nothing else. A prefill server prints its Mooncake bootstrap port on stdout (``bootstrap_port=N``).
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    """Parse our flags, build vLLM's server arguments, serve until SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m bench.compare.vllm_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="kvconductor config (the [engine] backend is taken as vllm)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--role", choices=("prefill", "decode", "colocated"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--instance-id", help="vLLM engine id (default vllm-ROLE-PORT)")
    args = p.parse_args(argv)

    from services.common.config import load_config

    config = load_config(args.config, [*args.set, 'engine.backend="vllm"', f'cluster.host="{args.host}"'])
    pool = getattr(config, args.role)
    threads = str(pool.torch_threads)  # as `kvconductor up` starts a worker: before torch is imported
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1")

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from services.worker.engines.vllm_engine import engine_arguments

    instance_id = args.instance_id or f"vllm-{args.role}-{args.port}"
    arguments, bootstrap = engine_arguments(config, args.role, instance_id, pool, None)
    if bootstrap:
        print(f"bootstrap_port={os.environ['VLLM_MOONCAKE_BOOTSTRAP_PORT']}", flush=True)
    server_args = make_arg_parser(FlexibleArgumentParser()).parse_args(  # type: ignore[no-untyped-call]
        ["--host", args.host, "--port", str(args.port), "--disable-uvicorn-access-log"]
    )
    for key, value in arguments.items():
        setattr(server_args, key, value)
    validate_parsed_serve_args(server_args)
    uvloop.run(run_server(server_args))


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is required
    main()
