"""The run file's tables. Each field is declared here once, with its type, default, check and
doc; ``schema`` parses TOML into these frozen dataclasses and writes the README's reference."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..layout import RunLayout
from ..placement import is_cpu_list
from ..stages import STAGE_NAMES
from .fields import FORMATS, FieldsConfig
from .ml import BLOCK_DRAFTERS, DRAFTERS, EvalConfig, ExtractConfig, PrepareConfig, TrainConfig
from .request_fields import REQUEST_FIELDS
from .schema import Check, Table, at_least, finite_at_least, matches, one_of, parse_table, setting, within

__all__ = [
    "BLOCK_DRAFTERS",
    "DRAFTERS",
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
    "load_run",
    "parse_run",
]

THINKING = ("keep", "drop", "off")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


@dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible server; several are load-balanced (fewest in flight)."""

    REFUSED_KEYS = {"api_key": "keys never go in run files; set api_key_env to an environment variable's name"}

    base_url: str = setting(
        doc="`http(s)://host:port/v1`", check=matches(r"^https?://[^/\s]+", "must be an http(s) URL"), clean=lambda s: s.rstrip("/")
    )
    model: str = setting(doc="model id the server knows the target by")
    api_key_env: str | None = setting(
        None,
        "NAME of the environment variable holding the key",
        check=matches(r"^[A-Za-z_][A-Za-z0-9_]*$", "must be the NAME of an environment variable, not the key itself"),
    )
    max_concurrency: int | None = setting(None, "cap on this endpoint's requests in flight", check=at_least(1))
    kind: str = setting(
        "auto",
        "the server's dialect: `vllm` (also asks for exact token ids), `sglang`, `openrouter`, `openai`; `auto` tells OpenRouter by its URL",
        check=one_of("auto", "vllm", "sglang", "openrouter", "openai"),
    )

    @property
    def label(self) -> str:
        return self.base_url

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None


@dataclass(frozen=True)
class SamplingConfig:
    """How the target samples each reply."""

    max_tokens: int = setting(2048, "completion tokens per request at most", check=at_least(1))
    min_reply_tokens: int = setting(
        32,
        "with `[target]`: a prompt must leave this many of `[prepare] max_length` for its reply, or it is skipped or shortened "
        "(`long_prompts`) before it is sent; a request never asks for more than its sample has room for",
        check=at_least(1),
    )
    temperature: float = setting(0.7, "sampling temperature", check=finite_at_least(0))
    top_p: float = setting(1.0, "nucleus sampling", check=within(0, 1, include_low=False))
    extra: dict[str, Any] = setting({}, "more request fields, sent as given (e.g. `top_k`)", check=REQUEST_FIELDS)
    thinking_off_kwargs: dict[str, Any] | None = setting(None, "`chat_template_kwargs` turning thinking off; default: the target's own")
    thinking_on_kwargs: dict[str, Any] | None = setting(
        None,
        "`chat_template_kwargs` turning thinking on, for `keep` and `drop` (DeepSeek-V3.1 thinks only when asked); default: the target's own",
    )


@dataclass(frozen=True)
class RetryConfig:
    """Retries of transient failures (429, 5xx, timeouts, resets), with full-jitter backoff."""

    max_attempts: int = setting(6, "attempts per record before it goes to failed.jsonl", check=at_least(1))
    base_delay_s: float = setting(0.5, "first backoff ceiling, doubled per attempt", check=finite_at_least(0))
    max_delay_s: float = setting(30.0, "backoff ceiling", check=finite_at_least(0))
    timeout_s: float = setting(600.0, "one request's time limit", check=Check(lambda v: v > 0, "must be positive"))
    max_reply_mb: float = setting(
        32.0, "a reply larger than this is refused (and retried) unread", check=Check(lambda v: v > 0, "must be positive")
    )


@dataclass(frozen=True)
class DatasetConfig:
    """A prompt source and its token budget."""

    name: str = setting(doc="unique in the run; names its output folder", check=matches(_NAME, "use letters, digits, '_', '.', '-' only"))
    path: Path = setting(
        doc="the source, relative to the run file: a `.jsonl` (`.gz`, `.zst`), `.json` array or `.parquet` file, a glob (`data/*.parquet`), "
        "a folder of shards, one written by `datasets.save_to_disk`, or a hub-cache dataset folder"
    )
    token_budget: int = setting(doc="completion tokens to generate", tokens=True)
    format: str = setting(
        "auto",
        "the rows' shape, a field-map preset: `sharegpt`, `openai`, `prompt-response`, `tool-calling`, `trajectory`, or `auto` per row "
        "(`conversations`, `messages`, `prompt`: the first three's old names)",
        check=one_of(*FORMATS),
    )
    fields: FieldsConfig = setting(FieldsConfig())
    split: str | None = setting(
        None, "a `datasets` folder's or hub cache's split (`train`, `test`); default `train` where there are several"
    )
    max_samples: int | None = setting(None, "optional sample cap as well", check=at_least(1))
    id_field: str = setting("id", "the row's own id field; rows without one are keyed by a content hash")
    thinking: str | None = setting(None, "this dataset's thinking mode; default the run's", check=one_of(*THINKING))
    regenerate: str = setting(
        "last",
        "`last`: the reply to the last user turn; `all`: every assistant turn, in order, with the target's own earlier replies",
        check=one_of("last", "all"),
    )
    long_prompts: str = setting(
        "skip",
        "with `[target]`, a prompt too long to train a reply after (`[sampling] min_reply_tokens`): `skip` it, nothing paid "
        "(failed.jsonl says why); `drop-oldest`: drop its earliest turns until it fits, so the target sees what is trained "
        '(`regenerate = "last"` only; under `all` a conversation ends at the last reply that fits)',
        check=one_of("skip", "drop-oldest"),
    )


