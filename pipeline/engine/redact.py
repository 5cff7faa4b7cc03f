"""Secrets never leave the process: every text that may reach a log, an event or a file passes here."""

from __future__ import annotations

__all__ = ["Redactor"]


class Redactor:
    """Replaces every secret value in text that may reach a log, an event or a file."""

    def __init__(self, secrets: list[str]):
        self.secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text
