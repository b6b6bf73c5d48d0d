"""The layering the code promises (docs/architecture.md): no import cycles, the engine a library of its own.

The graph is read from the source with ast (no module is imported): an edge for every import statement,
at module level or inside a function, TYPE_CHECKING blocks included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("producer", "worker")
# The engine and what it runs on know nothing of the wire contract, Redis or the queue.
LIBRARY = ("worker.engine", "worker.kernels", "worker.models")
LIBRARY_MAY_NOT_IMPORT = ("producer", "worker.adapter", "worker.config", "worker.jobs", "worker.service",
                          "worker.queue_worker", "worker.health", "worker.cli", "redis", "arq")  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules `name` imports: project modules by their full name, others by their top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)  # `from pkg import module` is an edge to the module
    return {m if m in known else m.split(".")[0] for m in out}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) - {name} for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles() -> None:
    g = graph()
    assert len(g) > 40 and "worker.engine.engine" in g["worker.engine.async_engine"]  # the walk sees edges
    assert cycles(g) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_kernels_and_models_import_nothing_of_the_queue_or_the_contract() -> None:
    bad = [
        f"{mod} -> {dep}"
        for mod, deps in graph().items()
        if mod.startswith(LIBRARY)
        for dep in deps
        if dep.startswith(LIBRARY_MAY_NOT_IMPORT)
    ]
    assert bad == []


def loaded_by(imports: str, tops: tuple[str, ...]) -> list[str]:
    """The modules of packages `tops` that `import <imports>` loads, in a fresh interpreter."""
    code = f"import json, sys, {imports}; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {tops!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_importing_the_engine_loads_neither_the_producer_nor_torch() -> None:
    assert loaded_by("worker.engine", ("producer", "torch", "redis", "arq")) == []


def test_the_full_engine_runs_without_the_producer() -> None:
    assert loaded_by("worker.engine.engine, worker.engine.async_engine", ("producer",)) == []


def test_the_contract_imports_no_torch() -> None:
    assert loaded_by("producer.contract, producer.keys, producer.result_cache", ("torch",)) == []
