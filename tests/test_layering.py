"""The package's floors: a module never imports one of a higher floor, and no modules import
each other in a circle. Every import is read from the source with `ast`, function-local and
`TYPE_CHECKING` ones included, so a lazy import cannot hide an upward call. The benchmarks sit
outside: the package imports nothing from them, and their scripts use the public API only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specserve"
SCRIPTS = ROOT / "benchmarks" / "scripts"
# what a benchmark script may import: the facade (`LLM`, `SamplingParams`, ...) and the
# benchmark's shipped prompts; anything else it needs goes through the CLI or the HTTP API
PUBLIC = {"specserve", "specserve.bench.workloads", "specserve.bench.request_pool",
          "specserve.bench.tasks", "specserve.bench.checkers", "specserve.bench.humaneval",
          "specserve.bench.sse"}  # the API, the shipped tasks and the stream reader

# lowest first; a module may import its own floor and the floors below it
LAYERS = [
    {"paths", "options", "flags", "json_depth"},  # the cache root; how an option and its flag are
    # declared; how deep JSON may nest
    {"kernels"},  # the native C kernels
    {"hub"},  # fetching and verifying model files
    {"models"},  # the runtime model: transformer, attention, KV cache, tokenizer
    {"weights"},  # file formats, quantization, the weight cache, load_model
    {"sampling"},  # sampling parameters, processors, the rejection sampler
    {"speculative"},  # drafters, policies, speculative metrics
    {"engine"},  # the engine core: request records, scheduler, runner, the step
    {"clients"},  # the async engine (a thread that owns the core) and the client protocol
    {"default_speculation"},  # the default speculation, for LLM() and for the commands
    {"config", "inputs"},  # the LLM's configuration tree; checks of what the API is handed
    {"llm"},  # the Python API
    {"server", "bench", "demo"},  # the front ends
    {"cli"},  # the command
    {"__main__", "reference"},  # `python -m specserve`; the options' reference page
]
FLOOR = {name: i for i, names in enumerate(LAYERS) for name in names}
FACADE = "specserve"  # the package's __init__: re-exports the API, lazily


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def absolute_imports(path: Path) -> set[str]:
    """Every module name `path` imports absolutely (`from a.b import c`: `a.b` and `a.b.c`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules `path` imports (`from specserve import kernels` names the module
    `specserve.kernels`)."""
    out = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & known
            out |= submodules
            if len(submodules) < len(node.names):  # names defined in `base` itself
                out.add(base)
    return {m for m in out if m == FACADE or m.startswith(FACADE + ".")}


def floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOOR.get(parts[1]) if len(parts) > 1 else None


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {m: {i for i in imports(p, known) if i in known} - {m} for m, p in found.items()}


def test_every_module_has_a_floor():
    missing = sorted(m for m in modules() if m != FACADE and floor(m) is None)
    assert not missing, f"add these to LAYERS: {missing}"


def test_no_module_imports_a_higher_floor_or_the_facade():
    upward = []
    for module, targets in graph().items():
        if module == FACADE:
            continue
        for target in targets:
            if target == FACADE or floor(target) > floor(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    g = graph()
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(g[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(g):
        if m not in state and m != FACADE:
            visit(m, [m])
    assert not circles, "\n".join(circles)


def test_the_package_imports_nothing_from_the_benchmarks():
    found = sorted(f"{m} imports {i}" for m, p in modules().items()
                   for i in absolute_imports(p) if i.split(".")[0] == "benchmarks")
    assert not found, "\n".join(found)


def test_benchmark_scripts_use_the_public_api_only():
    import specserve

    scripts = sorted(SCRIPTS.glob("*.py"))
    assert scripts, f"no scripts under {SCRIPTS}"
    known = set(modules())
    for path in scripts:
        used = imports(path, known)
        assert used <= PUBLIC, f"{path.name} imports {sorted(used - PUBLIC)}"
        names = {a.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module == FACADE
                 for a in node.names}
        assert names <= set(specserve.__all__), f"{path.name} imports {sorted(names)}"


def test_the_reader_sees_function_local_and_relative_imports(tmp_path):
    """The checks above can fail: a lazy import inside a function is an import too."""
    pkg = tmp_path / "specserve" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def f():\n    from specserve.llm import LLM\n"
                                     "    from . import attention\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "specserve"
    try:
        found = imports(pkg / "__init__.py", {"specserve.llm", "specserve.kernels.attention"})
    finally:
        PACKAGE = saved
    assert {"specserve.llm", "specserve.kernels.attention"} <= found
    assert floor("specserve.llm") > floor("specserve.kernels")
