"""The Textual console: keys -> commands, events -> panes, modals, no-GPU, snapshots, attach."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.text import Text
from textual.widgets import Static

from eagleops.console.app import EagleOpsApp
from eagleops.console.keymap import KEYMAP, help_rows, markdown_table
from eagleops.console.link import SocketLink
from eagleops.console.panes import DatasetsTable, GpuPane, ServerPane, StagesPane
from eagleops.console.screens import HELP, ConfirmScreen, DetailScreen, HelpScreen
from eagleops.console.session import LocalLink
from eagleops.pipeline.engine import Engine
from eagleops.pipeline.engine.telemetry import NvmlReader, server_metrics
from eagleops.pipeline.protocol.control import ControlClient
from eagleops.pipeline.protocol.events import (
    Ack,
    DatasetProgress,
    DatasetState,
    EndpointStats,
    GpuStats,
    HostStats,
    Kill,
    LogEvent,
    Pause,
    Resume,
    RunPhase,
    RunState,
    ServerMetrics,
    SetBudget,
    StageState,
    StageStatus,
)
from eagleops.pipeline.servers.metrics import parse_prometheus
from tests.conftest import make_config, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
AT = 1_780_000_000.0  # a fixed wall-clock time, so logged times are stable


def _at() -> float:
    return AT


@pytest.fixture(autouse=True)
def _utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


def _datasets() -> list[DatasetProgress]:
    return [
        DatasetProgress(
            "B1", DatasetState.DONE, 10_020_000, 10_000_000, 18_211, req_per_s=0.0, tok_per_s=0.0, reason="budget reached", at=AT
        ),
        DatasetProgress(
            "B2",
            DatasetState.RUNNING,
            4_120_000,
            12_000_000,
            7_530,
            in_flight=64,
            req_per_s=11.2,
            tok_per_s=6150.0,
            eta_s=1281.0,
            failures=3,
            at=AT,
        ),
        DatasetProgress("B3", DatasetState.PAUSED, 250_000, 8_000_000, 480, at=AT),
        DatasetProgress("B4", DatasetState.QUEUED, 0, 5_000_000, 0, at=AT),
    ]


def fixed_events(gpu: GpuStats | None = None) -> list:
    url = "http://127.0.0.1:30000/v1"
    gib = 2**30
    return [
        RunState("llama-drafter", RunPhase.LIVE, AT - 754.0, at=AT),
        StageState("generate", StageStatus.RUNNING, at=AT),
        *[StageState(s, StageStatus.PENDING, at=AT) for s in ("prepare", "extract", "train", "export")],
        *_datasets(),
        *[EndpointStats(url, 64, 25_000, 4, 11.2, v, 1.84, 3.9, at=AT) for v in (5200.0, 5900.0, 6400.0, 6150.0, 6020.0, 6300.0)],
        ServerMetrics(url, software="sglang", running=64, waiting=12, kv_usage=0.71, gen_tok_per_s=6210.0, at=AT),
        gpu
        or GpuStats(((0, "NVIDIA H200", 87.0, 120 * gib, 141 * gib, 64.0, 610.0), (1, "NVIDIA H200", None, None, None, None, None)), at=AT),
        HostStats(12.5, 40 * gib, 256 * gib, at=AT),
        LogEvent("info", "control socket: /tmp/eagleops-0/run.sock", at=AT),
        LogEvent("error", "sharegpt.jsonl:412: conversations[0].role: unknown role 'robot'", "B2", at=AT),
    ]


class ScriptedLink:
    """Feeds fixed events; answers commands the way an engine would (an ack + a log event)."""

    attached = True
    description = "scripted"

    def __init__(self, events: list):
        self.queue: asyncio.Queue = asyncio.Queue()
        for event in events:
            self.queue.put_nowait(event)
        self.sent: list = []

    async def start(self) -> None:
        pass

    async def events(self):
        while (event := await self.queue.get()) is not None:
            yield event

    async def send(self, command) -> Ack:
        self.sent.append(command)
        if isinstance(command, SetBudget) and command.dataset == "nope":
            return Ack(False, "no dataset named 'nope'")
        message = f"command {command.kind} {command.dataset or '*'}: ok"
        self.queue.put_nowait(LogEvent("info", message, command.dataset, at=AT))
        if isinstance(command, Pause) and command.dataset:
            old = next(d for d in _datasets() if d.name == command.dataset)
            self.queue.put_nowait(DatasetProgress(old.name, DatasetState.PAUSED, old.tokens, old.budget, old.samples, at=AT))
        return Ack(True, "ok")

    async def stop(self) -> None:
        self.queue.put_nowait(None)

    def exit_code(self) -> int | None:
        return None


class SilentLink(ScriptedLink):
    """An engine that takes commands and never answers them."""

    def __init__(self, events: list):
        super().__init__(events)
        self.never = asyncio.Event()
        self.unanswered = 0

    async def send(self, command) -> Ack:
        self.sent.append(command)
        self.unanswered += 1
        try:
            await self.never.wait()
        finally:
            self.unanswered -= 1
        raise AssertionError("the silent engine answered")


async def _settle(pilot) -> None:
    await pilot.pause(0.05)
    pilot.app.refresh_panes()
    await pilot.pause()


def _log_lines(app) -> list[str]:
    """The log's lines without the clock and level every line now starts with."""
    return [re.sub(r"^\d\d:\d\d:\d\d [A-Z]+ +", "", str(line)) for line in app.query_one("#log").lines]


