"""The project's import graph, read from the source (no module is imported): which module imports which.

Every import counts, inside functions and under ``TYPE_CHECKING`` too. Two users: the layer test
(``tests/unit/test_layers.py``: imports go down the layers, no circles) and ``kvconductor bench results``
(the files a benchmark's entry point reaches: the code its committed result measures).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

from bench.provenance import REPO

SOURCES = ("scheduler", "engine", "services", "cli", "bench")  # the project's packages (protos are generated)
# Modules that start processes running other modules (``python -m``, or a module vLLM loads by name): those run
# the code they import too. tests/unit/test_layers.py checks that each source names its targets.
SPAWNS = {
    "cli.local_cluster": ("cli.main",),  # `python -m cli.main up`
    "cli.launcher": ("cli.main",),  # `python -m cli.main serve ROLE`
    "bench.compare.peers": ("bench.compare.vllm_server",),
    "services.worker.engines.vllm_engine": ("services.worker.engines.vllm_connector",),  # kv_connector_module_path
}


@functools.cache
def module_files(root: Path = REPO) -> dict[str, Path]:
    """Module name -> its file, for every module of ``SOURCES``; a C extension maps to its ``.c`` source."""
    modules: dict[str, Path] = {}
    for source in SOURCES:
        for path in (root / source).rglob("*"):
            if path.suffix not in (".py", ".c") or path.name.startswith("test_"):
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            if name != "services":  # the namespace of the processes' packages, empty
                modules[name] = path
    return modules


@functools.cache
def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Python module -> the project modules (or ``from`` names in them) it imports anywhere in its file."""
    graph: dict[str, set[str]] = {}
    for name, path in module_files(root).items():
        if path.suffix != ".py":
            continue
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t.split(".")[0] in SOURCES and t != name}
    return graph


def reached_files(entries: Iterable[str], root: Path = REPO) -> set[Path]:
    """The files of every project module the ``entries`` import, transitively (the entries' own included)."""
    files, graph = module_files(root), import_graph(root)
    seen: set[str] = set()
    todo = [e for e in entries if e in files]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 1)]
        nexts = (*graph.get(module, ()), *parents, *SPAWNS.get(module, ()))
        todo += [m for m in nexts if m in files and m not in seen]
    return {files[m] for m in seen}
