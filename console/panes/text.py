"""A pane of plain text, sized by CSS, repainted only when its text changes."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from ..terminal import to_ascii

__all__ = ["TextPane"]


class TextPane(Widget):
    """A pane of plain text whose size is fixed by CSS: a change repaints it without a layout
    pass (Static.update would re-lay-out the whole screen)."""

    def __init__(self, title: str, **kwargs):
        super().__init__(**kwargs)
        self.border_title = title
        self._text = ""

    def render(self) -> Text:
        if getattr(self.app, "ascii", False):
            return Text(self._text, no_wrap=True, overflow="crop")
        return Text(self._text, no_wrap=True, overflow="ellipsis")

    def show_text(self, text: str) -> None:
        if getattr(self.app, "ascii", False):
            text = to_ascii(text)
        if text != self._text:
            self._text = text
            self.refresh()
