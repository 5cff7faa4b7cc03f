"""The only seam between the engine and any front end: typed events out, typed commands in, the
Unix control socket that carries both, and the one formatter that turns events into text."""
