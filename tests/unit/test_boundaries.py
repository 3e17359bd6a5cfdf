"""The two planes share no code: engine (but engine.server) imports no web framework or console; app imports
neither engine nor torch. Checked on the source, so a lazy import inside a function is caught too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEB_STACK = {"litestar", "uvicorn", "starlette", "fastapi", "flask", "aiohttp", "httpx", "sqlmodel", "app"}
ENGINE_STACK = {"engine", "torch", "triton", "safetensors", "tokenizers", "transformers"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _sources(package: str, exclude: str | None = None) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    if exclude:
        files = [f for f in files if exclude not in f.relative_to(ROOT).parts]
    assert files, f"no sources found under {package}/"
    return files


@pytest.mark.parametrize("path", _sources("engine", exclude="server"), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_core_imports_no_web_stack(path):
    assert not (_imported_roots(path) & WEB_STACK), f"{path} imports {_imported_roots(path) & WEB_STACK}"


@pytest.mark.parametrize("path", _sources("app"), ids=lambda p: str(p.relative_to(ROOT)))
def test_console_imports_no_engine(path):
    assert not (_imported_roots(path) & ENGINE_STACK), f"{path} imports {_imported_roots(path) & ENGINE_STACK}"


# The console's domains (a folder each under app/) import each other in one direction only: audit, then auth, then
# profiles and telemetry, engine_control, qualification, promotion, route. What a lower domain needs from a higher one
# is passed in from app/main.py (ProfileFacts, RunReading, the switch's smoke, the audit pages' guard).
APP = ROOT / "app"
DOMAINS = sorted(p.name for p in APP.iterdir() if (p / "__init__.py").is_file())
# The composition root wires every domain; the rest of app/*.py are primitives every domain may use.
COMPOSITION = {"main.py", "__main__.py"}


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _domains_imported(path: Path) -> set[str]:
    return {m.split(".")[1] for m in _imported_modules(path) if m.startswith("app.") and m.split(".")[1] in DOMAINS}


def _domain_graph() -> dict[str, dict[str, list[str]]]:
    """For each domain, the domains it imports and the files that do."""
    graph: dict[str, dict[str, list[str]]] = {d: {} for d in DOMAINS}
    for domain in DOMAINS:
        for path in sorted((APP / domain).rglob("*.py")):
            for other in _domains_imported(path) - {domain}:
                graph[domain].setdefault(other, []).append(str(path.relative_to(ROOT)))
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_console_domains_import_each_other_in_one_direction():
    assert len(DOMAINS) >= 8, DOMAINS
    graph = _domain_graph()
    cycle = _cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:], strict=False)]
        pytest.fail("the domains import each other in a circle: " + "; ".join(edges))


@pytest.mark.parametrize("path", sorted(p for p in APP.glob("*.py") if p.name not in COMPOSITION), ids=lambda p: p.name)
def test_the_shared_console_modules_import_no_domain(path):
    # db.py, errors.py, settings.py, logging.py, console.py: below every domain.
    assert not _domains_imported(path), f"{path.name} imports the domains {_domains_imported(path)}"


def test_the_cycle_check_finds_a_circle_through_three_domains():
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": ["x"]}, "b": {}}) is None


# Inside the engine: kernels are leaves (each imports only other kernels, besides torch, triton and the standard
# library), and the model reads the tables a step hands it, never the block manager that hands out pages and slots.
KERNEL_MAY_IMPORT = {"torch", "triton"}


@pytest.mark.parametrize("path", _sources("engine/kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_only_kernels(path):
    engine = {m for m in _imported_modules(path) if m.split(".")[0] == "engine"}
    outside = {m for m in engine if not m.startswith("engine.kernels")}
    foreign = _imported_roots(path) - KERNEL_MAY_IMPORT - {"engine", "__future__"} - set(sys.stdlib_module_names)
    assert not outside and not foreign, f"{path} imports {outside | foreign}"


@pytest.mark.parametrize("path", _sources("engine/model"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_model_does_not_import_the_block_manager(path):
    assert not any(m.startswith("engine.cache.block_manager") for m in _imported_modules(path)), path


# Weights: only a layer's weight format converts or multiplies a stored tensor; the loader and the checkpoint tools
# map names to layers and never touch a tensor's format themselves.
WEIGHT_CONVERTERS = ("engine.kernels.quant", "engine.kernels.moe", "torch.nn.functional")


@pytest.mark.parametrize("path", [ROOT / "engine/model/loader.py", ROOT / "engine/model/weights.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))  # fmt: skip
def test_the_loader_leaves_conversion_to_the_weight_formats(path):
    converters = {m for m in _imported_modules(path) if m.startswith(WEIGHT_CONVERTERS)}
    assert not converters, f"{path} imports {converters}"


@pytest.mark.parametrize("path", _sources("engine/model"), ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_build_linears_through_the_linear_layers(path):
    """Every projection is one of engine/model/linear.py's layers (which own a weight format), never a bare
    nn.Linear whose weight someone would have to know the format of."""
    source = path.read_text()
    assert "nn.Linear(" not in source and "F.linear(" not in source or path.name == "weight_formats.py", path
