"""The Prometheus ``/metrics`` text of vLLM and SGLang servers as plain numbers, read with
``prometheus_client``'s own parser so labels, escapes, HELP/TYPE lines and histograms are
understood rather than guessed at.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["parse_prometheus"]

# Gauges that are a fraction or a per-engine average: summed over data-parallel engines they
# would pass 1 (or double an acceptance length), so their series are averaged instead.
_AVERAGED_SUFFIXES = ("_perc", "usage", "accept_length", "accept_rate", "_ratio")
# A histogram bucket or summary quantile counts up to its bound: added up they mean nothing.
_SHAPE_LABELS = ("le", "quantile")
_STAMPED_TYPES = ("counter", "histogram", "summary")  # the kinds prometheus_client gives a _created
MODEL_LABEL = "model_name"  # what vLLM and SGLang both label each series with


def parse_prometheus(text: str, *, split_by: str | None = None, model: str | None = None) -> dict[str, float]:
    """Sample name (counters keep ``_total``; histograms give ``_sum`` and ``_count``) -> value
    over every series: summed, or averaged for fractions (see ``_AVERAGED_SUFFIXES``).

    ``split_by`` keeps one label apart: ``name[value]`` (vLLM's per-position acceptance counts).
    ``model`` keeps only the series of that ``model_name`` where a server labels several.
    Raises ValueError for text that is not the Prometheus exposition format."""
    families = list(text_string_to_metric_families(text))
    stamped = {family.name for family in families if family.type in _STAMPED_TYPES}
    series: dict[str, list[float]] = defaultdict(list)
    averaged: set[str] = set()
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if any(label in labels for label in _SHAPE_LABELS) or _creation_time(sample.name, stamped):
                continue
            if model is not None and labels.get(MODEL_LABEL, model) != model:
                continue
            key = f"{sample.name}[{labels[split_by]}]" if split_by is not None and split_by in labels else sample.name
            series[key].append(float(sample.value))
            if sample.name.endswith(_AVERAGED_SUFFIXES):
                averaged.add(key)
    return {key: sum(values) / len(values) if key in averaged else sum(values) for key, values in series.items()}


def _creation_time(name: str, stamped: set[str]) -> bool:
    """``x_created`` beside a counter or histogram ``x``: when it started, not what it counted."""
    return name.endswith("_created") and name.removesuffix("_created") in stamped
