"""eagleops: train EAGLE-3 drafters. One namespace: ``eagleops.pipeline`` (the engine and the
stages, no UI), ``eagleops.console`` (the Textual console), ``eagleops.themes`` (its stylesheets),
and the command line here (``eagleops.cli``; ``python -m eagleops``). In a checkout these are the
top-level folders ``pipeline/``, ``console/`` and ``themes/``, linked in from ``eagleops/``.
Importing any of it has no side effects: signals are the entry point's (``eagleops.__main__``)."""

__version__ = "0.1.0"
