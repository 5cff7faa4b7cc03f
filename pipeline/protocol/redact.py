"""Secrets never leave the process: every text that may reach a log, an event or a file passes here.

A secret is found in the forms a server or a JSON encoder may give it back in: as is, with
any of its characters escaped as ``\\uXXXX`` (JSON) or ``%XX`` (URLs), and inside base64 (an
echoed ``Authorization: Basic`` header), whatever its alignment there.
"""

from __future__ import annotations

import base64
import re
from typing import Any

__all__ = ["Redactor"]

MASK = "***"


def _char_pattern(char: str) -> str:
    code = ord(char)
    forms = [re.escape(char), rf"(?i:\\u{code:04x})"]
    if code < 0x80:
        forms.append(rf"(?i:%{code:02x})")
    if char == "/":
        forms.append(r"\\/")
    return "(?:" + "|".join(forms) + ")"


def _base64_cores(secret: str) -> list[str]:
    """The base64 characters that depend on the secret alone, for each of the three alignments."""
    raw = secret.encode("utf-8")
    cores = []
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode("ascii")
        start, end = -(-shift * 8 // 6), (shift + len(raw)) * 8 // 6
        core = encoded[start:end]
        if len(core) >= 6:
            cores += [core, core.replace("+", "-").replace("/", "_")]
    return cores


class Redactor:
    """Replaces every secret value in text that may reach a log, an event or a file."""

    def __init__(self, secrets: list[str], *, min_length: int = 4):
        values = sorted({s for s in secrets if len(s) >= min_length}, key=len, reverse=True)
        alternatives = ["".join(_char_pattern(c) for c in s) for s in values]
        alternatives += [re.escape(core) for s in values for core in _base64_cores(s)]
        self.secrets = values
        self._pattern = re.compile("|".join(alternatives)) if alternatives else None

    def __call__(self, text: str) -> str:
        return self._pattern.sub(MASK, text) if self._pattern is not None else text

    def scrub(self, value: Any) -> Any:
        """A JSON-like value with every string in it redacted (keys included)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k) if isinstance(k, str) else k: self.scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.scrub(v) for v in value]
        return value
