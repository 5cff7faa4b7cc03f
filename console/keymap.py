"""Every key of the console, declared once: the bindings, the help screen and the README's key table are built from it."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from itertools import groupby

from rich.markup import escape
from textual.binding import Binding, BindingType

__all__ = ["APP_KEYS", "DATASET_KEYS", "KEYMAP", "Key", "bindings", "help_markup", "help_rows", "markdown_table"]


@dataclass(frozen=True)
class Key:
    key: str  # Textual's name for the key
    action: str
    label: str  # in the footer
    does: str  # one line in the help screen and the README
    in_footer: bool = True

    @property
    def shown_as(self) -> str:
        return _SHOWN_AS.get(self.key, self.key)


_SHOWN_AS = {
    "up": "↑",
    "down": "↓",
    "home": "Home",
    "end": "End",
    "question_mark": "?",
    "ctrl+q": "Ctrl+Q",
    "enter": "Enter",
    "slash": "/",
    "pageup": "PgUp",
    "pagedown": "PgDn",
}

# Bound on the datasets table, not the app: they move its cursor.
DATASET_KEYS = (
    Key("up", "cursor(-1)", "Up", "select a dataset", in_footer=False),
    Key("down", "cursor(1)", "Down", "select a dataset", in_footer=False),
    Key("home", "cursor(-1000)", "First", "select the first / last dataset", in_footer=False),
    Key("end", "cursor(1000)", "Last", "select the first / last dataset", in_footer=False),
)

APP_KEYS = (
    Key("p", "pause", "Pause", "pause the selected dataset (in-flight requests finish), or the ML stage on screen"),
    Key("P", "pause_all", "Pause all", "pause every dataset", in_footer=False),
    Key("r", "resume", "Resume", "resume the selected dataset (a killed one restarts), or the ML stage on screen"),
    Key("R", "resume_all", "Resume all", "resume every dataset", in_footer=False),
    Key("b", "budget", "Budget", "set the selected dataset's token budget, live (10M, 500k, 120000)"),
    Key("k", "kill", "Kill", "kill the selected dataset, or the ML stage on screen (asks first)"),
    Key("K", "kill_all", "Kill run", "kill the whole run (asks first)", in_footer=False),
    Key("enter", "detail", "Detail", "the selected dataset in detail: failures by reason, latency, endpoints, cuts"),
    Key("s", "sort", "Sort", "sort the datasets: source order, progress, tok/s, failures, state", in_footer=False),
    Key("l", "log_level", "Log level", "the log: every line, warnings and worse, errors only", in_footer=False),
    Key("f", "log_dataset", "Log dataset", "the log: only the selected dataset's lines (again: all)", in_footer=False),
    Key("slash", "log_search", "Search", "the log: only lines containing a text", in_footer=False),
    Key("o", "log_open", "Open log", "the log's lines whole, wrapped, to read and scroll (the newest last)", in_footer=False),
    Key("pageup", "log_page(-1)", "Log up", "scroll the log (the mouse wheel does too)", in_footer=False),
    Key("pagedown", "log_page(1)", "Log down", "scroll the log (the mouse wheel does too)", in_footer=False),
    Key("question_mark", "help", "Help", "the help screen: every key and what it does"),
    Key(
        "q",
        "quit_console",
        "Quit",
        "close the console: the run goes on (`eagleops attach` returns to it); with --in-process it stops (asks first)",
    ),
    Key(
        "ctrl+q",
        "quit_console",
        "Quit",
        "close the console: the run goes on (`eagleops attach` returns to it); with --in-process it stops (asks first)",
        in_footer=False,
    ),
)

KEYMAP = DATASET_KEYS + APP_KEYS


def bindings(keys: tuple[Key, ...]) -> list[BindingType]:
    # the footer's own key glyphs (⏎ for Enter) are not ASCII; ours are where they can be
    return [Binding(k.key, k.action, k.label, show=k.in_footer, key_display=k.shown_as if k.shown_as.isascii() else None) for k in keys]


def help_rows(keys: tuple[Key, ...] = KEYMAP) -> list[tuple[list[str], str]]:
    """(keys as typed, what they do): neighbours that do the same thing share a row, as ↑ ↓ do."""
    return [([k.shown_as for k in group], does) for does, group in groupby(keys, key=lambda k: k.does)]


def help_markup(keys: tuple[Key, ...] = KEYMAP, width: int = 66) -> str:
    """Two aligned columns; a long line wraps under its own column, not under the keys."""
    rows = [(" ".join(shown), does) for shown, does in help_rows(keys)]
    indent = 2 + max(len(shown) for shown, _ in rows) + 3
    lines = []
    for shown, does in rows:
        wrapped = textwrap.wrap(does, width - indent) or [""]
        lines.append(f"  [b]{escape(shown)}[/b]{' ' * (indent - 2 - len(shown))}{escape(wrapped[0])}")
        lines += [" " * indent + escape(more) for more in wrapped[1:]]
    return "\n".join(lines)


def markdown_table(keys: tuple[Key, ...] = KEYMAP) -> str:
    """The README's key table, so it cannot drift from the bindings (a test compares them)."""
    lines = ["| key | does |", "|---|---|"]
    for shown, does in help_rows(keys):
        typed = " ".join(f"`{s}`" for s in shown)
        cell = does.replace("|", r"\|")
        lines.append(f"| {typed} | {cell} |")
    return "\n".join(lines)
