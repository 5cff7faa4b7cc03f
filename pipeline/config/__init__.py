"""The run file: tables declared once (``run``), parsed and documented by ``schema``.

``python -m eagleops.pipeline.config [docs/run-file.md]`` prints the reference, or rewrites it in that file.
"""

from ..errors import ConfigError
from .fields import field_map
from .run import (
    BLOCK_DRAFTERS,
    DRAFTERS,
    DatasetConfig,
    EndpointConfig,
    EvalConfig,
    ExtractConfig,
    PrepareConfig,
    RetryConfig,
    RunConfig,
    SamplingConfig,
    ServeConfig,
    TargetConfig,
    TrainConfig,
    load_run,
    parse_run,
)
from .tokens import format_tokens, parse_tokens

__all__ = [
    "BLOCK_DRAFTERS",
    "DRAFTERS",
    "ConfigError",
    "DatasetConfig",
    "EndpointConfig",
    "EvalConfig",
    "ExtractConfig",
    "PrepareConfig",
    "RetryConfig",
    "RunConfig",
    "SamplingConfig",
    "ServeConfig",
    "TargetConfig",
    "TrainConfig",
    "field_map",
    "format_tokens",
    "load_run",
    "parse_run",
    "parse_tokens",
]
