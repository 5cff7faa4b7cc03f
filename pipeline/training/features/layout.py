"""What features a run file asks for: the capture layout extract writes into the index it
starts (the layers picked here, once), and the identity a following train waits for."""

from __future__ import annotations

from typing import NamedTuple

from eagleops.pipeline.config import BLOCK_DRAFTERS, RunConfig
from eagleops.pipeline.errors import ConfigError
from eagleops.pipeline.training.artifacts import CaptureLayout, FeaturesIndex
from eagleops.pipeline.training.modeling.layers import default_aux_layers, dflash_aux_layers, drafter_layer_count

__all__ = ["FeatureSet", "aux_layers_for_run", "capture_for_run", "feature_set_for_run"]


class FeatureSet(NamedTuple):
    """Which features an index holds: an index naming another set holds other features (extract
    starts afresh; a following train does not take it)."""

    prepared: str  # the fingerprint of the prepared data
    aux_layers: tuple[int, ...]
    storage: str
    shard_samples: int | None

    @classmethod
    def of(cls, index: FeaturesIndex) -> FeatureSet:
        return cls(index.prepared, tuple(index.aux_layers), index.storage, index.shard_samples)


def aux_layers_for_run(config: RunConfig, num_layers: int) -> tuple[int, ...]:
    """The run file's ``extract.aux_layers``, else the drafter's default for the target's depth:
    EAGLE-3's three, or one per dflash layer."""
    if config.extract.aux_layers:
        aux_layers = tuple(config.extract.aux_layers)
    elif config.train.drafter in BLOCK_DRAFTERS:
        aux_layers = dflash_aux_layers(num_layers, drafter_layer_count(config.train))
    else:
        aux_layers = default_aux_layers(num_layers)
    if max(aux_layers) >= num_layers:
        raise ConfigError(f"{config.source}: extract.aux_layers {list(aux_layers)}: the target has only {num_layers} layers")
    return aux_layers


def capture_for_run(config: RunConfig, num_layers: int, hidden_size: int) -> CaptureLayout:
    """What this run file's extract captures of a target ``num_layers`` deep, ``hidden_size`` wide."""
    return CaptureLayout(aux_layers_for_run(config, num_layers), hidden_size, config.extract.storage)


def feature_set_for_run(config: RunConfig, prepared: str, num_layers: int) -> FeatureSet:
    """The features this run file's extract makes of the prepared data ``prepared``."""
    return FeatureSet(prepared, aux_layers_for_run(config, num_layers), config.extract.storage, config.extract.shard_samples)