@dataclass(frozen=True)
class TargetConfig:
    """The target model for the ML stages: a local transformers checkpoint (nothing is downloaded)."""

    model: Path = setting(doc="checkpoint directory")
    tokenizer: Path | None = setting(None, "tokenizer directory, if not the model's")
    dtype: str = setting(
        "auto", "`auto`: bf16 where the device supports it, else fp32", check=one_of("auto", "bfloat16", "float16", "float32")
    )
    device: str = setting("auto", "`auto`: cuda if available, else cpu")
    device_map: str = setting("", "`auto`: spread the target over this node's GPUs (accelerate); for more, see `[extract] backend`")
    trust_remote_code: bool = setting(False, "run the model's own Python code (its config.json `auto_map`); only for a model you trust")

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer or self.model


@dataclass(frozen=True)
class ServeConfig:
    """A server eagleops starts and supervises for the target (vLLM: for generate, extract and eval; SGLang: for eval)."""

    python: str = setting("", "python of a venv with vLLM installed; default `$EAGLEOPS_VLLM_PYTHON`")
    model: Path | None = setting(None, "the model to serve; default `[target].model`")
    served_model_name: str = setting("target", "the model id requests name")
    tensor_parallel_size: int = setting(1, "GPUs a model replica is split over", check=at_least(1))
    pipeline_parallel_size: int = setting(1, "pipeline stages (nodes, for a model too big for one)", check=at_least(1))
    data_parallel_size: int = setting(1, "replicas", check=at_least(1))
    max_model_len: int = setting(0, "context length (0: the model's)", check=at_least(0))
    extra_args: tuple[str, ...] = setting((), "more `vllm` arguments, as given")
    env: dict[str, Any] = setting({}, "environment for the server (e.g. `VLLM_CPU_KVCACHE_SPACE`)")
    cpus: str = setting("", "cores the server runs on (`1-3,6`, as `taskset -c` reads them); eagleops keeps to the others meanwhile",
                        check=Check(is_cpu_list, "must list cores like 1-3,6, each range lowest first"))  # fmt: skip
    for_generate: bool = setting(True, "serve the target as an endpoint of the generate stage")
    startup_timeout_s: float = setting(900.0, "how long it may take to load", check=Check(lambda v: v > 0, "must be positive"))
    max_restarts: int = setting(3, "restarts after a crash, with backoff, before the stage fails", check=at_least(0))


