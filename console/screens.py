"""Modal screens: the live budget input, kill confirmation, and help."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from eagleops.pipeline.config import format_tokens, parse_tokens

from .keymap import help_markup
from .terminal import to_ascii

__all__ = ["BudgetScreen", "ConfirmScreen", "DetailScreen", "HelpScreen", "SearchScreen"]


class BudgetScreen(ModalScreen[int | None]):
    """Ask for a new token budget (10M, 500k, 12000); dismiss with the number, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, dataset: str, current: int):
        super().__init__()
        self.dataset, self.current = dataset, current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"New token budget for [b]{self.dataset}[/b] (now {format_tokens(self.current)})")
            yield Input(placeholder="e.g. 12M, 500k, 120000", id="budget-input")
            yield Label("", id="budget-error", classes="error")
            yield Static("[dim]Enter applies live, Esc cancels[/dim]")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            tokens = parse_tokens(event.value)
        except ValueError as exc:
            self.query_one("#budget-error", Label).update(str(exc))
            return
        if tokens == 0:
            self.query_one("#budget-error", Label).update("a budget of 0 stops the dataset: use kill for that")
            return
        self.dismiss(tokens)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question)
            yield Static("[b]y[/b] yes, [b]n[/b] no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


# 64: the inner width of #dialog in themes/base.tcss (72, less its border and padding), less the
# 2 columns of the scrollbar the help shows at 80x24: at 66 every long line wrapped under the keys
HELP = f"""\
[b]eagleops console[/b]

{help_markup(width=64)}

[b]Mouse[/b]: a click selects a dataset; the wheel scrolls the log.
[b]Ctrl+P[/b]: the command palette, every action above by name.
The log acknowledges every command, or says why it failed.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):  # at 80x24 the keys run past the screen: ↑ ↓ PgDn scroll them
            yield Static(to_ascii(HELP) if getattr(self.app, "ascii", False) else HELP)

    def action_close(self) -> None:
        self.dismiss(None)


class DetailScreen(ModalScreen[None]):
    """One dataset in detail: failures by reason, latency, endpoints, truncation."""

    BINDINGS = [Binding("escape,enter,q", "close", "Close")]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(escape(to_ascii(self.text) if getattr(self.app, "ascii", False) else self.text))
            yield Static("[dim]Esc closes[/dim]")

    def action_close(self) -> None:
        self.dismiss(None)


class SearchScreen(ModalScreen[str | None]):
    """Ask for a text the log must contain; empty shows every line again."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: str):
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Show log lines containing (empty: all lines)")
            yield Input(value=self.current, id="search-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class LogScreen(ModalScreen[None]):
    """The log's lines as the filter shows them, whole and wrapped, the newest in view: the
    log pane cuts a long line at its edge."""

    BINDINGS = [Binding("escape,q,o", "close", "Close")]

    def __init__(self, lines: list[str], title: str):
        super().__init__()
        self.lines, self.title_text = lines, title

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog"):
            yield Label(f"[b]{escape(self.title_text)}[/b]: {len(self.lines)} lines, Esc closes")
            text = "\n".join(self.lines) or "(nothing)"
            yield Static(escape(to_ascii(text) if getattr(self.app, "ascii", False) else text))

    def on_mount(self) -> None:
        self.query_one("#dialog").scroll_end(animate=False)

    def action_close(self) -> None:
        self.dismiss(None)