async def _until(pilot, condition, tries: int = 200) -> None:
    """Let the app run until condition() holds; bounded in steps, not in seconds."""
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)


async def test_keys_send_commands_and_panes_show_the_result():
    link = ScriptedLink(fixed_events())
    app = EagleOpsApp(link)
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        table = app.query_one(DatasetsTable)
        assert table.row_count == 4
        await pilot.press("down")  # B2
        await pilot.press("p")
        await _settle(pilot)
        assert link.sent[-1] == Pause("B2")
        assert table.cell("B2", "state") == "paused"
        assert any("command pause B2: ok" in line for line in _log_lines(app))
        await pilot.press("P", "r", "R")
        await pilot.pause()  # commands go out from workers
        assert link.sent[-3:] == [Pause(None), Resume("B2"), Resume(None)]
        await pilot.press("k")
        await pilot.pause()
        await pilot.press("n")  # declined: nothing sent
        assert link.sent[-1] == Resume(None)
        await pilot.press("k")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        assert link.sent[-1] == Kill("B2")
        await pilot.press("K")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        assert link.sent[-1] == Kill(None)


async def test_budget_modal_rejects_bad_input_then_applies():
    link = ScriptedLink(fixed_events())
    app = EagleOpsApp(link)
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        await pilot.press("b")
        await pilot.pause()
        await pilot.press(*"lots", "enter")
        await pilot.pause()
        error = app.screen.query_one("#budget-error")
        assert "not a token count: 'lots'" in str(error.render())
        assert not any(isinstance(c, SetBudget) for c in link.sent)
        await pilot.press(*["backspace"] * 4, *"12.5M", "enter")
        await pilot.pause()
        assert link.sent[-1] == SetBudget("B1", 12_500_000)
        await pilot.press("b")
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert len([c for c in link.sent if isinstance(c, SetBudget)]) == 1


async def test_help_screen_and_refused_commands_are_shown():
    link = ScriptedLink(fixed_events())
    app = EagleOpsApp(link)
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert "token budget" in str(app.screen.query_one("Static").render())
        await pilot.press("escape")
        await pilot.pause()
        await app.send(SetBudget("nope", 5))
        assert any("refused: no dataset named 'nope'" in line for line in _log_lines(app))


async def test_a_silent_engine_times_out_and_the_keys_stay_responsive():
    link = SilentLink(fixed_events())
    # short enough for a quick test, long enough that the keys below land before it on a busy machine
    app = EagleOpsApp(link, command_timeout_s=1.0)
    bells: list[int] = []
    app.bell = lambda: bells.append(1)
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        table = app.query_one(DatasetsTable)
        await pilot.press("p")
        await pilot.pause()
        assert link.sent == [Pause("B1")] and link.unanswered == 1
        await pilot.press("down")
        assert table.cursor == 1
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert link.unanswered == 1  # the keys above were handled while the command was still waiting
        await pilot.press("escape")
        await _until(pilot, lambda: link.unanswered == 0)
        await pilot.pause()
        assert link.unanswered == 0, "the command never timed out"
        assert "command pause B1: no answer from the engine in 1s" in _log_lines(app)
        assert bells


