"""The two planes share no code: engine (but engine.server) imports no web framework or console; app imports
neither engine nor torch. Checked on the source, so a lazy import inside a function is caught too."""

from __future__ import annotations

import ast
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
