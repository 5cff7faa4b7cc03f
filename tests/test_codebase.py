"""The house rules, checked: lint and format, import layers, types, sizes, what each layer
loads, and a run-file reference (docs/run-file.md) that is the config schema's own."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_ruff_lint():
    result = _run(_tool("ruff"), "check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format():
    result = _run(_tool("ruff"), "format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout[-4000:]


def test_import_layers():
    """pyproject's contracts: UI never in the engine, layers downwards only, no torch in
    generate/protocol/config, stages independent of each other."""
    result = _run(_tool("lint-imports"))
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.slow
def test_mypy():
    result = _run(_tool("mypy"), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]


def _sources() -> list[Path]:
    return sorted(p for folder in ("pipeline", "console") for p in (ROOT / folder).rglob("*.py"))


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _sources():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (module limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines (function limit {MAX_FUNCTION_LINES})"
                    )
    assert not too_long, "\n".join(too_long)


def _loaded_after_import(modules: list[str], probes: tuple[str, ...]) -> list[str]:
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(p for p in {probes!r} if p in sys.modules))\n"
    )
    result = _run(sys.executable, "-c", code, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [m for m in result.stdout.strip().split(",") if m]


def _modules(folder: str) -> list[str]:
    names = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_the_engine_never_loads_the_ui():
    """Every engine module, and the command line itself: `--no-tui` never loads Textual."""
    assert _loaded_after_import([*_modules("pipeline"), "console.cli"], ("textual", "rich")) == []


def test_engine_generate_and_protocol_load_no_torch():
    """A generate-only run, an attached console and `eagleops status` never pay for torch."""
    light = [
        m
        for m in _modules("pipeline")
        if m.split(".")[1:2] and m.split(".")[1] in ("engine", "generate", "protocol", "config", "errors", "files")
    ]
    assert _loaded_after_import([*light, "pipeline.training", "pipeline.training.context", "console.cli"], ("torch", "transformers")) == []


def test_run_file_reference_is_the_schema():
    from pipeline.config.__main__ import document_with_reference

    reference = (ROOT / "docs" / "run-file.md").read_text()
    stale = "docs/run-file.md is stale: run `python -m pipeline.config docs/run-file.md`"
    assert reference == document_with_reference(reference), stale


def _imports_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that ``path`` imports anywhere: at the top, in functions, under TYPE_CHECKING."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            origin = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                found.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin)
    return {name for name in found if name in known}


def _import_cycles() -> list[list[str]]:
    modules = {name: ROOT / (name.replace(".", "/") + ".py") for name in [*_modules("pipeline"), *_modules("console")]}
    modules = {name: path if path.exists() else path.with_suffix("") / "__init__.py" for name, path in modules.items()}
    graph = {name: _imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


def test_no_module_imports_a_module_that_imports_it_back():
    """Not even under TYPE_CHECKING or inside a function: a cycle is one room split in two."""
    assert _import_cycles() == []