async def test_failing_commands_are_shown_as_errors():
    class BrokenLink(ScriptedLink):
        async def send(self, command) -> Ack:
            if isinstance(command, Pause):
                raise ConnectionError("socket closed")
            raise ValueError("a bug in the link")

    app = EagleOpsApp(BrokenLink(fixed_events()))
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        await pilot.press("p", "R")
        await _until(pilot, lambda: sum(" failed: " in line or " crashed: " in line for line in _log_lines(app)) == 2)
        assert "command pause B1 failed: socket closed" in _log_lines(app)
        assert any(line.startswith("command resume * crashed: ValueError") for line in _log_lines(app))
        assert app.is_running  # neither took the console down


def test_help_and_bindings_come_from_the_keymap():
    bound = {(b.key, b.action) for b in [*EagleOpsApp.BINDINGS, *DatasetsTable.BINDINGS]}
    assert bound == {(k.key, k.action) for k in KEYMAP}
    shown = " ".join(Text.from_markup(HELP).plain.split())  # a wrapped line reads as one
    for keys, does in help_rows():
        assert " ".join([*keys, does]) in shown


def test_readme_key_table_is_the_keymap():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## The console\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == markdown_table()


async def test_no_gpu_is_a_state_not_a_crash():
    link = ScriptedLink(fixed_events(gpu=GpuStats((), error="no NVIDIA GPU (NVMLError_LibraryNotFound)", at=AT)))
    app = EagleOpsApp(link)
    async with app.run_test(size=(160, 45)) as pilot:
        await _settle(pilot)
        # no GPU pane to take a quarter of the width for one line: the host in a line of the server pane
        assert not app.query_one(GpuPane).display
        server = str(app.query_one(ServerPane).render())
        assert "host: no NVIDIA GPU (NVMLError_LibraryNotFound), cpu 12%, ram 40.0 GiB/256.0 GiB" in server


def test_nvml_reader_without_a_driver_reports_no_gpu():
    stats = NvmlReader().read()  # no NVIDIA driver on CPU machines (CI); a GPU box lists them
    if stats.gpus:
        pytest.skip("this machine has an NVIDIA GPU")
    assert stats.error.startswith("no NVIDIA GPU")


def test_nvml_fields_that_fail_read_as_na():
    class Broken(Exception):
        pass

    class FakeNvml:
        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return object()

        def nvmlDeviceGetName(self, h):
            return b"Tesla X"

        def nvmlDeviceGetUtilizationRates(self, h):
            raise Broken("NotSupported")

        def nvmlDeviceGetMemoryInfo(self, h):
            raise Broken("NoPermission")

        def nvmlDeviceGetTemperature(self, h, sensor):
            return 51

        def nvmlDeviceGetPowerUsage(self, h):
            raise Broken("GpuIsLost")

    reader = NvmlReader()
    stats = reader._sample(FakeNvml())
    assert stats.gpus == ((0, "Tesla X", None, None, None, 51.0, None),)


def test_prometheus_metrics_of_sglang_and_vllm():
    sglang = parse_prometheus(
        '# HELP x\nsglang:gen_throughput{model="m"} 1234.5\nsglang:num_running_reqs{a="1"} 3\nsglang:num_running_reqs{a="2"} 4\nsglang:token_usage 0.5\n'
    )
    metrics, _ = server_metrics("u", sglang, None, 0.0)
    assert (metrics.software, metrics.gen_tok_per_s, metrics.running, metrics.kv_usage) == ("sglang", 1234.5, 7.0, 0.5)
    first, previous = server_metrics("u", parse_prometheus("vllm:generation_tokens_total 1000\nvllm:num_requests_running 2\n"), None, 10.0)
    assert first.gen_tok_per_s is None and first.running == 2
    second, _ = server_metrics("u", parse_prometheus("vllm:generation_tokens_total 3000\nvllm:kv_cache_usage_perc 0.25\n"), previous, 12.0)
    assert second.gen_tok_per_s == 1000.0 and second.kv_usage == 0.25


def test_main_screen_snapshot(snap_compare):
    async def before(pilot):
        await _settle(pilot)

    assert snap_compare(EagleOpsApp(ScriptedLink(fixed_events()), clock=_at), terminal_size=(160, 45), run_before=before)


def test_light_theme_snapshot(snap_compare):
    async def before(pilot):
        await _settle(pilot)

    assert snap_compare(EagleOpsApp(ScriptedLink(fixed_events()), theme="light", clock=_at), terminal_size=(160, 45), run_before=before)


