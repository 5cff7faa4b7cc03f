"""The pipeline's stages, listed once. The run file's ``stages`` key, the command line's
subcommands and torchrun's entry, the engine's schedule and the console's stages pane all read
this list; nothing else names them in order.

Generate runs on the engine's event loop (requests in flight, no torch); every other stage is a
compute stage: a function ``(config, ctx) -> result`` that the engine runs in a worker thread and
torchrun runs on every rank, imported only when it starts (``entry``), so that a generate-only run
never loads torch. Torch-free, like the rest of this layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPUTE_STAGES", "STAGES", "STAGE_NAMES", "Stage", "stage"]


@dataclass(frozen=True)
class Stage:
    name: str
    summary: str  # the command line's help for it
    entry: str | None  # "module:function" of a compute stage; None for generate, the engine's own
    needs_target: bool  # refused at once without a [target] table

    @property
    def compute(self) -> bool:
        return self.entry is not None


_TRAINING = "eagleops.pipeline.training"
STAGES: tuple[Stage, ...] = (
    Stage("generate", "regenerate replies from the target through OpenAI-compatible servers", None, needs_target=False),
    Stage(
        "prepare", "merge, dedupe, shuffle, template, tokenize, loss masks, draft vocabulary", f"{_TRAINING}.prepare.stage:prepare", True
    ),
    Stage("extract", "run the target and store the hidden states EAGLE-3 trains on", f"{_TRAINING}.extract.stage:extract", True),
    Stage(
        "train",
        "train the drafter (several GPUs: torchrun --nproc_per_node N -m eagleops train RUN.toml)",
        f"{_TRAINING}.train.loop:train",
        True,
    ),
    Stage("export", "write the drafter for SGLang/vLLM (config.json + safetensors)", f"{_TRAINING}.export.stage:export", True),
    Stage(
        "eval",
        "acceptance length on held-out prompts: offline, or through vLLM / SGLang ([eval] backend)",
        f"{_TRAINING}.eval.stage:evaluate",
        True,
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
COMPUTE_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.compute)
_BY_NAME = {s.name: s for s in STAGES}


def stage(name: str) -> Stage:
    """The stage called ``name``; KeyError names the stages there are."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; the stages are {', '.join(STAGE_NAMES)}") from None
