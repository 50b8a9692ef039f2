"""The tree's layers, lowest first: a module imports only from its own package or from a lower layer.

Packages of one layer never import each other (the five services talk over gRPC, not imports), and no two
modules import each other, counting imports inside functions and under ``TYPE_CHECKING``.
docs/development.md draws the same order.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
SOURCES = ("scheduler", "engine", "services", "cli", "bench")


def _package(module: str) -> str | None:
    """The layered package ``module`` belongs to (the longest listed prefix)."""
    parts = module.split(".")
    for n in (2, 1):
        if ".".join(parts[:n]) in LAYER:
            return ".".join(parts[:n])
    return None


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file."""
    modules = {}
    for source in SOURCES:
        for path in (ROOT / source).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if name != "services":  # the namespace of the processes' packages, empty
                modules[name] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if _package(t) is not None and t != name}
    return graph


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, targets in _imports().items():
        mine = _package(module)
        assert mine is not None, f"{module} is in no layer: add its package to LAYERS"
        for target in targets:
            theirs = _package(target)
            if theirs != mine and LAYER[theirs] >= LAYER[mine]:
                wrong.append(f"{module} ({mine}, layer {LAYER[mine]}) imports {target} ({theirs}, {LAYER[theirs]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_two_modules_import_each_other():
    graph = _imports()
    modules = {m for m in graph}
    edges = {m: {t for t in targets if t in modules} for m, targets in graph.items()}
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
