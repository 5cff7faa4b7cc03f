"""The eagleops console: the Textual TUI that renders a run's events and sends its commands
through the protocol, and the text of those events (``report``) it shares with ``--no-tui``."""
