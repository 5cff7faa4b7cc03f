"""The eagleops operations console: renders engine events, sends engine commands."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from functools import partial
from importlib import resources
from pathlib import Path, PurePath

from textual import events
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from eagleops.console.report import detail_text, format_event
from eagleops.pipeline.errors import UsageError
from eagleops.pipeline.protocol.control import ControlError
from eagleops.pipeline.protocol.events import (
    Command,
    DatasetProgress,
    Kill,
    LogEvent,
    Pause,
    Resume,
    RunPhase,
    SetBudget,
    StageState,
    StageStatus,
)

from .keymap import APP_KEYS, bindings
from .link import EngineLink
from .logview import LEVELS, LogView
from .panes import DatasetsTable, GpuPane, RunStatus, ServerPane, StagesPane, TrainingView
from .panes.training import running_compute_stage
from .screens import BudgetScreen, ConfirmScreen, DetailScreen, HelpScreen, LogScreen, SearchScreen
from .state import ConsoleState
from .terminal import TerminalWatch, ascii_only, watch_terminal

__all__ = ["EagleOpsApp", "THEMES"]

THEMES = {"dark": "textual-dark", "light": "textual-light"}
COMMAND_TIMEOUT_S = 10.0  # an engine answers in milliseconds; this long means it is stuck or gone


def theme_css(theme: str) -> list[str | PurePath]:
    if theme not in THEMES:
        raise UsageError(f"unknown theme {theme!r}; choose from {', '.join(THEMES)}")
    # eagleops.themes is themes/ in a checkout (linked from eagleops/) and in a wheel: either way files on
    # disk (pip unpacks wheels), which Textual wants as paths: it reads them and, in dev mode, watches them.
    themes = resources.files("eagleops.themes")
    return [Path(str(themes / "base.tcss")), Path(str(themes / f"{theme}.tcss"))]


def _describe(command: Command) -> str:
    return f"command {command.kind} {command.stage or command.dataset or '*'}"


class EagleOpsApp(App[int]):
    TITLE = "eagleops"
    BINDINGS = bindings(APP_KEYS)

    def __init__(
        self,
        link: EngineLink,
        *,
        theme: str = "dark",
        refresh_s: float = 1.0,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
        ascii: bool | None = None,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(css_path=theme_css(theme))
        self.ascii = ascii_only() if ascii is None else ascii  # boxes, bars and marks in ASCII
        self.link = link
        self.theme_name = theme
        self.refresh_s = refresh_s
        self.clock = clock  # wall time for the elapsed time; tests and snapshots fix it
        self.command_timeout_s = command_timeout_s
        self.state = ConsoleState()
        self._rendered_version = -1
        self.engine_finished = False
        self._leaving = False
        self._terminal_watch: TerminalWatch | None = None
        self._laid_out_for = -1  # the number of datasets the layout was fitted to
        self.sub_title = link.description  # the terminal's title; the status line names the run

    def compose(self) -> ComposeResult:
        yield RunStatus(self.clock, id="status")
        yield DatasetsTable(id="datasets")
        yield TrainingView(self.clock, id="ml")
        with Horizontal(id="panes"):
            yield GpuPane(id="gpu")
            yield ServerPane(id="server")
            yield StagesPane(id="stages")
        yield LogView(id="log")
        yield Footer(show_command_palette=not self.ascii)  # its separator is a block glyph; Ctrl+P still opens it

    async def on_mount(self) -> None:
        self.theme = THEMES[self.theme_name]
        if self.ascii:
            self.add_class("-ascii")
            # the palette draws an emoji search icon and block borders; every action it offers is a key in help (?)
            self.use_command_palette = False
        if os.environ.get("SSH_CONNECTION") or os.environ.get("SSH_TTY"):
            self.animation_level = "none"  # every animated frame is bytes over the link
        if not self.is_headless:  # a hangup, a vanished terminal or SIGTERM: leave, even with the loop blocked
            loop = asyncio.get_running_loop()

            def leave_soon(code: int) -> None:
                loop.call_soon_threadsafe(self.leave, code)

            self._terminal_watch = watch_terminal(leave_soon)
        await self.link.start()
        self.run_worker(self._pump(), name="events", group="events")
        self.set_interval(self.refresh_s, self.refresh_panes)
        self.query_one(DatasetsTable).focus()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_layout()

    def _fit_layout(self) -> None:
        """80x24 is the design size. The table is as tall as its rows (a header, the totals and a
        border each), up to what the panes and a few log lines leave; the log takes the rest.
        While an ML stage shows, its view takes the table's room and the log keeps a few lines."""
        height = self.size.height
        panes = 12 if height >= 40 else 9 if height >= 32 else 6
        least_log = 8 if height >= 40 else 6
        self.query_one("#panes").styles.height = panes
        room = max(5, height - 2 - panes - least_log)  # less the status line and the footer
        table, log = self.query_one(DatasetsTable), self.query_one("#log")
        if self.query_one(TrainingView).display:
            log.styles.height = least_log
            return
        table.styles.height = min(room, max(5, len(self.state.datasets) + 4))
        log.styles.height = "1fr"

    async def _pump(self) -> None:
        try:
            async for event in self.link.events():
                before = self.state.datasets.get(event.name) if isinstance(event, DatasetProgress) else None
                self.state.apply(event)
                if (
                    isinstance(event, DatasetProgress)
                    and before is not None
                    and (before.state, before.budget) != (event.state, event.budget)
                ):
                    self.refresh_panes()  # a command's effect on its row: now, not at the next tick
                if isinstance(event, LogEvent):
                    self.write_log(format_event(event) or event.message, event.level, event.dataset)
                elif isinstance(event, StageState) and not self.state.datasets:
                    self.refresh_panes()  # first paint without waiting a tick
        except (ControlError, ConnectionError, OSError) as exc:
            self.write_log(f"lost the engine: {exc}", "error")
        if not self._leaving and (self.state.run is None or self.state.run.phase != RunPhase.FINISHED):
            self.state.lose_engine(self.clock())  # (closing the console ends the stream too: not a loss)
        self.engine_finished = True
        self.refresh_panes()
        self.refresh_bindings()  # nothing to send commands to any more: the footer drops them
        if self.state.engine_gone:
            self.write_log("lost the engine without its last word (killed, or its host went down): what is shown is stale", "error")
        elif self.link.attached:
            self.write_log("the engine has stopped; press q to close", "warning")
        else:
            self.write_log("the run has finished; press q to quit", "info")

    def write_log(self, line: str, level: str = "info", dataset: str | None = None) -> None:
        if self.is_running:  # closing: the screen's widgets go before the timers and the pump stop
            self.query_one(LogView).add(line, level, dataset)

    def refresh_panes(self) -> None:
        if not self.is_running:  # closing: a tick that lands while the screens are pruned has nothing to draw
            return
        status, ml = self.query_one(RunStatus), self.query_one(TrainingView)
        if self.state.version == self._rendered_version:
            status.render_state(self.state)  # the elapsed time moves on
            if ml.display:
                ml.render_state(self.state)
            return
        self._rendered_version = self.state.version
        with self.batch_update():
            if len(self.state.datasets) != self._laid_out_for:
                self._laid_out_for = len(self.state.datasets)
                self._fit_layout()
            status.render_state(self.state)
            self._show_ml_stages(running_compute_stage(self.state) is not None)  # gone: its last figures, marked stale
            if ml.display:
                ml.render_state(self.state)
            self.query_one(DatasetsTable).show(self.state.datasets, stale=self.state.engine_gone)
            gpu = self.query_one(GpuPane)
            has_gpu = not (self.state.gpu is not None and not self.state.gpu.gpus)  # no GPU: the server pane says the host
            if gpu.display != has_gpu:  # setting it at all lays the screen out again
                gpu.display = has_gpu
            gpu.render_state(self.state)
            self.query_one(ServerPane).render_state(self.state)
            self.query_one(StagesPane).render_state(self.state)

    _COMMANDS = frozenset({"pause", "pause_all", "resume", "resume_all", "budget", "kill", "kill_all", "detail"})
    _DATASET_ONLY = frozenset({"budget", "detail", "sort", "log_dataset"})  # no table on screen: nothing to act on

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys that cannot do anything now are off (and out of the footer): commands once an
        attached console's engine has stopped, the table's keys while the ML view is in its place."""
        if self.engine_finished and self.link.attached and action in self._COMMANDS:
            return False  # its socket is closed (an in-process engine still answers, detail included)
        return not (action in self._DATASET_ONLY and self._ml_view_shown())

    def _ml_view_shown(self) -> bool:
        views = self.query(TrainingView)  # none on a modal screen's query, or before compose
        return bool(views) and views.first().display

    def _show_ml_stages(self, show: bool) -> None:
        """An ML stage runs: its live view takes the datasets table's place (they are all done)."""
        table, ml = self.query_one(DatasetsTable), self.query_one(TrainingView)
        if ml.display != show:
            ml.display, table.display = show, not show
            self._fit_layout()
            self.refresh_bindings()
            if not show:
                table.focus()

    # ---- commands ---------------------------------------------------------------------------
    def _selected(self) -> str | None:
        """The dataset the cursor is on, or while an ML stage shows, that stage."""
        if self.query_one(TrainingView).display and (stage := running_compute_stage(self.state)) is not None:
            return stage
        name = self.query_one(DatasetsTable).selected
        if name is None:
            self.write_log("no dataset selected", "warning")
            self.bell()
        return name

    def _for(self, command: type[Command], name: str) -> Command:
        """``command`` addressed to what ``name`` is: a dataset of this run, else a stage."""
        return command(name) if name in self.state.datasets else command(stage=name)

    def dispatch(self, command: Command) -> None:
        """Send from a worker: a stalled engine must not freeze the keys while it is awaited."""
        self.run_worker(self.send(command), name=_describe(command), group="commands", exit_on_error=False)

    async def send(self, command: Command) -> None:
        try:
            ack = await asyncio.wait_for(self.link.send(command), timeout=self.command_timeout_s)
        except TimeoutError:  # before OSError, of which it is a subclass
            self.write_log(f"{_describe(command)}: no answer from the engine in {self.command_timeout_s:g}s", "error")
            self.bell()
            return
        except (ControlError, ConnectionError, OSError) as exc:
            self.write_log(f"{_describe(command)} failed: {exc}", "error")
            self.bell()
            return
        if not ack.ok:
            self.write_log(f"refused: {ack.message}", "warning")
            self.bell()
        elif self.link.attached is False and self.engine_finished:
            self.write_log(ack.message)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # send() reports the failures it expects; anything else is a bug, shown rather than lost
        worker = event.worker
        if worker.group == "commands" and event.state == WorkerState.ERROR:
            self.write_log(f"{worker.name} crashed: {worker.error!r}", "error")
            self.bell()

    def action_pause(self) -> None:
        if (name := self._selected()) is not None:
            self.dispatch(self._for(Pause, name))

    def action_pause_all(self) -> None:
        self.dispatch(Pause())

    def action_resume(self) -> None:
        if (name := self._selected()) is not None:
            self.dispatch(self._for(Resume, name))

    def action_resume_all(self) -> None:
        self.dispatch(Resume())

    def action_budget(self) -> None:
        name = self._selected()
        if name is None:
            return
        if name not in self.state.datasets:
            self.write_log(f"{name} has no token budget: budgets are a dataset's", "warning")
            self.bell()
            return
        current = self.state.datasets[name].budget

        def apply(tokens: int | None) -> None:
            if tokens is not None:
                self.dispatch(SetBudget(name, tokens))

        self.push_screen(BudgetScreen(name, current), apply)

    def action_kill(self) -> None:
        name = self._selected()
        if name is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.dispatch(self._for(Kill, name))

        self.push_screen(ConfirmScreen(f"Kill {name}? In-flight requests are cancelled; finished work is kept."), confirmed)

    def action_kill_all(self) -> None:
        def confirmed(yes: bool | None) -> None:
            if yes:
                self.dispatch(Kill())

        self.push_screen(ConfirmScreen("Kill the whole run? In-flight requests are cancelled; finished work is kept."), confirmed)

    def action_detail(self) -> None:
        if (name := self._selected()) is not None:
            self.run_worker(self._show_detail(name), name=f"detail {name}", group="commands", exit_on_error=False)

    async def _show_detail(self, name: str) -> None:
        try:
            detail = await asyncio.wait_for(self.link.detail(name), timeout=self.command_timeout_s)
        except (TimeoutError, ControlError, ConnectionError, OSError) as exc:
            self.write_log(f"detail {name}: {exc or 'no answer'}", "error")
            self.bell()
            return
        self.push_screen(DetailScreen(detail_text(detail)))

    def action_sort(self) -> None:
        order = self.query_one(DatasetsTable).next_sort()
        self.write_log(f"datasets sorted by {order}")

    def action_log_level(self) -> None:
        log = self.query_one(LogView)
        log.refilter(level=LEVELS[(LEVELS.index(log.level) + 1) % len(LEVELS)])

    def action_log_dataset(self) -> None:
        log = self.query_one(LogView)
        log.refilter(dataset=None if log.dataset is not None else self.query_one(DatasetsTable).selected)

    def action_log_search(self) -> None:
        log = self.query_one(LogView)
        self.push_screen(SearchScreen(log.search), lambda text: log.refilter(search=text) if text is not None else None)

    def action_log_open(self) -> None:
        log = self.query_one(LogView)
        self.push_screen(LogScreen(log.shown_lines(), str(log.border_title)))

    def action_log_page(self, pages: int) -> None:
        self.query_one(LogView).page(pages)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_quit_console(self) -> None:
        if self.link.attached or self.engine_finished:
            self.leave()
            return
        run = self.state.run
        running = (run is not None and run.phase != RunPhase.FINISHED) or any(not d.state.terminal for d in self.state.datasets.values())
        running = running or any(s.status in (StageStatus.RUNNING, StageStatus.PAUSED) for s in self.state.stages.values())
        if not running:
            self.leave()
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.leave()

        self.push_screen(ConfirmScreen("Quit and stop the run? Finished work is kept; run again to resume."), confirmed)

    async def action_quit(self) -> None:
        """Ctrl+Q and the palette's Quit: the same as q (detach, or ask before stopping a local run)."""
        self.action_quit_console()

    def leave(self, code: int | None = None) -> None:
        """Stop the link from a worker: stopping waits on the engine, and the keys must not wait with it.
        ``code``: exit with it (a signal's), whatever the run's outcome."""
        if not self._leaving:  # a second q while the first is stopping would stop the link twice
            self._leaving = True
            self.run_worker(self._leave(code), name="leave", group="leave")

    async def _leave(self, code: int | None) -> None:
        if self._terminal_watch is not None:
            self._terminal_watch.stop()
        if self.link.attached:
            self.write_log("detaching; the run goes on")
        await self.link.stop()
        if code is None:
            code = self.link.exit_code() or 0
        self.exit(code)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette offers every key's action too, under the same words as the help screen."""
        yield from super().get_system_commands(screen)  # its Quit calls action_quit: ours
        for key in APP_KEYS:
            yield SystemCommand(f"{key.label} ({key.shown_as})", key.does, partial(self.run_action, key.action))
