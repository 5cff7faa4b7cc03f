"""What an operator reads off the console is true (issue 20): the demo's own server is named as
ours, not as vLLM, and counts the requests it holds; the first host CPU reading is a reading."""

from __future__ import annotations

import asyncio

from eagleops.pipeline.engine.telemetry import StaticGpuReader, server_metrics, telemetry_loop
from eagleops.pipeline.protocol.events import GpuStats, HostStats, Pause
from eagleops.pipeline.servers.metrics import parse_prometheus


def test_our_model_server_is_not_named_vllm():
    ours = parse_prometheus("vllm:num_requests_running 2\nvllm:generation_tokens_total 10\neagleops_server:info 1\n")
    assert server_metrics("u", ours, None, 0.0)[0].software == "eagleops"
    real = parse_prometheus("vllm:num_requests_running 2\nvllm:generation_tokens_total 10\n")
    assert server_metrics("u", real, None, 0.0)[0].software == "vllm"


async def test_the_model_server_counts_every_request_it_holds(monkeypatch):
    """32 in flight, none being generated this instant (a batch being collected): 32 wait, not 0."""
    from aiohttp.test_utils import make_mocked_request

    from eagleops.pipeline.demo.model_server import ModelServer

    server = ModelServer.__new__(ModelServer)  # its counters and /metrics, without a model
    server.running, server.accepted = 0, 32
    server.counters = {"prompt": 0, "generation": 0, "success": 0, "aborted": 0}
    server.jobs = None
    response = await server.metrics(make_mocked_request("GET", "/metrics"))
    values = parse_prometheus(response.text)
    assert values["vllm:num_requests_waiting"] == 32 and values["vllm:num_requests_running"] == 0
    server.running = 8
    values = parse_prometheus((await server.metrics(make_mocked_request("GET", "/metrics"))).text)
    assert values["vllm:num_requests_waiting"] == 24


async def test_the_first_host_cpu_reading_is_not_the_zero_of_a_first_call(monkeypatch):
    import psutil

    calls = []

    def cpu_percent(interval=None):  # psutil's: the share since the last call, 0.0 on the first
        calls.append(interval)
        return 0.0 if len(calls) == 1 else 37.0

    monkeypatch.setattr(psutil, "cpu_percent", cpu_percent)
    readings: list[HostStats] = []

    def on_reading(key, event):
        if isinstance(event, HostStats):
            readings.append(event)

    task = asyncio.create_task(
        telemetry_loop(None, StaticGpuReader(GpuStats(gpus=(), error="no NVIDIA GPU")), list, on_reading, lambda *a: None, 0.05)
    )  # type: ignore[arg-type]
    while not readings:
        await asyncio.sleep(0.01)
    task.cancel()
    assert readings[0].cpu_percent == 37.0


def _paid(name: str, state: str, tokens: int, budget: int, cost: float):
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState

    return DatasetProgress(name=name, state=DatasetState(state), tokens=tokens, budget=budget, samples=1, cost=cost)


def test_projected_spend_prices_each_dataset_alone_and_only_what_is_to_come():
    from eagleops.console.report import projected_spend, status_line, totals_cells, totals_line

    # the one paid dataset has finished: nothing more to pay, however big the free ones' budgets
    finished_paid = [_paid("paid", "done", 1000, 1000, 1.00), _paid("free", "running", 2_420, 1_000_000, 0.0)]
    assert projected_spend(finished_paid) == 1.00
    assert totals_cells(finished_paid)["state"] == "$1.00/$1.00"
    assert "spend $1.00/$1.00" in totals_line(finished_paid)
    # a paid dataset half way: twice what it has cost; a free one beside it adds nothing
    half = [_paid("paid", "running", 500, 1000, 1.00), _paid("free", "running", 10, 10_000_000, 0.0)]
    assert projected_spend(half) == 2.00
    assert "spend $1.00/$2.00" in status_line(half[0])


# ---- the run status line ------------------------------------------------------------------

T0 = 1_780_000_000.0


