"""The tree's layers, lowest first: a module imports only from its own package or from a lower layer.

Packages of one layer never import each other (the five services talk over gRPC, not imports), and no two
modules import each other, counting imports inside functions and under ``TYPE_CHECKING``.
docs/development.md draws the same order.
"""

from bench.imports import SPAWNS, import_graph, module_files

LAYERS = [
    {"kvconductor"},  # protos/: the generated messages and stubs
    {"scheduler"},  # the Conductor's core: pure decisions, cost models, profiles
    {"scheduler.sim", "engine"},  # the simulator; the built-in engine (the emulated one runs a cost model)
    {"services.common"},  # what every process shares: config, rpc, registry, metrics, access
    {"services.kvmeta", "services.store", "services.conductor", "services.worker", "services.gateway"},
    {"cli"},  # composes processes (a colocated worker's OpenAI endpoint too) and the command line
    {"bench"},
]
LAYER = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def _package(module: str) -> str | None:
    """The layered package ``module`` belongs to (the longest listed prefix)."""
    parts = module.split(".")
    for n in (2, 1):
        if ".".join(parts[:n]) in LAYER:
            return ".".join(parts[:n])
    return None


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, targets in import_graph().items():
        mine = _package(module)
        assert mine is not None, f"{module} is in no layer: add its package to LAYERS"
        for target in targets:
            theirs = _package(target)
            if theirs != mine and LAYER[theirs] >= LAYER[mine]:
                wrong.append(f"{module} ({mine}, layer {LAYER[mine]}) imports {target} ({theirs}, {LAYER[theirs]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_two_modules_import_each_other():
    graph = import_graph()
    edges = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    circles = []
    for start in edges:  # a depth-first walk from each module back to itself (the graph is small)
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    circles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def test_the_graph_sees_function_level_imports_and_every_spawned_module():
    graph, files = import_graph(), module_files()
    assert "services.worker.engines.vllm_start" in graph["services.worker.worker"]  # imported inside a function
    assert files["services.worker.kv._bind_guard"].suffix == ".c"  # a C extension is its source
    for source, targets in SPAWNS.items():
        text = files[source].read_text()
        for target in targets:
            assert f'"{target}"' in text or f'"-m", "{target}"' in text, f"{source} no longer starts {target}"
