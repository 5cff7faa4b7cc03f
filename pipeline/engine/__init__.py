"""The async engine: runs the stages, publishes events, takes commands, reads telemetry.

No torch at import time (the compute stages are imported when they run) and no UI.
"""

from eagleops.pipeline.engine.engine import Engine, EngineError, RunSummary

__all__ = ["Engine", "EngineError", "RunSummary"]