def _state(*events):
    from eagleops.console.state import ConsoleState

    state = ConsoleState()
    for event in events:
        state.apply(event)
    return state


def _live_run(**kw):
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, RunPhase, RunState, StageState, StageStatus

    return [
        RunState("kimi-drafter", kw.pop("phase", RunPhase.LIVE), T0, kw.pop("exit_code", None), kw.pop("ended_at", None), at=T0),
        StageState("generate", StageStatus.RUNNING, at=T0),
        DatasetProgress("paid", DatasetState.RUNNING, 500, 1000, 10, tok_per_s=1200.0, eta_s=90.0, cost=1.0, at=T0),
        DatasetProgress("free", DatasetState.RUNNING, 100, 1000, 10, tok_per_s=6000.0, eta_s=300.0, at=T0),
    ]


def test_the_status_line_says_run_state_elapsed_rate_eta_and_spend_in_80_columns():
    from eagleops.console.panes.status import run_status_text

    text = run_status_text(_state(*_live_run()), 78, now=T0 + 754)
    assert text.plain == "kimi-drafter  ● live  12m34s  7.2k tok/s  ETA 5m00s  spend $1.00/$2.00", text.plain
    assert "7.2k tok/s" in text.plain and "ETA 5m00s" in text.plain and "$1.00/$2.00" in text.plain
    assert len(text.plain) <= 78
    assert run_status_text(_state(*_live_run()), 78, now=T0 + 754, ascii=True).plain.isascii()
    narrow = run_status_text(_state(*_live_run()), 40, now=T0 + 754).plain
    assert narrow.startswith("kimi-drafter  ● live  spend $1.00/$2.00") and len(narrow) <= 40


def test_the_status_line_says_how_the_run_ended_and_clears_what_is_no_longer_live():
    from eagleops.console.panes.status import run_state_word, run_status_text
    from eagleops.pipeline.protocol.events import RunPhase

    for code, word, colour in (
        (0, "done", "green"),
        (1, "failed (exit 1)", "red"),
        (3, "done, output short (exit 3)", "red"),
        (130, "killed", "yellow"),
    ):
        state = _state(*_live_run(phase=RunPhase.FINISHED, exit_code=code, ended_at=T0 + 60))
        said, style = run_state_word(state)
        assert said.startswith(word) and colour in style
        text = run_status_text(state, 120, now=T0 + 3600).plain
        assert "1m00s" in text and "tok/s" not in text and "ETA" not in text  # the elapsed time stops with the run
    gone = _state(*_live_run())
    gone.lose_engine(T0 + 30)
    text = run_status_text(gone, 120, now=T0 + 600).plain
    assert "engine gone, figures stale" in text and "tok/s" not in text and "30s" in text


def test_failures_per_minute_come_from_the_counts_over_the_last_minute():
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState

    state = _state(*[DatasetProgress("a", DatasetState.RUNNING, 1, 10, 1, failures=n, at=T0 + t) for t, n in ((0, 5), (30, 15), (60, 35))])
    assert state.failures_per_minute(T0 + 60) == 30.0  # 30 new in the minute; the 5 it came with are old
    assert state.failures_per_minute(T0 + 200) == 0.0  # nothing new in the last minute
    # a dataset seen for the first time brings its failures so far: not a burst
    state.apply(DatasetProgress("b", DatasetState.RUNNING, 1, 10, 1, failures=1208, at=T0 + 201))
    assert state.failures_per_minute(T0 + 202) == 0.0


def test_a_finished_dataset_is_done_with_its_overshoot_and_a_lowered_budget_finishing():
    from eagleops.console.report import dataset_cells
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, StopReason

    assert dataset_cells(DatasetProgress("a", DatasetState.DONE, 10_012, 10_000, 5))["state"] == "done +12"
    assert dataset_cells(DatasetProgress("a", DatasetState.DONE, 10_000, 10_000, 5))["state"] == "done"
    assert dataset_cells(DatasetProgress("a", DatasetState.RUNNING, 9_000, 5_000, 5, in_flight=3))["state"] == "finishing"
    exhausted = DatasetProgress("a", DatasetState.DONE, 80_000, 200_000, 5, stopped_by=StopReason.SOURCE_EXHAUSTED)
    assert dataset_cells(exhausted)["state"] == "done (source)"


