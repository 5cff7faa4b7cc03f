"""The eagleops console (Textual) and command line."""

# First, before anything heavy is imported: a headless run holds its signals from here on
# (`python -m console.cli` and the `eagleops` script both import this package before the module).
from console import early_signals  # noqa: F401