@dataclass(frozen=True)
class RunConfig:
    """Where outputs go, how many requests are in flight, what runs."""

    datasets: tuple[DatasetConfig, ...] = setting(doc="prompt sources (`[[datasets]]`)")
    endpoints: tuple[EndpointConfig, ...] = setting((), "servers (`[[endpoints]]`); none needed when [serve] serves generate")
    name: str = setting("run", "shown in the console; names the control socket")
    output_dir: Path = setting(Path("eagleops-out"), "outputs (relative to the run file)")
    concurrency: int = setting(64, "records in flight, all datasets together", check=at_least(1))
    tokenizer: Path | None = setting(None, "counts tokens when a server omits usage")
    cancel_in_flight_over_budget: bool = setting(False, "lowering a budget cancels in-flight requests too")
    max_failed_share: float = setting(
        0.1,
        "a dataset that ends with a larger share of its rows failed, or with nothing written, ends the run with exit code 3",
        check=within(0, 1),
    )
    thinking: str = setting(
        "keep",
        "a reasoning target's thinking: `keep` (stored, trained on), `drop` (stored, flagged, not trained on), `off` (asked not to think)",
        check=one_of(*THINKING),
    )
    flush_interval_s: float = setting(0.5, "seconds between durable batches", check=Check(lambda v: v > 0, "must be positive"))
    status_interval_s: float = setting(5.0, "seconds between `--no-tui` status lines", check=Check(lambda v: v > 0, "must be positive"))
    retry_log_interval_s: float = setting(
        5.0, "retries are logged as one count per dataset this often, not one line each", check=Check(lambda v: v > 0, "must be positive")
    )
    stages: tuple[str, ...] | None = setting(
        None,
        "stages to run, in pipeline order; default all with `[target]`, else generate",
        check=Check(lambda v: all(s in STAGE_NAMES for s in v), f"stages are {', '.join(STAGE_NAMES)}"),
    )
    sampling: SamplingConfig = setting(SamplingConfig())
    retry: RetryConfig = setting(RetryConfig())
    target: TargetConfig | None = setting(None)
    prepare: PrepareConfig = setting(PrepareConfig())
    extract: ExtractConfig = setting(ExtractConfig())
    train: TrainConfig = setting(TrainConfig())
    eval: EvalConfig = setting(EvalConfig())
    serve: ServeConfig | None = setting(None)
    source: Path = setting(Path("<run>"), internal=True)

    @staticmethod
    def finish_table(config: RunConfig, table: Table) -> RunConfig:
        if not config.endpoints and not (config.serve is not None and config.serve.for_generate):
            raise table.fail("endpoints", "needs at least one [[endpoints]] entry (or a [serve] table to serve the target)")
        for stage in ("extract", "eval"):
            if getattr(config, stage).backend != "hf" and config.serve is None:
                raise table.fail(stage, f'backend = "{getattr(config, stage).backend}" needs a [serve] table (how to run the server)')
        if config.extract.backend == "vllm" and config.serve is not None and config.serve.data_parallel_size > 1:
            raise table.fail(
                "extract",
                'backend = "vllm" captures through one replica: set serve.data_parallel_size = 1 (tensor/pipeline parallel are fine)',
            )
        if config.extract.during_generate:
            if config.serve is None or not config.serve.for_generate:
                raise table.fail(
                    "extract",
                    "during_generate: the target captures as it generates only when eagleops serves it: add [serve] (for_generate = true)",
                )
            if config.serve.data_parallel_size > 1:
                raise table.fail("extract", "during_generate captures through one replica: set serve.data_parallel_size = 1")
            if config.target is None:
                raise table.fail("extract", "during_generate needs a [target] table (its layers are captured)")
        if config.train.drafter not in BLOCK_DRAFTERS:
            if config.extract.aux_layers is not None and len(config.extract.aux_layers) != 3:
                raise table.fail(
                    "extract", f"aux_layers: an EAGLE-3 drafter ({config.train.drafter}) reads three layers (low, middle, high)"
                )
            if config.train.drafter_layers > 1:
                raise table.fail("train", f"drafter_layers: {config.train.drafter} is served with one decoder layer; leave it 0 or 1")
        elif (
            config.extract.aux_layers is not None
            and config.train.drafter_layers
            and len(config.extract.aux_layers) != config.train.drafter_layers
        ):
            raise table.fail("extract", "aux_layers: a dflash drafter reads one target layer per drafter layer (train.drafter_layers)")
        if config.extract.max_cache_gb and not (config.train.overlap_extract and config.train.epochs == 1):
            raise table.fail(
                "extract",
                "max_cache_gb: deleting trained-on shards needs train.overlap_extract = true and train.epochs = 1 (a later epoch would read them again)",
            )
        if config.serve is not None and config.serve.model is None and config.target is None:
            raise table.fail("serve", "model: name the model to serve (or give a [target] table)")
        if not config.datasets:
            raise table.fail("datasets", "needs at least one [[datasets]] entry")
        seen: set[str] = set()
        for i, ds in enumerate(config.datasets):
            if ds.name in seen:
                raise table.child(f"datasets[{i}]", {}).fail("name", f"duplicate dataset name {ds.name!r}")
            seen.add(ds.name)
        wanted = config.stages if config.stages is not None else (STAGE_NAMES if config.target else ("generate",))
        if config.target is None and any(s != "generate" for s in wanted):
            raise table.fail("stages", "the ML stages need a [target] table naming the target model")
        return dataclasses.replace(config, stages=tuple(s for s in STAGE_NAMES if s in wanted))

    @property
    def stage_names(self) -> tuple[str, ...]:
        return self.stages or ()

    @property
    def layout(self) -> RunLayout:
        """Where each file of this run's output is (``pipeline.layout``)."""
        return RunLayout(self.output_dir)

    @property
    def prepared_dir(self) -> Path:
        return self.layout.prepared

    @property
    def features_dir(self) -> Path:
        return self.layout.features

    @property
    def train_dir(self) -> Path:
        return self.layout.train

    @property
    def export_dir(self) -> Path:
        return self.layout.export

    def thinking_for(self, dataset: DatasetConfig) -> str:
        return dataset.thinking or self.thinking

    def dataset(self, name: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.name == name:
                return ds
        raise KeyError(name)

    def secrets(self) -> list[str]:
        """Every API key value this run can send, for redaction."""
        keys = [key for ep in self.endpoints if (key := ep.api_key())]
        if self.train.wandb_project and (wandb_key := os.environ.get("WANDB_API_KEY")):
            keys.append(wandb_key)
        return keys


def load_run(path: str | os.PathLike[str]) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such run file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a run file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return parse_run(data, origin=str(path), base_dir=path.resolve().parent)


def parse_run(data: dict[str, Any], *, origin: str = "<run>", base_dir: Path | None = None) -> RunConfig:
    config = parse_table(RunConfig, data, "", (origin, base_dir or Path.cwd()))
    return dataclasses.replace(config, source=Path(origin))
