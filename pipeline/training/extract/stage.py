"""extract: the target's hidden states for every prepared sample, as feature shards train reads
(``features/``). Two backends fill the same shards and index: transformers in this process
(``hf``) or a vLLM server with our capture hooks (``served``)."""

from __future__ import annotations

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.training.artifacts import FeaturesIndex
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.extract.hf import extract_hf

__all__ = ["extract"]


def extract(config: RunConfig, ctx: StageContext) -> FeaturesIndex:
    if config.extract.backend == "vllm":
        from eagleops.pipeline.training.extract.served import extract_served

        return extract_served(config, ctx)
    return extract_hf(config, ctx)
