"""A pane of plain text, sized by CSS, repainted only when its text changes."""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Region
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
        """Repaint the lines that changed, not the pane: over SSH every cell written is bytes,
        and the border and unchanged lines were half of what the console wrote."""
        if getattr(self.app, "ascii", False):
            text = to_ascii(text)
        if text == self._text:
            return
        old, new = self._text.split("\n"), text.split("\n")
        self._text = text
        width = self.content_region.width
        if not width:
            self.refresh()
            return
        changed = [y for y in range(max(len(old), len(new))) if y >= len(old) or y >= len(new) or old[y] != new[y]]
        self.refresh(*(Region(0, y, width, 1) for y in changed))