async def test_local_console_drives_a_real_engine(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"p{i}", "prompt": f"x {i} [[tokens:10]] [[delay:0.05]]"} for i in range(300)])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=4)
    engine = Engine(config, progress_interval_s=0.1)
    await engine.open()
    link = LocalLink(engine)
    app = EagleOpsApp(link, refresh_s=0.1)
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause(0.5)
        table = app.query_one(DatasetsTable)
        assert table.cell("A", "state") == "running"
        await pilot.press("p")
        await pilot.pause(0.4)
        assert engine.generate.runners["A"].paused
        assert table.cell("A", "state") == "paused"
        assert any("command pause A" in line for line in _log_lines(app))
        await pilot.press("q")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause(0.5)
    assert link.task.done() and link.summary.killed


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagleops", *args], capture_output=True, text=True, env=_env(), timeout=60)


def _run_file(tmp_path: Path, base_url: str, n: int = 2000) -> Path:
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"p{i}", "prompt": f"x {i} [[tokens:10]] [[delay:0.1]]"} for i in range(n)])
    run = tmp_path / "run.toml"
    run.write_text(
        f'name = "att"\noutput_dir = "out"\nconcurrency = 4\n[[endpoints]]\nbase_url = "{base_url}"\nmodel = "m"\n'
        f'[[datasets]]\nname = "B1"\npath = "{source}"\ntoken_budget = "1M"\n[[datasets]]\nname = "B2"\npath = "{source}"\ntoken_budget = "2M"\n'
    )
    return run


def _wait_for_socket(timeout: float = 30) -> Path:
    from eagleops.pipeline.protocol.control import find_sockets

    deadline = time.monotonic() + timeout
    while not (found := find_sockets()):
        assert time.monotonic() < deadline, "engine socket never appeared"
        time.sleep(0.1)
    return found[0]


