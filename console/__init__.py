"""The eagleops console (Textual) and command line."""
