"""Token counts as people write them: ``10M``, ``500k``, ``1.5G``, ``12000``."""

from __future__ import annotations

import math
import re

__all__ = ["MAX_TOKENS", "format_tokens", "parse_tokens"]

MAX_TOKENS = 10**15  # a quadrillion: past any real budget, so a typo like 1e99 is refused

_TOKEN_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kKmMgGbBtT]?)\s*$")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}


def parse_tokens(value: str | int | float) -> int:
    """``"10M"`` -> 10_000_000, ``"500k"`` -> 500_000, ``12000`` -> 12000."""
    if isinstance(value, bool):
        raise ValueError(f"not a token count: {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(value)
    elif isinstance(value, str):
        match = _TOKEN_RE.match(value)
        if not match:
            raise ValueError(f"not a token count: {value!r} (use e.g. 12000, 500k, 10M, 1.5G)")
        mantissa, suffix = match.groups()
        scaled = float(mantissa.replace("_", "")) * _SUFFIX[suffix.lower()]
        if scaled != int(scaled):
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(scaled)
    else:
        raise ValueError(f"not a token count: {value!r}")
    if number < 0:
        raise ValueError(f"token count must not be negative: {value!r}")
    if number > MAX_TOKENS:
        raise ValueError(f"token count {value!r} is past any real budget (at most {MAX_TOKENS:.0e})")
    return number


def format_tokens(n: float) -> str:
    """Short human form: 950, 12.3k, 4.56M, 1.20G."""
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"