async def test_two_attached_consoles_see_the_same_headless_run(tmp_path, fault_server):
    run = _run_file(tmp_path, fault_server.base_url)
    engine = subprocess.Popen(
        [sys.executable, "-m", "eagleops", "run", str(run), "--no-tui"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        path = await asyncio.to_thread(_wait_for_socket)
        first, second = EagleOpsApp(SocketLink(path), refresh_s=0.1), EagleOpsApp(SocketLink(path), refresh_s=0.1)
        async with first.run_test(size=(160, 45)) as one, second.run_test(size=(160, 45)) as two:
            await one.pause(1.0)
            await two.pause(0.2)
            assert first.query_one(DatasetsTable).row_count == 2
            await one.press("p")  # pause B1 from the first console
            for _ in range(40):
                await two.pause(0.1)
                if second.query_one(DatasetsTable).cell("B1", "state") == "paused":
                    break
            assert second.query_one(DatasetsTable).cell("B1", "state") == "paused"
            assert any("command pause B1" in line for line in _log_lines(second))
            await one.press("q")  # detach: no confirmation, the run goes on
            await one.pause(0.3)
        assert engine.poll() is None
        from eagleops.pipeline.protocol.control import ControlClient

        client = ControlClient(path)
        status = await client.status()
        assert {e.name: e.state for e in status if isinstance(e, DatasetProgress)}["B1"] == DatasetState.PAUSED
        await client.send(Kill())
        await client.close()
        assert await asyncio.to_thread(engine.wait, 30) == 130
    finally:
        if engine.poll() is None:
            engine.kill()


def _consoles_of(run: Path) -> list[int]:
    """Pids of consoles (not the headless engine) started on ``run``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if str(run) in cmd and "--no-tui" not in cmd and any("eagleops" in part for part in cmd):
            found.append(proc.info["pid"])
    return found


def _stop_detached_engine(out_dir: Path) -> None:
    """A test that failed half way must not leave a detached engine running: its pid is in the lock."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((out_dir / ".lock").read_text().strip())
        os.killpg(pid, signal.SIGKILL)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_the_real_program_in_a_terminal(tmp_path, fault_server):
    """What a person sees: `eagleops run` in tmux at 80x24, keys typed, the screen read back; the
    terminal dropped (SIGHUP) and the run still going; `eagleops attach` back on it, `q` leaving it."""
    run = _run_file(tmp_path, fault_server.base_url)
    session = f"eo{os.getpid()}"
    exit_file = tmp_path / "exit"
    env_prefix = f"cd {ROOT} && unset COLUMNS LINES && PYTHONPATH={ROOT} EAGLEOPS_RUNTIME_DIR={os.environ['EAGLEOPS_RUNTIME_DIR']}"

    def start(command: str) -> None:
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", f"{env_prefix} {command}; echo $? > {exit_file}"],
            check=True,
        )
        subprocess.run(["tmux", "resize-window", "-t", session, "-x", "80", "-y", "24"], capture_output=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_screen(needle: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while needle not in (text := screen()):
            assert time.monotonic() < deadline, f"{needle!r} never shown:\n{text}"
            time.sleep(0.2)
        return text

    def keys(*k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", session, *k], check=True)

    try:
        start(f"{sys.executable} -m eagleops run {run}")
        wait_screen("B2")
        text = wait_screen("no NVIDIA GPU")
        assert "B1" in text and "B2" in text and "Stages" in text
        assert len(text.splitlines()) <= 24
        keys("p")
        wait_screen("command pause B1")
        keys("Down", "b")
        wait_screen("New token budget for B2")
        keys("7", "M", "Enter")
        wait_screen("budget B2: 2M -> 7M")
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)  # the SSH session drops
        deadline = time.monotonic() + 30
        while _consoles_of(run):  # the console is gone with its terminal; only then does the engine's fate show
            assert time.monotonic() < deadline, "the console outlived its terminal"
            time.sleep(0.2)
        status = _cli("status")
        assert status.returncode == 0 and "7M" in status.stdout, status.stderr  # the run goes on without its terminal
        assert (tmp_path / "out" / "engine.log").exists()
        start(f"{sys.executable} -m eagleops attach")
        wait_screen("B2")
        keys("q")
        deadline = time.monotonic() + 30
        while not exit_file.exists():
            assert time.monotonic() < deadline, screen()
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0"
        assert _cli("status").returncode == 0  # detached again, still running
        assert "killing the run" in _cli("kill").stdout
        deadline = time.monotonic() + 30
        while _cli("status").returncode == 0:
            assert time.monotonic() < deadline, "the engine did not stop"
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        _stop_detached_engine(tmp_path / "out")


async def test_no_color_terminals_get_a_working_console(monkeypatch):
    """NO_COLOR=1 turns on Textual's monochrome filter, which reads every segment's style."""
    monkeypatch.setenv("NO_COLOR", "1")
    app = EagleOpsApp(ScriptedLink(fixed_events()))
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("down")
        await _settle(pilot)
        assert app.query_one(DatasetsTable).selected == "B2"
        assert app.is_running


# ---- 80x24 first, every terminal ----------------------------------------------------------------


def _eight_datasets() -> list:
    names = ["sharegpt", "ultrachat-200k", "B2", "code-feedback", "magpie-reasoning-long-name", "math", "tools", "B8"]
    events = [e for e in fixed_events() if not isinstance(e, DatasetProgress)]
    for i, name in enumerate(names):
        state = (DatasetState.RUNNING, DatasetState.DONE, DatasetState.PAUSED, DatasetState.QUEUED)[i % 4]
        events.append(
            DatasetProgress(
                name,
                state,
                1_234_567 * (i + 1),
                12_000_000,
                28_210 + i,
                in_flight=64,
                req_per_s=11.2,
                tok_per_s=6150.0,
                eta_s=1281.0,
                failures=i,
                at=AT,
            )
        )
    return events


def _table_text(app) -> list[str]:
    table = app.query_one(DatasetsTable)
    return [table.render_line(y).text for y in range(table.size.height)]


async def test_80x24_fits_the_screen_the_cursor_scrolls_and_numbers_are_whole():
    app = EagleOpsApp(ScriptedLink(_eight_datasets()))
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        for widget in ("#datasets", "#panes", "#log"):
            region = app.query_one(widget).region
            assert region.bottom <= 23, (widget, region)  # above the footer: nothing scrolled away
        lines = _table_text(app)
        header = lines[0]
        for label in ("Dataset", "State", "Tokens", "%", "tok/s", "ETA"):
            assert label in header, header  # the first columns by priority
        assert "28,210" in "".join(lines) or "Samples" not in header  # a number is shown whole or not at all
        assert lines[-1].lstrip().startswith("total (8)")
        table = app.query_one(DatasetsTable)
        await pilot.press("end")
        await _settle(pilot)
        assert table.selected == "B8" and any("B8" in line for line in _table_text(app)[1:-1])  # scrolled into view
        await pilot.press("p")
        await pilot.pause()
        assert app.link.sent[-1] == Pause("B8")  # the dataset the user sees selected
        await pilot.press("home")
        await _settle(pilot)
        assert any("sharegpt" in line for line in _table_text(app)[1:3])


async def test_a_click_selects_the_row_clicked():
    app = EagleOpsApp(ScriptedLink(_eight_datasets()))
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.query_one(DatasetsTable)
        for row in (2, 0, 4):
            content = table.content_region
            await pilot.click(DatasetsTable, offset=(content.x - table.region.x + 3, content.y - table.region.y + 1 + row))
            await pilot.pause()
            assert table.cursor == row


async def test_the_newest_log_line_is_in_view_at_80x24():
    app = EagleOpsApp(ScriptedLink(fixed_events() + [LogEvent("info", f"line {i}", at=AT) for i in range(60)]))
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: any("line 59" in line for line in _log_lines(app)))
        await _settle(pilot)
        log = app.query_one("#log")
        assert log.scroll_y >= log.max_scroll_y - 1  # at the bottom: the newest line shows


@pytest.mark.parametrize("look", ["dark", "light", "ascii"])
@pytest.mark.parametrize("view", ["generate", "train"])
@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)], ids=["80x24", "120x40", "200x60"])
def test_snapshots_at_design_sizes(snap_compare, monkeypatch, size, view, look):
    """Generate's datasets and train's live view, at each design size, in each theme and ASCII."""
    from .test_operator_view import _training_events

    monkeypatch.setenv("EAGLEOPS_ASCII", "1" if look == "ascii" else "0")

    async def before(pilot):
        await _settle(pilot)

    events = _eight_datasets() if view == "generate" else [*_training_events(), HostStats(12.5, 40 * 2**30, 256 * 2**30, at=AT)]
    theme = "light" if look == "light" else "dark"
    app = EagleOpsApp(ScriptedLink(events), theme=theme, clock=lambda: _at() + 0.0)
    assert snap_compare(app, terminal_size=size, run_before=before)


