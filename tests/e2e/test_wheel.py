"""The package as a user gets it: a wheel built from the tree, installed non-editable into a fresh
venv, and the console started from there with the theme the wheel carries."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
THEME_FILES = ("base.tcss", "dark.tcss", "light.tcss")
# what the build reads; copied so that building leaves no build/ or egg-info in the tree
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "eagleops", "console", "pipeline", "themes")

# Runs in the venv: the console headless on a link with no engine, its stylesheet read back, q to leave.
START_CONSOLE = """
import asyncio, json, sys
import eagleops.console as console
from eagleops.console.app import EagleOpsApp
from eagleops.console.panes import ServerPane

class NoEngine:
    attached = True
    description = "wheel check"
    async def start(self): pass
    async def events(self):
        return
        yield
    async def send(self, command): raise AssertionError(command)
    async def detail(self, name): return {}
    async def stop(self): pass
    def exit_code(self): return None

async def main():
    app = EagleOpsApp(NoEngine(), theme="light")
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        seen = {
            "console": console.__file__,
            "css": [str(path) for path in app.css_path],
            "server_pane_width": str(app.query_one(ServerPane).styles.width),
            "background": app.screen.styles.background.hex,
        }
        await pilot.press("q")
        await pilot.pause()
    seen["exit"] = app.return_code
    print(json.dumps(seen))

asyncio.run(main())
"""


def _build_flags() -> list[str]:
    """Build with this interpreter's setuptools when it can make a wheel itself (bdist_wheel is
    built in from 70.1), which needs no index; otherwise in pip's isolated build environment."""
    try:
        own = Version(version("setuptools"))
    except PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if own >= Version("70.1") else []


def _run(argv: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing from the checkout
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.timeout(600)
def test_the_wheel_installs_and_its_console_starts_with_its_theme(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *_build_flags(), "-w", str(wheels), str(source)], cwd=tmp_path)
    (wheel,) = wheels.glob("eagleops-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"eagleops/themes/{name}" for name in THEME_FILES} <= names
    assert {"eagleops/__main__.py", "eagleops/pipeline/engine/engine.py", "eagleops/console/app.py"} <= names
    # one namespace: nothing else lands on sys.path (pipeline and console are other PyPI projects' names)
    assert {name.split("/")[0] for name in names if not name.startswith("eagleops-")} == {"eagleops"}

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    installed = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path).stdout.strip())
    # torch, textual, pip and the rest come from the site-packages this interpreter sees (a venv's
    # too, which --system-site-packages would miss), after the venv's own: eagleops from the wheel
    outer = "".join(f"import site; site.addsitedir({folder!r})\n" for folder in site.getsitepackages())
    (installed / "_tests_site_packages.pth").write_text(outer)
    _run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"  # not the checkout: `import eagleops` must not find it there
    elsewhere.mkdir()
    seen = json.loads(_run([str(python), "-c", START_CONSOLE], cwd=elsewhere).stdout.strip().splitlines()[-1])
    assert Path(seen["console"]).is_relative_to(installed), seen["console"]
    assert [Path(css).relative_to(installed).as_posix() for css in seen["css"]] == [
        "eagleops/themes/base.tcss",
        "eagleops/themes/light.tcss",
    ]
    assert seen["server_pane_width"] == "2fr"  # base.tcss
    assert seen["background"] == "#FAFAFA"  # light.tcss
    assert seen["exit"] == 0  # q detached from the (absent) engine and closed the console

    assert "usage: eagleops" in _run([str(venv / "bin" / "eagleops"), "--help"], cwd=elsewhere).stdout
    assert "torchrun" in _run([str(python), "-m", "eagleops", "--help"], cwd=elsewhere).stdout
