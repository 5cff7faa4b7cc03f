"""The eagleops operations console: renders engine events, sends engine commands."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Header, Log

from pipeline.config import RunConfig
from pipeline.protocol.control import ControlError
from pipeline.engine import Engine
from pipeline.protocol.events import Command, Kill, LogEvent, Pause, Resume, SetBudget, StageState
from pipeline.engine.headless import exit_code
from pipeline.protocol.report import format_event

from .link import EngineLink, LocalLink, SocketLink
from .screens import BudgetScreen, ConfirmScreen, HelpScreen
from .state import ConsoleState
from .panes import DatasetsTable, GpuPane, ServerPane, StagesPane

__all__ = ["EagleOpsApp", "THEMES", "attach_console", "run_console"]

THEMES_DIR = Path(__file__).resolve().parent.parent / "themes"
THEMES = {"dark": "textual-dark", "light": "textual-light"}


def theme_css(theme: str) -> list[Path]:
    if theme not in THEMES:
        raise ValueError(f"unknown theme {theme!r}; choose from {', '.join(THEMES)}")
    return [THEMES_DIR / "base.tcss", THEMES_DIR / f"{theme}.tcss"]


class EagleOpsApp(App[int]):
    TITLE = "eagleops"
    BINDINGS = [
        Binding("p", "pause", "Pause"),
        Binding("P", "pause_all", "Pause all", show=False),
        Binding("r", "resume", "Resume"),
        Binding("R", "resume_all", "Resume all", show=False),
        Binding("b", "budget", "Budget"),
        Binding("k", "kill", "Kill"),
        Binding("K", "kill_all", "Kill run", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit_console", "Quit"),
    ]

    def __init__(self, link: EngineLink, *, theme: str = "dark", refresh_s: float = 1.0):
        super().__init__(css_path=theme_css(theme))
        self.link = link
        self.theme_name = theme
        self.refresh_s = refresh_s
        self.state = ConsoleState()
        self._rendered_version = -1
        self.engine_finished = False
        self.sub_title = link.description

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield DatasetsTable(id="datasets")
        with Horizontal(id="panes"):
            yield GpuPane(id="gpu")
            yield ServerPane(id="server")
            yield StagesPane(id="stages")
        log = Log(id="log", max_lines=5000, auto_scroll=True)
        log.border_title = "Log"
        yield log
        yield Footer()

    async def on_mount(self) -> None:
        self.theme = THEMES[self.theme_name]
        if os.environ.get("SSH_CONNECTION") or os.environ.get("SSH_TTY"):
            self.animation_level = "none"  # every animated frame is bytes over the link
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.exit)  # terminal gone
        await self.link.start()
        self.run_worker(self._pump(), name="events", group="events")
        self.set_interval(self.refresh_s, self.refresh_panes)
        self.query_one(DatasetsTable).focus()

    async def _pump(self) -> None:
        try:
            async for event in self.link.events():
                self.state.apply(event)
                if isinstance(event, LogEvent):
                    self.write_log(format_event(event) or event.message, event.level)
                elif isinstance(event, StageState) and not self.state.datasets:
                    self.refresh_panes()  # first paint without waiting a tick
        except (ControlError, ConnectionError, OSError) as exc:
            self.write_log(f"lost the engine: {exc}", "error")
        self.engine_finished = True
        self.refresh_panes()
        if self.link.attached:
            self.write_log("the engine has stopped; press q to close", "warning")
        else:
            self.write_log("the run has finished; press q to quit", "info")

    def write_log(self, line: str, level: str = "info") -> None:
        self.query_one("#log", Log).write_line(line)

    def refresh_panes(self) -> None:
        if self.state.version == self._rendered_version:
            return
        self._rendered_version = self.state.version
        with self.batch_update():
            self.query_one(DatasetsTable).show(self.state.datasets)
            self.query_one(GpuPane).render_state(self.state)
            self.query_one(ServerPane).render_state(self.state)
            self.query_one(StagesPane).render_state(self.state)

    # ---- commands ---------------------------------------------------------------------------
    def _selected(self) -> str | None:
        name = self.query_one(DatasetsTable).selected
        if name is None:
            self.write_log("no dataset selected", "warning")
            self.bell()
        return name

    async def send(self, command: Command) -> None:
        try:
            ack = await self.link.send(command)
        except (ControlError, ConnectionError, OSError) as exc:
            self.write_log(f"command {command.kind} failed: {exc}", "error")
            self.bell()
            return
        if not ack.ok:
            self.write_log(f"refused: {ack.message}", "warning")
            self.bell()
        elif self.link.attached is False and self.engine_finished:
            self.write_log(ack.message)

    async def action_pause(self) -> None:
        if (name := self._selected()) is not None:
            await self.send(Pause(name))

    async def action_pause_all(self) -> None:
        await self.send(Pause())

    async def action_resume(self) -> None:
        if (name := self._selected()) is not None:
            await self.send(Resume(name))

    async def action_resume_all(self) -> None:
        await self.send(Resume())

    def action_budget(self) -> None:
        name = self._selected()
        if name is None:
            return
        current = self.state.datasets[name].budget

        async def apply(tokens: int | None) -> None:
            if tokens is not None:
                await self.send(SetBudget(name, tokens))

        self.push_screen(BudgetScreen(name, current), apply)

    def action_kill(self) -> None:
        name = self._selected()
        if name is None:
            return

        async def confirmed(yes: bool | None) -> None:
            if yes:
                await self.send(Kill(name))

        self.push_screen(ConfirmScreen(f"Kill {name}? In-flight requests are cancelled; finished work is kept."), confirmed)

    def action_kill_all(self) -> None:
        async def confirmed(yes: bool | None) -> None:
            if yes:
                await self.send(Kill())

        self.push_screen(ConfirmScreen("Kill the whole run? In-flight requests are cancelled; finished work is kept."), confirmed)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    async def action_quit_console(self) -> None:
        if self.link.attached or self.engine_finished:
            await self._leave()
            return
        running = any(not d.state.terminal for d in self.state.datasets.values())
        if not running:
            await self._leave()
            return

        async def confirmed(yes: bool | None) -> None:
            if yes:
                await self._leave()

        self.push_screen(ConfirmScreen("Quit and stop the run? Finished work is kept; run again to resume."), confirmed)

    async def _leave(self) -> None:
        if self.link.attached:
            self.write_log("detaching; the run goes on")
        await self.link.stop()
        summary = getattr(self.link, "summary", None)
        self.exit(exit_code(summary) if summary is not None else 0)


async def run_console(config: RunConfig, *, theme: str = "dark", refresh_s: float = 1.0, stages: tuple[str, ...] | None = None) -> int:
    """``eagleops run`` with the TUI: engine and console in one event loop, socket served too."""
    engine = Engine(config, stages=stages)
    await engine.open()
    server = await engine.serve_socket()
    link = LocalLink(engine)
    app = EagleOpsApp(link, theme=theme, refresh_s=refresh_s)
    try:
        code = await app.run_async()
    finally:
        await link.stop()  # also when the terminal went away: kill cleanly, keep the work
        if server is not None:
            await server.close()
    summary = link.summary
    if code is None:
        return exit_code(summary) if summary is not None else 0
    return code


async def attach_console(path: Path, *, theme: str = "dark", refresh_s: float = 1.0) -> int:
    app = EagleOpsApp(SocketLink(path), theme=theme, refresh_s=refresh_s)
    code = await app.run_async()
    return code or 0