def test_kill_confirmation_fits_at_80x24(snap_compare):
    async def before(pilot):
        await _settle(pilot)
        await pilot.press("K")
        await pilot.pause()

    assert snap_compare(EagleOpsApp(ScriptedLink(_eight_datasets()), clock=_at), terminal_size=(80, 24), run_before=before)


@pytest.mark.parametrize(
    "env",
    [
        {"NO_COLOR": "1", "TERM": "xterm-256color", "LANG": "en_US.UTF-8"},
        {"TERM": "linux", "LANG": "en_US.UTF-8"},
        {"TERM": "vt100", "LANG": "en_US.UTF-8"},
        {"TERM": "dumb"},
        {"LANG": "en_US.UTF-8"},  # no TERM at all
        {"TERM": "xterm-256color", "LC_ALL": "C"},
        {"TERM": "screen", "LANG": "en_US.ISO-8859-1"},
    ],
    ids=["no-color", "linux", "vt100", "dumb", "no-term", "c-locale", "latin-1"],
)
async def test_every_terminal_gets_a_readable_console(monkeypatch, env):
    for name in ("NO_COLOR", "TERM", "LANG", "LC_ALL", "LC_CTYPE", "EAGLEOPS_ASCII"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = EagleOpsApp(ScriptedLink(_eight_datasets()))
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("down", "question_mark")
        await pilot.pause()
        await pilot.press("escape")
        await _settle(pilot)
        assert app.is_running and app.query_one(DatasetsTable).selected == "ultrachat-200k"
        text = "".join(_table_text(app)) + str(app.query_one(StagesPane).render()) + str(app.query_one(GpuPane).render())
        if "NO_COLOR" not in env:
            assert app.ascii and text.isascii(), [c for c in text if not c.isascii()][:5]
            assert app.query_one("#log").styles.border_top[0] == "ascii"


async def test_ctrl_q_and_the_palette_detach_and_the_palette_has_every_action():
    app = EagleOpsApp(ScriptedLink(fixed_events()))
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for key in ("Pause (p)", "Resume (r)", "Budget (b)", "Kill (k)", "Kill run (K)", "Help (?)"):
            assert key in titles, titles
        await pilot.press("ctrl+q")
        await _until(pilot, lambda: not app.is_running)
    assert app.return_value == 0  # attached: closing the console leaves the run going


async def test_ctrl_q_asks_before_stopping_an_in_process_run(tmp_path, fault_server):
    source = write_jsonl(tmp_path / "a.jsonl", [{"id": f"p{i}", "prompt": f"x {i} [[tokens:10]] [[delay:0.1]]"} for i in range(500)])
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}], concurrency=2)
    engine = Engine(config, progress_interval_s=0.1)
    await engine.open()
    app = EagleOpsApp(LocalLink(engine), refresh_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        await _until(pilot, lambda: "A" in app.state.datasets and app.state.datasets["A"].samples > 0)
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await _until(pilot, lambda: not app.is_running)
    assert app.return_value == 130


async def test_sorting_keeps_the_cursor_on_its_dataset_and_the_log_filters():
    events = _eight_datasets() + [LogEvent("warning", "B2 is slow", "B2", at=AT), LogEvent("info", "math started", "math", at=AT)]
    app = EagleOpsApp(ScriptedLink(events))
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.query_one(DatasetsTable)
        await pilot.press("down", "down")  # B2
        await pilot.press("s")  # by progress: the furthest first
        await _settle(pilot)
        assert table.sort == "progress" and table.names[0] == "B8" and table.selected == "B2"
        log = app.query_one("#log")
        await pilot.press("l")  # warnings and worse
        assert "math started" not in _log_lines(app) and any("B2 is slow" in line for line in _log_lines(app))
        await pilot.press("l", "l", "f")  # all levels again, then only B2's lines
        assert log.dataset == "B2" and not any("math started" in line for line in _log_lines(app))
        await pilot.press("f", "slash")
        await pilot.pause()
        await pilot.press(*"started", "enter")
        await pilot.pause()
        assert [line for line in _log_lines(app) if line.strip()] == [next(line for line in _log_lines(app) if "math started" in line)]
        assert "/started/" in log.border_title


async def test_enter_shows_a_datasets_detail_from_the_engine(tmp_path, fault_server):
    rows = [{"id": f"d{i}", "prompt": f"x {i} [[tokens:5]]"} for i in range(20)] + [{"id": "bad", "prompt": "x [[fault:400]]"}, "{torn"]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    config = make_config(tmp_path, fault_server.base_url, [{"name": "A", "path": str(source), "token_budget": "1M"}])
    engine = Engine(config, progress_interval_s=0.1)
    await engine.open()
    server = await engine.serve_socket()
    app = EagleOpsApp(LocalLink(engine), refresh_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        # the table selects a row once it has drawn one (its refresh timer), not when the state has it
        finished = lambda: "A" in app.state.datasets and app.state.datasets["A"].state.terminal  # noqa: E731
        await _until(pilot, lambda: finished() and app.query_one(DatasetsTable).selected == "A", tries=1200)
        assert app.state.datasets["A"].state.terminal
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, DetailScreen), tries=1200)
        assert isinstance(app.screen, DetailScreen)
        text = str(app.screen.query_one(Static).render())
        assert "A: done" in text and "20 samples" in text and "HTTP 400" in text and "bad line: <json>" in text
        assert "latency p50" in text and fault_server.base_url in text
        await pilot.press("escape")
    assert server is not None
    remote = await ControlClient(server.path).detail("A")  # the same over the socket, for an attached console
    assert remote["failures"] == {"HTTP 400": 1, "bad line: <json>": 1} and remote["samples"] == 20
    await server.close()


async def test_a_tick_or_log_line_while_the_app_closes_draws_nothing():
    """Textual prunes the screens before it stops the app's timers and workers: a refresh tick or
    a last log line from the event pump can land with the widgets gone (seen once in CI)."""
    app = EagleOpsApp(ScriptedLink(fixed_events()), refresh_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
    assert not app.is_running
    app.refresh_panes()
    app.write_log("the engine has stopped; press q to close", "warning")


async def test_the_help_screen_scrolls_to_its_last_line_at_80x24():
    app = EagleOpsApp(ScriptedLink(fixed_events()))
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        dialog = app.screen.query_one("#dialog")
        assert dialog.max_scroll_y > 0  # more than fits
        await pilot.press("end")
        await pilot.pause()
        assert dialog.scroll_y == dialog.max_scroll_y
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
