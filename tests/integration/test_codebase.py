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

ROOT = Path(__file__).resolve().parents[2]
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


def test_mypy():
    result = _run(_tool("mypy"), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]


def _module_files() -> dict[str, Path]:
    """Every module of the package by its installed name (``eagleops.pipeline.engine``) and the
    file it is in the tree: ``eagleops/``'s own files, and ``pipeline/`` and ``console/``, which
    it links in."""
    files: dict[str, Path] = {}
    for folder, prefix in (
        (ROOT / "eagleops", ["eagleops"]),
        (ROOT / "pipeline", ["eagleops", "pipeline"]),
        (ROOT / "console", ["eagleops", "console"]),
    ):
        for path in sorted(folder.rglob("*.py")) if folder.name != "eagleops" else sorted(folder.glob("*.py")):
            parts = [*prefix, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _sources() -> list[Path]:
    return sorted(_module_files().values())


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


def _modules(part: str) -> list[str]:
    """The importable modules (``__main__`` aside) of ``pipeline`` or ``console``, by installed name."""
    own = f"eagleops.{part}"
    return [name for name in _module_files() if (name == own or name.startswith(own + ".")) and not name.endswith(".__main__")]


def test_the_engine_never_loads_the_ui():
    """Every engine module, and the command line itself: `--no-tui` never loads Textual."""
    assert (
        _loaded_after_import([*_modules("pipeline"), "eagleops.cli", "eagleops.headless", "eagleops.console.report"], ("textual", "rich"))
        == []
    )


def test_engine_generate_and_protocol_load_no_torch():
    """A generate-only run, an attached console and `eagleops status` never pay for torch."""
    light = [
        m
        for m in _modules("pipeline")
        if m.split(".")[2:3] and m.split(".")[2] in ("engine", "generate", "protocol", "config", "errors", "files", "stages")
    ]
    assert (
        _loaded_after_import(
            [*light, "eagleops.pipeline.training", "eagleops.pipeline.training.context", "eagleops.cli"], ("torch", "transformers")
        )
        == []
    )


def test_run_file_reference_is_the_schema():
    from eagleops.pipeline.config.__main__ import document_with_reference

    reference = (ROOT / "docs" / "run-file.md").read_text()
    stale = "docs/run-file.md is stale: run `python -m eagleops.pipeline.config docs/run-file.md`"
    assert reference == document_with_reference(reference), stale


def _imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that module ``name`` (in ``path``) imports anywhere: at the top, in functions, under TYPE_CHECKING."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
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
    modules = _module_files()
    graph = {name: _imports_of(name, path, set(modules)) - {name} for name, path in modules.items()}
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


def _our_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def test_one_namespace_nothing_imports_pipeline_or_console_bare():
    """``pipeline`` and ``console`` are other PyPI projects' names: everything is ``eagleops.*``
    (in a checkout the bare names would import too, as second copies of the same modules)."""
    files = [*_sources(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]
    bare = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in _our_imports(path)
        if module.split(".")[0] in ("pipeline", "console", "themes")
    ]
    assert bare == []


def test_importing_any_module_sets_no_signal_handler():
    """Signals belong to the entry point (``eagleops.__main__``), never to an import."""
    modules = [m for m in _module_files() if m.rsplit(".", 1)[-1] != "__main__"]
    code = (
        "import importlib, signal\n"
        "calls = []\n"
        "signal.signal = lambda sig, handler: calls.append(sig)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(calls)\n"
    )
    result = _run(sys.executable, "-c", code, "--no-tui", "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_stage_list_exists_once():
    """No module but ``pipeline/stages.py`` writes the stages down in a list of its own."""
    from eagleops.pipeline.stages import STAGE_NAMES

    lists = []
    for path in _sources():
        if path == ROOT / "pipeline" / "stages.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                names = {item.value for item in items if isinstance(item, ast.Constant) and item.value in STAGE_NAMES}
                if len(names) >= 3:
                    lists.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(names)}")
    assert lists == []


def test_only_the_run_layout_spells_the_output_directorys_file_names():
    """``pipeline/layout.py`` names every file of a run once; the rest asks it."""
    names = {"data.jsonl", "failed.jsonl", "manifest.json", "checkpoint.pt", "history.jsonl", "engine.log", ".lock",
             "target-profile.json", "draft_vocab.safetensors", "eval.json", "eval_benchmarks.json", "index.json"}  # fmt: skip
    spelled = []
    for path in _sources():
        if path == ROOT / "pipeline" / "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert spelled == []