def test_failure_counts_are_coloured_by_their_share_of_the_rows():
    from eagleops.console.panes.datasets import failure_level
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState

    assert failure_level(DatasetProgress("a", DatasetState.RUNNING, 1, 10, 1000, failures=1)) == ""
    assert failure_level(DatasetProgress("a", DatasetState.RUNNING, 1, 10, 1000, failures=20)) == "warn"
    assert failure_level(DatasetProgress("a", DatasetState.RUNNING, 1, 10, 10, failures=1208)) == "alarm"


def test_log_lines_are_coloured_by_level():
    from rich.text import Text

    from eagleops.console.logview import LevelHighlighter, stamped

    error, warning = Text("12:00:01 ERROR   a.jsonl:3 (p3): HTTP 400"), Text("12:00:01 WARNING 3 retries in 5s")
    LevelHighlighter().highlight(error)
    LevelHighlighter().highlight(warning)
    assert any("red" in str(span.style) for span in error.spans) and any("yellow" in str(span.style) for span in warning.spans)
    assert stamped("lost the engine", "error", at=T0).endswith(" ERROR   lost the engine")


def test_permanent_failures_past_a_datasets_first_few_are_grouped():
    from eagleops.pipeline.generate.digest import FailureDigest

    lines = []
    digest = FailureDigest(lambda level, message, dataset: lines.append((level, message, dataset)), interval_s=5)
    alone = [digest.should_log_alone("B1") for _ in range(5)]
    assert alone == [True, True, True, False, False] and digest.should_log_alone("B2")
    for i in range(40):
        digest.note_failure("B1", f"a.jsonl:{i}", "HTTP 400: bad request")
    digest.flush()
    assert lines == [("error", "40 more permanent failures in 5s (B1 40): HTTP 400 x40; e.g. a.jsonl:0, a.jsonl:1, a.jsonl:2", "B1")]


def test_attach_takes_the_socket_option_the_several_engines_error_names():
    from eagleops.cli import _parser

    args = _parser().parse_args(["attach", "--socket", "/run/x.sock"])
    assert str(args.socket or args.socket_option) == "/run/x.sock"


# ---- the console app ------------------------------------------------------------------------


async def test_when_the_engine_goes_without_a_last_word_nothing_looks_live():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.panes import DatasetsTable, RunStatus

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    link = ScriptedLink(fixed_events())
    link.queue.put_nowait(None)  # the stream ends: no RunState finished came
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.query_one(DatasetsTable)
        assert table.cell("B2", "state") == "stale" and table.cell("B2", "tok_s") == "-"
        assert table.cell("B1", "state").startswith("done")  # what had finished stays as it was
        assert "engine gone, figures stale" in app.query_one(RunStatus).render().plain


async def test_q_asks_before_stopping_an_in_process_run_in_its_ml_stages():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.screens import ConfirmScreen
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, RunPhase, RunState, StageState, StageStatus

    from .test_console import ScriptedLink, _at, _settle

    link = ScriptedLink(
        [
            RunState("demo", RunPhase.LIVE, T0, at=T0),
            StageState("generate", StageStatus.DONE, at=T0),
            StageState("train", StageStatus.RUNNING, at=T0),
            DatasetProgress("B1", DatasetState.DONE, 1000, 1000, 10, at=T0),
        ]
    )
    link.attached = False  # the engine runs in the console's own process: q would stop it
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and app.is_running
        await pilot.press("escape")


