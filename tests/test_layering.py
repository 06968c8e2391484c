"""Who may import whom (docs/architecture.md): every import in src/pagedllm, at module level or
inside a function, goes down the layers or stays inside its own package, and no two files
import each other round a circle. Reads the sources only; nothing is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top; a unit may import units of lower layers only (and itself).
LAYERS = [
    [
        "config",
        "logger",
        "cpu_info",
        "heap",
        "procs",
        "outputs",
        "sampling_params",
        "pooling_params",
        "lora_request",
        "version",
    ],  # fmt: skip
    ["request"],
    ["sequence"],
    ["core"],
    ["kernels", "kv_calc"],
    ["distributed"],
    ["attention"],
    ["layers"],
    ["models"],
    ["model_loader"],
    ["structured_output"],
    ["sample"],
    ["spec_decode"],
    ["worker"],
    ["executor"],
    ["engine"],
    ["bench", "benchmarks"],
    ["entrypoints"],
    [""],  # the package's __init__: its lazy LLM / LLMEngine
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """pagedllm.core.scheduler -> core; pagedllm -> ''."""
    return module.split(".")[1] if "." in module else ""


def _imports(path: Path, module: str) -> set[str]:
    """The pagedllm modules `path` imports (`from pagedllm import x` counts as pagedllm.x)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pagedllm"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] != "pagedllm":
                continue
            # `from package import module` imports the module; `from module import name`,
            # the module (_graph keeps what exists).
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in (SRC / "pagedllm").rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(path, module):
            while name not in modules and "." in name:  # an attribute: its module
                name = name.rpartition(".")[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module is not in a lower layer (nor in
    the importer's own package)."""
    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if _unit(t) != _unit(m) and RANK[_unit(t)] >= RANK[_unit(m)]
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = iter(range(len(graph) + 1))

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


GRAPH = _graph()


def test_every_unit_has_a_layer():
    assert {_unit(m) for m in GRAPH} <= RANK.keys()


def test_imports_go_down_the_layers():
    assert upward_imports(GRAPH) == []


def test_no_import_circles():
    """Files, within a package as well: a circle means modules that cannot be read (or
    loaded) one without the other."""
    assert circles(GRAPH) == []


def test_the_checks_find_what_they_look_for():
    """An upward import and a circle planted in a copy of the graph are both found."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["pagedllm.core.scheduler"].add("pagedllm.engine.llm_engine")
    assert ("pagedllm.core.scheduler", "pagedllm.engine.llm_engine") in upward_imports(planted)
    assert any(
        {"pagedllm.core.scheduler", "pagedllm.engine.llm_engine"} <= set(c)
        for c in circles(planted)
    )


def long_files(root: Path, limit: int = 500) -> list[tuple[str, int]]:
    """Source files (Python, C++, headers) of more than `limit` lines under `root`."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "egg-info" not in str(path):
            lines = path.read_text().count("\n")
            if lines > limit:
                found.append((str(path.relative_to(root)), lines))
    return found


def test_files_do_one_job(tmp_path):
    """No source file in src/ over 500 lines (a sign of a file with several jobs); the check
    finds a file planted over the limit."""
    assert long_files(SRC) == []
    (tmp_path / "big.cpp").write_text("//\n" * 501)
    assert long_files(tmp_path) == [("big.cpp", 501)]


def modules_importing_torch(modules: list[str]) -> list[str]:
    """Those of `modules` that import torch, each imported alone in a fresh interpreter."""
    code = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); print('torch' in sys.modules)"
    )
    found = []
    for module in modules:
        result = subprocess.run(
            [sys.executable, "-c", code, module], capture_output=True, text=True, check=True
        )
        if result.stdout.strip() == "True":
            found.append(module)
    return found


def test_the_api_process_imports_no_torch():
    """What `pagedllm serve` imports in its own process when the engine runs in another (the
    default): no torch, which only the engine's process needs (start-up and memory,
    docs/performance.md). The check finds torch where it is: the engine imports it."""
    api_side = [
        "pagedllm.entrypoints.cli",
        "pagedllm.entrypoints.openai.api_server",
        "pagedllm.engine.core_client",
        "pagedllm.engine.dp_client",
        "pagedllm.model_loader",
        "pagedllm.models",
    ]
    assert modules_importing_torch([*api_side, "pagedllm.engine.llm_engine"]) == [
        "pagedllm.engine.llm_engine"
    ]
