"""The package's shape: layers import only downward, no import cycles (lazy imports
included), small files, and the engine free of UI libraries.

The layers, top to bottom (docs/architecture.md explains each):
    cli  >  server, tui, bench  >  engine  >  draft, parallel
         >  ipc, placement  >  backends  >  weights  >  speculation, grammar  >  core
A module may import its own package and anything in a lower layer, nothing else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ssdlocal"
LAYERS = (
    {"core"},
    {"speculation", "grammar"},
    {"weights"},
    {"backends"},
    {"ipc", "placement"},
    {"draft", "parallel"},
    {"engine"},
    {"server", "tui", "bench"},
    {"cli"},
)
ROOT_MODULES = {"__init__", "__main__"}  # ssdlocal/__init__.py (version) and the entry point
MAX_LINES = 450
MAX_TOP_MODULES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ssdlocal module `path` imports, at module level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ssdlocal")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("ssdlocal"):
                continue
            found.add(module)
            for alias in node.names:  # `from ssdlocal.x import submodule`
                candidate = f"{module}.{alias.name}"
                if _exists(candidate):
                    found.add(candidate)
    return {m for m in found if _exists(m)}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(top: str) -> int:
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"package ssdlocal.{top} is in no layer: add it to LAYERS")


def test_every_package_is_in_a_layer_and_imports_only_downward():
    bad = []
    for module, imports in _graph().items():
        top = _top(module)
        if top in ROOT_MODULES or module == "ssdlocal":
            continue
        for target in imports:
            other = _top(target)
            if other == top or target == "ssdlocal":
                continue
            if other in ROOT_MODULES:
                continue
            if _rank(other) >= _rank(top):
                bad.append(f"{module} -> {target}")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles_lazy_imports_included():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    # a package __init__ re-exporting its own submodule is not a cycle worth reporting
    cycles = [c for c in cycles if not _only_reexport(c, graph)]
    assert not cycles, f"import cycles: {cycles}"


def _only_reexport(component: list[str], graph: dict[str, set[str]]) -> bool:
    packages = [m for m in component if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").is_file()]
    return len(component) == 2 and len(packages) == 1 and all(m.startswith(packages[0]) for m in component)


def test_files_are_small_and_the_top_level_is_short():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_MODULES, top


TORCH_BACKEND_IMPORTERS = {  # outside backends/, with why
    "parallel": "the torch backend's own tensor-parallel ranks: its loader, model, quantizer and graphs",
}


def test_upper_layers_ask_the_registry_not_backends_torch():
    """What a model file is lives in weights/formats (below backends); what only a backend
    knows (what it will load for a path, its quantized sizes, its heads) is
    asked through backends/registry.py. No module outside backends/ imports backends/torch,
    except the torch backend's own tensor-parallel ranks."""
    offenders = []
    for module, imports in _graph().items():
        rel = module.removeprefix("ssdlocal.").replace(".", "/")
        if _top(module) == "backends" or any(rel == e or rel.startswith(e + "/") for e in TORCH_BACKEND_IMPORTERS):
            continue
        offenders += [f"{module} -> {t}" for t in sorted(imports) if t.startswith("ssdlocal.backends.torch")]
    assert not offenders, "imports of backends/torch from above it:\n" + "\n".join(offenders)


def test_engine_imports_no_ui_library():
    code = (
        "import sys, ssdlocal.engine, ssdlocal.bench.run, ssdlocal.draft.ssd.worker; "
        "bad = [m for m in ('typer', 'rich', 'textual') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docs_and_docstrings_point_inside_the_repository():
    offenders = [
        str(p.relative_to(PACKAGE.parent))
        for p in [
            *PACKAGE.rglob("*.py"),
            *(PACKAGE.parent / "docs").rglob("*.md"),
            *(PACKAGE.parent / "models").rglob("*.toml"),
            PACKAGE.parent / "README.md",
        ]
        if "DESIGN.md" in p.read_text() or "../shared" in p.read_text()
    ]
    assert not offenders, offenders


HOT_PATHS = (
    "engine",
    "draft",
    "grammar",
    "speculation",
    "parallel",
    "backends/torch/runner.py",
    "backends/torch/graphs.py",
    "backends/torch/capture.py",
    "core/verify.py",
    "core/sampling.py",
    "core/logprobs.py",
)
HOST_READS = {"item", "tolist", "cpu"}
HOST_READ_EXCEPTIONS = {
    "engine/auto.py": "the calibration times a step and must wait for the device, once per engine",
    "speculation/ngram.py": "numpy arrays of host tokens",
    "grammar/compiler.py": "compiles grammars on the host, before any round",
}


def test_hot_paths_read_the_device_only_through_the_audit():
    """Every device -> host read of the rounds goes through core/hostsync.py, which counts it:
    no raw `.item()`, `.tolist()` or `.cpu()` in the engine, drafters, grammar guides,
    speculation code, the tensor-parallel ranks, the torch runner's decode path, captured
    graphs and verification."""
    offenders = []
    for hot in HOT_PATHS:
        base = PACKAGE / hot
        for path in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            rel = path.relative_to(PACKAGE).as_posix()
            if rel in HOST_READ_EXCEPTIONS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READS:
                    offenders.append(f"{rel}:{node.lineno} .{node.func.attr}()")
    assert not offenders, "raw host reads outside core.hostsync: " + ", ".join(offenders)