async def test_dialogs_are_ascii_on_an_ascii_terminal_and_centred(monkeypatch):
    from eagleops.console.app import EagleOpsApp

    from .test_console import ScriptedLink, _at, _eight_datasets, _settle

    monkeypatch.setenv("EAGLEOPS_ASCII", "1")
    app = EagleOpsApp(ScriptedLink(_eight_datasets()), clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        for key, close in (("b", "escape"), ("slash", "escape")):
            await pilot.press(key)
            await pilot.pause()
            dialog = app.screen.query_one("#dialog")
            svg = app.export_screenshot()
            glyphs = sorted({c for c in svg if not c.isascii()})
            assert not glyphs, (key, glyphs)
            left, right = dialog.region.x, 80 - dialog.region.right
            assert abs(left - right) <= 1, (key, dialog.region)  # centred, not drawn top-left
            await pilot.press(close)
            await pilot.pause()
        await pilot.press("ctrl+p")  # the palette draws an emoji and block borders: off here
        await pilot.pause()
        assert not any(type(s).__name__ == "CommandPalette" for s in app.screen_stack)


async def test_help_at_80x24_wraps_each_line_under_its_own_column():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.screens import HelpScreen

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    app = EagleOpsApp(ScriptedLink(fixed_events()), clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        static = app.screen.query_one("#dialog Static")
        lines = static.render().plain.splitlines() if hasattr(static.render(), "plain") else str(static.render()).splitlines()
        assert max(len(line) for line in lines) <= static.content_region.width, static.content_region


def _training_events():
    from eagleops.pipeline.protocol.events import (
        DatasetProgress,
        DatasetState,
        GpuStats,
        RunPhase,
        RunState,
        StageMetrics,
        StageProgress,
        StageState,
        StageStatus,
    )

    gib = 2**30
    events = [
        RunState("kimi-drafter", RunPhase.LIVE, T0 - 7200, at=T0),
        StageState("generate", StageStatus.DONE, at=T0),
        StageState("prepare", StageStatus.DONE, at=T0),
        StageState("extract", StageStatus.DONE, at=T0),
        StageState("train", StageStatus.RUNNING, at=T0),
        StageState("export", StageStatus.PENDING, at=T0),
        StageState("eval", StageStatus.PENDING, at=T0),
        DatasetProgress("B1", DatasetState.DONE, 1000, 1000, 10, at=T0),
        GpuStats(((0, "NVIDIA H200", 97.0, 120 * gib, 141 * gib, 64.0, 610.0),), at=T0),
        StageMetrics("extract", {"cache_bytes": 12 * gib, "cache_bound_bytes": 100 * 10**9, "shards": 45}, at=T0),
    ]
    for step in range(1, 41):
        loss = 6.0 / (1 + step / 5)
        acc = [round(0.7 - 0.4 / step - 0.08 * k, 3) for k in range(7)]
        events.append(
            StageMetrics("train", {"step": step, "epoch": 0, "loss": loss, "lr": 3e-4, "acc": acc, "tokens_per_s": 12_300.0}, at=T0)
        )
    events.append(StageMetrics("train", {"checkpoint_step": 40, "checkpoint_at": T0 - 95}, at=T0))
    events.append(StageProgress("train", 40, 70, "steps", rate=0.4, eta_s=75.0, at=T0))
    return events


def test_the_ml_view_shows_trains_loss_accuracy_rate_checkpoint_and_memory():
    from eagleops.console.panes.training import training_lines

    lines = training_lines(_state(*_training_events()), 76, 14, now=T0)
    text = "\\n".join(lines)
    assert lines[0].startswith("train ") and "40/70 steps" in lines[0] and "ETA 1m15s" in lines[0] and "0.4 steps/s" in lines[0]
    assert "feature cache 12.0 GiB of 93.1 GiB (max_cache_gb)" in text and "GPU0 120.0 GiB/141.0 GiB" in text
    assert "loss 0.667" in text and "12.3k tok/s" in text and "saved step 40 (1m35s ago)" in text
    assert "accuracy by draft position  0.69 0.61" in text
    assert any(set(line) <= set(" ▁▂▃▄▅▆▇█") and line for line in lines)  # the loss plot
    assert len(lines) <= 14 and all(len(line) <= 76 for line in lines[1:])


async def test_while_train_runs_its_view_takes_the_tables_place_and_p_pauses_it():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.panes import DatasetsTable, TrainingView

    from .test_console import ScriptedLink, _at, _settle

    link = ScriptedLink(_training_events())
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        assert app.query_one(TrainingView).display and not app.query_one(DatasetsTable).display
        await pilot.press("p")
        await pilot.pause(0.1)
        assert link.sent and link.sent[-1] == Pause(stage="train")  # addressed to the stage, not a dataset of that name
        await pilot.press("b")  # a stage has no budget: said, not a crash
        await pilot.pause(0.1)
        assert app.is_running


async def test_a_command_shows_on_its_row_at_once_not_at_the_next_tick():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.panes import DatasetsTable

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    app = EagleOpsApp(ScriptedLink(fixed_events()), clock=_at, refresh_s=3600)  # no tick during the test
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        assert app.query_one(DatasetsTable).cell("B1", "state").startswith("done")
        await pilot.press("down")  # B2, running
        await pilot.press("p")
        await pilot.pause(0.2)
        assert app.query_one(DatasetsTable).cell("B2", "state") == "paused"


async def test_o_opens_the_log_whole_so_a_long_line_can_be_read():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.screens import LogScreen
    from eagleops.pipeline.protocol.events import LogEvent

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    long = "B2: HTTP 400 " + " ".join(f"word{i}" for i in range(60)) + " THE-END"
    app = EagleOpsApp(ScriptedLink([*fixed_events(), LogEvent("error", long, "B2", at=T0)]), clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        await pilot.press("o")
        await pilot.pause()
        assert isinstance(app.screen, LogScreen)
        assert any(line.endswith(long) for line in app.screen.lines)
        assert "THE-END" in app.export_screenshot()  # wrapped into view, not cut at the edge
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, LogScreen)


def test_summaries_leave_a_piece_out_whole_never_cut_a_number():
    from eagleops.console.report import status_line, totals_line
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, StopReason

    many = [
        DatasetProgress(
            f"dataset-{i}", DatasetState.RUNNING, 123_456_789, 999_999_999, 1_234_567, failures=12_345, cost=1234.59, eta_s=99_999.0
        )
        for i in range(9)
    ]
    for width in (60, 70, 80, 91):
        line = totals_line(many, width)
        assert len(line) <= width and "~" not in line
        assert "spend $11111.31/$" in line or len(line) + len("  spend $11111.31/$89997.93") > width
    done = DatasetProgress(
        "B1", DatasetState.DONE, 10_012, 10_000, 5, reason="budget reached, overshoot 12 tokens", stopped_by=StopReason.BUDGET
    )
    line = status_line(done)
    assert "done +12" in line and "overshoot~" not in line and "[budget reached]" in line


def test_the_readmes_screenshots_are_the_snapshot_tests_screens():
    """README shows docs/console-*.svg: kept equal to the snapshots the tests compare against."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    for view in ("generate", "train"):
        snapshot = root / "__snapshots__" / "test_console" / f"test_snapshots_at_design_sizes[120x40-{view}-dark].svg"
        assert (root.parents[1] / "docs" / f"console-{view}.svg").read_bytes() == snapshot.read_bytes(), (
            f"cp '{snapshot}' docs/console-{view}.svg"
        )


def test_a_paused_stage_says_so_and_every_line_fits():
    from eagleops.console.panes.training import training_lines
    from eagleops.pipeline.protocol.events import StageState, StageStatus

    state = _state(*_training_events(), StageState("train", StageStatus.PAUSED, at=T0))
    for width in (76, 118, 196):  # the content widths at 80x24, 120x40, 200x60
        lines = training_lines(state, width, 14, now=T0)
        assert lines[0].startswith("train paused") and all(len(line) <= width for line in lines), (width, lines)
    assert len(training_lines(state, 40, 14, now=T0)[0]) <= 40  # narrower: the pane cuts the others with an ellipsis


def test_the_ml_view_of_a_gone_engine_says_its_figures_are_not_live():
    from eagleops.console.panes.training import training_lines

    state = _state(*_training_events())
    state.lose_engine(T0 + 5)
    assert training_lines(state, 76, 14, now=T0 + 60)[0] == "engine gone: its last figures, not live"


def test_a_column_once_shown_stays_while_the_numbers_grow():
    """The Think column vanished mid-run at 80 columns when the token counts grew: the name now
    gives up width for it."""
    from eagleops.console.panes.datasets import COLUMNS, layout

    early = {key: len(label) for key, label, _ in COLUMNS} | {"dataset": 16, "state": 7, "tokens": 9, "samples": 7}
    shown = {key for key, _, _ in layout(early, 78)}
    later = early | {"tokens": 11, "samples": 9, "state": 9}
    assert {key for key, _, _ in layout(later, 78)} < shown  # without memory a column goes
    kept = layout(later, 78, frozenset(shown))
    assert {key for key, _, _ in kept} == shown and sum(w for _, _, w in kept) + 2 * (len(kept) - 1) <= 78
    assert dict((k, w) for k, _, w in kept)["dataset"] >= 8


async def test_the_log_follows_new_lines_after_an_attach_and_a_cleared_filter():
    """An attached console gets the engine's last 50 lines at once, before its layout: the log
    stayed on the oldest and never followed the new ones."""
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.logview import LogView
    from eagleops.pipeline.protocol.events import LogEvent

    from .test_console import ScriptedLink, _at, _settle, fixed_events

    backlog = [LogEvent("info", f"old line {i}", at=T0) for i in range(50)]
    link = ScriptedLink([*fixed_events(), *backlog])
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        log = app.query_one(LogView)
        link.queue.put_nowait(LogEvent("warning", "the newest line", at=T0))
        await pilot.pause(0.2)
        assert log.scroll_y == log.max_scroll_y > 0 and "newest" in str(log.lines[-1])
        await pilot.press("pageup")
        await pilot.pause()
        reading = log.scroll_y
        link.queue.put_nowait(LogEvent("info", "while reading back", at=T0))
        await pilot.pause(0.2)
        assert log.scroll_y == reading  # reading back is not interrupted
        log.refilter(search="line")
        log.refilter(search="")
        await pilot.pause(0.2)
        link.queue.put_nowait(LogEvent("info", "after the filter", at=T0))
        await pilot.pause(0.2)
        assert log.scroll_y == log.max_scroll_y and "after the filter" in str(log.lines[-1])


async def test_once_the_engine_is_gone_its_commands_are_off_and_its_death_is_said():
    from eagleops.console.app import EagleOpsApp
    from eagleops.console.panes import StagesPane

    from .test_console import ScriptedLink, _at, _log_lines, _settle, fixed_events

    link = ScriptedLink(fixed_events())
    link.queue.put_nowait(None)  # the engine's stream ends without its last word
    app = EagleOpsApp(link, clock=_at)
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        await pilot.pause(0.1)
        assert any("lost the engine without its last word" in line for line in _log_lines(app))
        for key in ("p", "b", "k", "enter"):
            await pilot.press(key)
            await pilot.pause(0.05)
        assert link.sent == [] and app.screen is app.screen_stack[0]  # nothing sent, no dialog opened
        assert app.check_action("pause", ()) is False and app.check_action("help", ()) is True  # the footer drops what is off
        assert "▶ generate  stale" in str(app.query_one(StagesPane).render())


async def test_the_table_keys_are_off_while_the_ml_view_is_in_its_place():
    from eagleops.console.app import EagleOpsApp

    from .test_console import ScriptedLink, _at, _log_lines, _settle

    app = EagleOpsApp(ScriptedLink(_training_events()), clock=_at)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        for key in ("enter", "b", "s", "f"):
            await pilot.press(key)
            await pilot.pause(0.05)
        lines = _log_lines(app)
        assert not any("no dataset named" in line or "sorted by" in line or "no token budget" in line for line in lines), lines


def test_paused_work_shows_no_rate_and_no_eta():
    """Pausing kept the rate meter's last seconds on screen (2.68k tok/s, 19 steps/s, an ETA)."""
    from eagleops.console.panes.status import run_status_text
    from eagleops.console.panes.training import training_lines
    from eagleops.console.report import dataset_cells, totals_cells
    from eagleops.pipeline.protocol.events import DatasetProgress, DatasetState, StageState, StageStatus

    paused = DatasetProgress("a", DatasetState.PAUSED, 500, 1000, 10, tok_per_s=2680.0, req_per_s=3.0, eta_s=30.0)
    cells = dataset_cells(paused)
    assert (cells["tok_s"], cells["req_s"], cells["eta"]) == ("-", "-", "-")
    assert totals_cells([paused])["tok_s"] == "0.0" and totals_cells([paused])["eta"] == "-"
    train = _state(*_training_events(), StageState("train", StageStatus.PAUSED, at=T0))
    line = run_status_text(train, 118, now=T0).plain
    assert "paused" in line and "steps/s" not in line and "ETA" not in line
    assert "ETA" not in training_lines(train, 118, 14, now=T0)[0]


def test_a_console_attaching_mid_train_gets_the_loss_curve_so_far(tmp_path):
    """An attached console plotted the loss only from its attach on (71 of 124 logged steps)."""
    from eagleops.console.state import ConsoleState
    from eagleops.pipeline.engine import Engine
    from eagleops.pipeline.protocol.events import StageMetrics
    from tests.conftest import make_config, write_jsonl

    source = write_jsonl(tmp_path / "a.jsonl", [{"id": "p0", "prompt": "x"}])
    engine = Engine(make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "A", "path": str(source), "token_budget": 10}]))
    for step in range(1, 125):
        engine.publish(StageMetrics("train", {"step": step, "loss": 10.0 / step, "acc": [0.5]}))
    attached = ConsoleState()
    for event in engine.subscribe().queue._queue:  # what a console attaching now receives first
        attached.apply(event)
    assert len(attached.train_loss) == 124


