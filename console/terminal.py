"""What the terminal can show. Over SSH, in tmux, on a Linux console or a serial line, a
non-UTF-8 locale or a limited TERM turns box drawing and block glyphs into garbage: those
terminals get ASCII (borders, bars, plots, marks) and the same information."""

from __future__ import annotations

import codecs
import locale
import os
from collections.abc import Mapping

__all__ = ["ascii_only", "to_ascii"]

_LIMITED_TERMS = {"", "dumb", "linux", "vt100", "vt102", "vt220", "ansi", "cons25"}
_ASCII = str.maketrans(
    {
        **dict.fromkeys("█▉▊▋▌▍▎▏", "#"),
        "·": ".",
        "▁": "_",
        "▂": ".",
        "▃": "-",
        "▄": "-",
        "▅": "=",
        "▆": "+",
        "▇": "*",
        "▶": ">",
        "‖": "|",
        "✓": "+",
        "✗": "x",
        "↑": "^",
        "↓": "v",
        "…": "~",
        "—": "-",
        "→": ">",
        "°": "",
    }
)


def _locale_encoding(env: Mapping[str, str]) -> str:
    for name in ("LC_ALL", "LC_CTYPE", "LANG"):
        if value := env.get(name):
            if value in ("C", "POSIX"):
                return "ascii"
            return value.partition(".")[2].partition("@")[0] or "ascii"
    return locale.getpreferredencoding(False)


def ascii_only(env: Mapping[str, str] | None = None) -> bool:
    """True for a limited TERM (or none) or a locale whose encoding is not UTF-8;
    ``EAGLEOPS_ASCII=1`` / ``0`` decides outright."""
    env = os.environ if env is None else env
    if (forced := env.get("EAGLEOPS_ASCII")) in ("0", "1"):
        return forced == "1"
    if env.get("TERM", "") in _LIMITED_TERMS:
        return True
    try:
        return codecs.lookup(_locale_encoding(env)).name != "utf-8"
    except LookupError:
        return True


def to_ascii(text: str) -> str:
    return text.translate(_ASCII)
