"""Run configuration: a TOML file, validated into frozen dataclasses.

Every error names the file and the key path (``run.toml: datasets[2].token_budget: ...``)
so a typo costs seconds, not a failed multi-day run.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ALL_STAGES",
    "ConfigError",
    "EvalConfig",
    "ExtractConfig",
    "PrepareConfig",
    "TargetConfig",
    "TrainConfig",
    "DatasetConfig",
    "EndpointConfig",
    "RetryConfig",
    "RunConfig",
    "SamplingConfig",
    "format_tokens",
    "load_run",
    "parse_run",
    "parse_tokens",
]

FORMATS = ("auto", "conversations", "messages", "prompt")


class ConfigError(ValueError):
    """A run file that cannot be used; the message names the file and key."""


_TOKEN_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kKmMgGbBtT]?)\s*$")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}


def parse_tokens(value: str | int | float) -> int:
    """``"10M"`` -> 10_000_000, ``"500k"`` -> 500_000, ``12000`` -> 12000."""
    if isinstance(value, bool):
        raise ValueError(f"not a token count: {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(value)
    elif isinstance(value, str):
        match = _TOKEN_RE.match(value)
        if not match:
            raise ValueError(f"not a token count: {value!r} (use e.g. 12000, 500k, 10M, 1.5G)")
        mantissa, suffix = match.groups()
        scaled = float(mantissa.replace("_", "")) * _SUFFIX[suffix.lower()]
        if scaled != int(scaled):
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(scaled)
    else:
        raise ValueError(f"not a token count: {value!r}")
    if number < 0:
        raise ValueError(f"token count must not be negative: {value!r}")
    return number


def format_tokens(n: float) -> str:
    """Short human form: 950, 12.3k, 4.56M, 1.20G."""
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str
    model: str
    api_key_env: str | None = None
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        return self.base_url

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 2048
    temperature: float = 0.7
    top_p: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 6
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    timeout_s: float = 600.0


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    path: Path
    token_budget: int
    format: str = "auto"
    max_samples: int | None = None
    id_field: str = "id"


@dataclass(frozen=True)
class TargetConfig:
    """The target model for the ML stages: a local transformers checkpoint (no hub downloads)."""

    model: Path
    tokenizer: Path | None = None
    dtype: str = "auto"  # auto: bf16 where the device supports it, else fp32
    device: str = "auto"  # auto: cuda if available, else cpu

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer or self.model


@dataclass(frozen=True)
class PrepareConfig:
    max_length: int = 2048
    seed: int = 0
    draft_vocab_size: int = 32000
    eval_fraction: float = 0.05
    eval_max: int = 200
    extra: tuple[Path, ...] = ()  # pre-tokenized JSONL: {"input_ids": [...], "loss_mask": [...]}
    shard_samples: int = 4096


@dataclass(frozen=True)
class ExtractConfig:
    aux_layers: tuple[int, ...] | None = None  # None: [1, N//2 - 1, N - 4] as EAGLE-3
    batch_tokens: int = 8192
    shard_samples: int = 256


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 5
    lr: float = 3e-5
    batch_size: int = 1
    ttt_length: int = 7
    step_weight: float = 0.8
    warmup_ratio: float = 0.015
    max_grad_norm: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 200
    max_steps: int = 0  # 0: no cap
    log_every: int = 10


@dataclass(frozen=True)
class EvalConfig:
    prompts: int = 20
    max_new_tokens: int = 64
    draft_tokens: int = 4


@dataclass(frozen=True)
class RunConfig:
    source: Path
    output_dir: Path
    datasets: tuple[DatasetConfig, ...]
    endpoints: tuple[EndpointConfig, ...]
    sampling: SamplingConfig = SamplingConfig()
    retry: RetryConfig = RetryConfig()
    concurrency: int = 64
    tokenizer: Path | None = None
    name: str = "run"
    cancel_in_flight_over_budget: bool = False
    flush_interval_s: float = 0.5
    status_interval_s: float = 5.0
    target: TargetConfig | None = None
    prepare: PrepareConfig = PrepareConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    stages: tuple[str, ...] = ("generate",)

    @property
    def prepared_dir(self) -> Path:
        return self.output_dir / "prepared"

    @property
    def features_dir(self) -> Path:
        return self.output_dir / "features"

    @property
    def train_dir(self) -> Path:
        return self.output_dir / "train"

    @property
    def export_dir(self) -> Path:
        return self.output_dir / "drafter"

    def dataset(self, name: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise KeyError(name)

    def secrets(self) -> list[str]:
        """Every API key value this run can send, for redaction."""
        return [key for ep in self.endpoints if (key := ep.api_key())]


class _Table:
    """A TOML table being validated: tracks which keys were read so leftovers are typos."""

    def __init__(self, data: Any, where: str, origin: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: {where or 'top level'}: expected a table")
        self.data, self.where, self.origin = data, where, origin
        self.used: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {self._name(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, required: bool = False):
        self.used.add(key)
        if key not in self.data:
            if required or default is ...:
                raise self.fail(key, "missing (required)")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(key, f"expected {_kind_names(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise self.fail(key, f"expected {_kind_names(kinds)}, got {type(value).__name__} {value!r}")
        return value

    def positive_int(self, key: str, default: Any = ..., *, allow_none: bool = False) -> int | None:
        value = self.get(key, int, None if allow_none else default)
        if value is None:
            return None
        if value < 1:
            raise self.fail(key, f"must be at least 1, got {value}")
        return value

    def tokens(self, key: str, *, required: bool = False, default: Any = None) -> int | None:
        value = self.get(key, (int, str, float), default, required=required)
        if value is None:
            return None
        try:
            return parse_tokens(value)
        except ValueError as exc:
            raise self.fail(key, str(exc)) from None

    def finish(self, allowed_extra: tuple[str, ...] = ()) -> None:
        for key in self.data:
            if key in self.used or key in allowed_extra:
                continue
            hint = difflib.get_close_matches(key, sorted(self.used), n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise self.fail(key, f"unknown key{suggestion}")


ALL_STAGES = ("generate", "prepare", "extract", "train", "export", "eval")


def _parse_ml(top: _Table, origin: str, resolve) -> dict[str, Any]:
    """The optional [target], [prepare], [extract], [train] and [eval] tables."""
    out: dict[str, Any] = {}
    raw_target = top.get("target", dict, None)
    if raw_target is not None:
        t = _Table(raw_target, "target", origin)
        tokenizer = t.get("tokenizer", str, None)
        dtype = t.get("dtype", str, "auto")
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise t.fail("dtype", f"must be auto, bfloat16, float16 or float32, got {dtype!r}")
        out["target"] = TargetConfig(
            model=resolve(t.get("model", str, required=True)),
            tokenizer=resolve(tokenizer) if tokenizer else None,
            dtype=dtype,
            device=t.get("device", str, "auto"),
        )
        t.finish()

    t = _Table(top.get("prepare", dict, {}), "prepare", origin)
    fraction = t.get("eval_fraction", float, 0.05)
    if not 0 <= fraction < 1:
        raise t.fail("eval_fraction", "must be in [0, 1)")
    extra = t.get("extra", list, [])
    if not all(isinstance(e, str) for e in extra):
        raise t.fail("extra", "must be a list of paths")
    out["prepare"] = PrepareConfig(
        max_length=t.positive_int("max_length", 2048),
        seed=t.get("seed", int, 0),
        draft_vocab_size=t.positive_int("draft_vocab_size", 32000),
        eval_fraction=fraction,
        eval_max=t.get("eval_max", int, 200),
        extra=tuple(resolve(e) for e in extra),
        shard_samples=t.positive_int("shard_samples", 4096),
    )
    t.finish()

    t = _Table(top.get("extract", dict, {}), "extract", origin)
    layers = t.get("aux_layers", list, None)
    if layers is not None and (len(layers) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
        raise t.fail("aux_layers", "must be three layer indices (low, middle, high), e.g. [1, 15, 28]")
    out["extract"] = ExtractConfig(
        aux_layers=tuple(layers) if layers is not None else None,
        batch_tokens=t.positive_int("batch_tokens", 8192),
        shard_samples=t.positive_int("shard_samples", 256),
    )
    t.finish()

    t = _Table(top.get("train", dict, {}), "train", origin)
    train = TrainConfig(
        epochs=t.positive_int("epochs", 5),
        lr=t.get("lr", float, 3e-5),
        batch_size=t.positive_int("batch_size", 1),
        ttt_length=t.positive_int("ttt_length", 7),
        step_weight=t.get("step_weight", float, 0.8),
        warmup_ratio=t.get("warmup_ratio", float, 0.015),
        max_grad_norm=t.get("max_grad_norm", float, 0.5),
        weight_decay=t.get("weight_decay", float, 0.0),
        seed=t.get("seed", int, 0),
        checkpoint_every=t.positive_int("checkpoint_every", 200),
        max_steps=t.get("max_steps", int, 0),
        log_every=t.positive_int("log_every", 10),
    )
    if train.lr <= 0:
        raise t.fail("lr", "must be positive")
    if not 0 <= train.warmup_ratio < 1:
        raise t.fail("warmup_ratio", "must be in [0, 1)")
    out["train"] = train
    t.finish()

    t = _Table(top.get("eval", dict, {}), "eval", origin)
    out["eval"] = EvalConfig(
        prompts=t.positive_int("prompts", 20),
        max_new_tokens=t.positive_int("max_new_tokens", 64),
        draft_tokens=t.positive_int("draft_tokens", 4),
    )
    t.finish()

    default = ALL_STAGES if "target" in out else ("generate",)
    stages = t_stages = top.get("stages", list, list(default))
    unknown = [s for s in t_stages if s not in ALL_STAGES]
    if unknown:
        raise top.fail("stages", f"unknown stage(s) {', '.join(map(repr, unknown))}; stages are {', '.join(ALL_STAGES)}")
    if "target" not in out and any(s != "generate" for s in stages):
        raise top.fail("stages", "the ML stages need a [target] table naming the target model")
    out["stages"] = tuple(s for s in ALL_STAGES if s in stages)
    return out


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list", dict: "a table"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def load_run(path: str | os.PathLike[str]) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such run file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return parse_run(data, origin=str(path), base_dir=path.resolve().parent)


def parse_run(data: dict[str, Any], *, origin: str = "<run>", base_dir: Path | None = None) -> RunConfig:
    base = base_dir or Path.cwd()

    def resolve(p: str) -> Path:
        candidate = Path(os.path.expanduser(p))
        return candidate if candidate.is_absolute() else (base / candidate)

    top = _Table(data, "", origin)
    name = top.get("name", str, "run")
    output_dir = resolve(top.get("output_dir", str, "eagleops-out"))
    concurrency = top.positive_int("concurrency", 64)
    tokenizer = top.get("tokenizer", str, None)
    cancel_over = top.get("cancel_in_flight_over_budget", bool, False)
    flush_interval = top.get("flush_interval_s", float, 0.5)
    status_interval = top.get("status_interval_s", float, 5.0)
    if flush_interval <= 0:
        raise top.fail("flush_interval_s", "must be positive")

    sampling_t = _Table(top.get("sampling", dict, {}), "sampling", origin)
    max_tokens = sampling_t.positive_int("max_tokens", 2048)
    temperature = sampling_t.get("temperature", float, 0.7)
    top_p = sampling_t.get("top_p", float, 1.0)
    if temperature < 0:
        raise sampling_t.fail("temperature", "must not be negative")
    if not 0 < top_p <= 1:
        raise sampling_t.fail("top_p", "must be in (0, 1]")
    extra = sampling_t.get("extra", dict, {})
    sampling_t.finish()
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p, extra=dict(extra))

    retry_t = _Table(top.get("retry", dict, {}), "retry", origin)
    retry = RetryConfig(
        max_attempts=retry_t.positive_int("max_attempts", 6),
        base_delay_s=retry_t.get("base_delay_s", float, 0.5),
        max_delay_s=retry_t.get("max_delay_s", float, 30.0),
        timeout_s=retry_t.get("timeout_s", float, 600.0),
    )
    retry_t.finish()

    raw_endpoints = top.get("endpoints", list, required=True)
    if not raw_endpoints:
        raise top.fail("endpoints", "needs at least one [[endpoints]] entry")
    endpoints = []
    for i, raw in enumerate(raw_endpoints):
        t = _Table(raw, f"endpoints[{i}]", origin)
        url = t.get("base_url", str, required=True).rstrip("/")
        if not re.match(r"^https?://[^/\s]+", url):
            raise t.fail("base_url", f"must be an http(s) URL, got {url!r}")
        api_key_env = t.get("api_key_env", str, None)
        if api_key_env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", api_key_env):
            raise t.fail("api_key_env", "must be the NAME of an environment variable, not the key itself")
        if "api_key" in t.data:
            raise t.fail("api_key", "keys never go in run files; set api_key_env to an environment variable's name")
        endpoints.append(
            EndpointConfig(
                base_url=url,
                model=t.get("model", str, required=True),
                api_key_env=api_key_env,
                max_concurrency=t.positive_int("max_concurrency", allow_none=True),
            )
        )
        t.finish()

    raw_datasets = top.get("datasets", list, required=True)
    if not raw_datasets:
        raise top.fail("datasets", "needs at least one [[datasets]] entry")
    datasets: list[DatasetConfig] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_datasets):
        t = _Table(raw, f"datasets[{i}]", origin)
        ds_name = t.get("name", str, required=True)
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", ds_name):
            raise t.fail("name", f"use letters, digits, '_', '.', '-' only, got {ds_name!r}")
        if ds_name in seen:
            raise t.fail("name", f"duplicate dataset name {ds_name!r}")
        seen.add(ds_name)
        fmt = t.get("format", str, "auto")
        if fmt not in FORMATS:
            raise t.fail("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
        datasets.append(
            DatasetConfig(
                name=ds_name,
                path=resolve(t.get("path", str, required=True)),
                token_budget=t.tokens("token_budget", required=True),
                format=fmt,
                max_samples=t.positive_int("max_samples", allow_none=True),
                id_field=t.get("id_field", str, "id"),
            )
        )
        t.finish()
    ml = _parse_ml(top, origin, resolve)
    top.finish()

    return RunConfig(
        **ml,
        source=Path(origin),
        output_dir=output_dir,
        datasets=tuple(datasets),
        endpoints=tuple(endpoints),
        sampling=sampling,
        retry=retry,
        concurrency=concurrency,
        tokenizer=resolve(tokenizer) if tokenizer else None,
        name=name,
        cancel_in_flight_over_budget=cancel_over,
        flush_interval_s=flush_interval,
        status_interval_s=status_interval,
    )