def test_a_stages_rate_leaves_out_its_pauses_and_a_resumes_earlier_work(monkeypatch):
    """After p and r the train's rate halved and its ETA doubled (9.6 against 19 steps/s): the
    paused seconds counted as work; a resumed train's earlier steps counted as this run's."""
    import threading

    from eagleops.pipeline.protocol.events import StageProgress
    from eagleops.pipeline.training import context as context_module
    from eagleops.pipeline.training.context import StageContext

    now = [1000.0]
    monkeypatch.setattr(context_module.time, "monotonic", lambda: now[0])
    sent: list = []
    ctx = StageContext("train", sent.append)
    ctx.progress(500, 2000, "steps")  # resumed at step 500: not done at this run's speed
    now[0] += 10
    ctx.progress(700, 2000, "steps")  # 20 steps/s
    ctx.pause()

    def hundred_seconds_later() -> None:  # on the clock the stage reads
        now[0] += 100
        ctx.resume()

    threading.Timer(0.05, hundred_seconds_later).start()
    ctx.checkpoint()  # waits out the pause
    now[0] += 10
    ctx.progress(900, 2000, "steps", force=True)
    progress = [e for e in sent if isinstance(e, StageProgress)]
    assert progress[1].rate == 20.0 and progress[-1].rate == 20.0 and progress[-1].eta_s == 55.0


def test_a_resumed_datasets_rate_is_measured_from_its_resume():
    from eagleops.pipeline.generate.endpoints import RateMeter

    now = [0.0]
    meter = RateMeter(window_s=30, clock=lambda: now[0])
    for _ in range(10):
        meter.add(100)
        now[0] += 1  # 100 tokens/s for 10 s
    now[0] += 20  # paused 20 s
    meter.restart()
    for _ in range(5):
        meter.add(100)
        now[0] += 1
    assert meter.rates()[1] == 100.0  # not 60: the pause is not in it
