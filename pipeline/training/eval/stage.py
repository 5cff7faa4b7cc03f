"""eval: the acceptance length of the exported drafter on the held-out prompts and on each
benchmark of ``[[eval.benchmarks]]`` (one table: eval.json, beside the drafter, the log), offline
(``offline``: transformers) or served (``served``: vLLM or SGLang with the drafter, as in
production); reported beside the training curves.

The exported drafter reads the target layers its config names; they must be the layers of the
features extract wrote last, checked before anything loads: a drafter fed other layers than it
learned on still drafts, only badly, and nothing else would say why."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.errors import InputError
from eagleops.pipeline.training.artifacts import EvalResult, features_capture
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.eval.benchmarks import (
    BenchmarkItem,
    Decode,
    Work,
    ask_turns,
    benchmark_table,
    load_benchmark,
    write_benchmarks,
)
from eagleops.pipeline.training.eval.offline import evaluate_offline
from eagleops.pipeline.training.modeling.drafter_config import exported_capture
from eagleops.pipeline.training.modeling.profile import target_profile
from eagleops.pipeline.training.modeling.target import load_target_tokenizer, require_target
from eagleops.pipeline.training.modeling.thinking_switch import template_kwargs
from eagleops.pipeline.training.modeling.turns import reply_stop_ids
from eagleops.pipeline.training.tracking import Trackers

__all__ = ["evaluate"]


def _held_out_prompts(config: RunConfig) -> list[dict[str, Any]]:
    path = config.layout.held_out
    prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: config.eval.prompts]
    if not prompts:
        raise InputError(f"{path}: no held-out prompts (prepare.eval_fraction is 0?)")
    return prompts


def _prompt_ids(tokenizer: Any, held: dict[str, Any]) -> list[int]:
    """The ids the server fed the target (prepare writes them); rendered again for an older
    eval.jsonl without them."""
    if isinstance(held.get("prompt_ids"), list):
        return [int(i) for i in held["prompt_ids"]]
    encoded = tokenizer.apply_chat_template(held["messages"], add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _check_export_against_features(config: RunConfig) -> None:
    """The export's layers must be the features' (when those are still there to ask)."""
    found = features_capture(config.features_dir)
    if found is not None:
        config_file = config.layout.exported_config
        exported_capture(config_file).require_match(
            config_file,
            found[0],
            found[1],
            "the features were extracted again with other layers since this drafter was trained; train and export again",
        )


def _report_acceptance(config: RunConfig, results: list[EvalResult]) -> None:
    """Beside the training curves: acceptance at the step the drafter was trained to, the
    held-out prompts' as ``eval/acceptance_length`` and each benchmark's under its name."""
    history = config.layout.history
    step = sum(1 for _ in open(history)) if history.exists() else 0
    trackers = Trackers(config.train_dir, wandb_project=config.train.wandb_project, run_name=config.name)
    scalars = {"eval/acceptance_length": results[0].acceptance_length}
    for r in results[1:]:
        scalars[f"eval/{r.benchmark}/acceptance_length"] = r.acceptance_length
        scalars.update({f"eval/{r.benchmark}/accept_rate_p{j + 1}": rate for j, rate in enumerate(r.acceptance_rate_per_position)})
    try:
        trackers.log(step, scalars)
    finally:
        trackers.close()


def _work(config: RunConfig, ctx: StageContext, tokenizer: Any, thinking: str) -> list[Work]:
    """The held-out prompts first (the ids the server fed the target), then each benchmark."""
    prompts = [_prompt_ids(tokenizer, row) for row in _held_out_prompts(config)]
    benchmarks = [
        (bench, load_benchmark(bench, config.eval.prompts)) for bench in config.eval.benchmarks
    ]  # read first: a bad file fails fast
    total = len(prompts) + sum(len(items) for _, items in benchmarks)
    done = 0

    def advanced(step: int = 1) -> None:
        nonlocal done
        done += step
        ctx.progress(done, total, "questions", force=done == total)

    def held_out(decode: Decode) -> list[list[int]]:
        nonlocal done
        done = 0  # each backend pass (served: with the drafter, then without) counts from the start
        outputs = []
        for prompt in prompts:
            outputs.append(decode(prompt))
            advanced()
        return outputs

    work: list[Work] = [("held-out", len(prompts), held_out)]
    template = template_kwargs(config, target_profile(config).thinking_switch, thinking)

    def asked(items: list[BenchmarkItem]) -> Callable[[Decode], list[list[int]]]:
        return lambda decode: ask_turns(items, tokenizer, template, decode, on_item=lambda _: advanced())

    work += [(bench.name, len(items), asked(items)) for bench, items in benchmarks]
    return work


def _report(config: RunConfig, ctx: StageContext, results: list[EvalResult]) -> None:
    """The table in the log, beside the drafter, in eval.json, the trackers and the console."""
    main = results[0]
    config.layout.eval_result.write_text(json.dumps({**main.to_json(), "benchmarks": [r.to_json() for r in results]}, indent=1))
    write_benchmarks(results, config.layout.eval_benchmarks)
    _report_acceptance(config, results)
    for line in benchmark_table(results).splitlines():
        ctx.log("info", f"eval: {line}")
    for r in results:
        if r.greedy_mismatches:
            ctx.log(
                "warning",
                f"eval: {r.benchmark}: {r.greedy_mismatches} of {r.outputs or r.prompts} outputs with the drafter differ from plain greedy "
                f"decoding's ({r.backend}{'; eval-differences.jsonl says where' if r.backend != 'hf' else ''}): verifying several tokens "
                "in one forward rounds differently from decoding one, so near-ties can flip (docs/ml-stages.md: what eval can promise)",
            )


def evaluate(config: RunConfig, ctx: StageContext, *, untrained: bool = False, backend: str | None = None) -> EvalResult:
    """Acceptance length on the held-out prompts and every benchmark, by ``backend`` (default:
    the run file's). Returns the held-out result; each set's is in eval.json's ``benchmarks``."""
    target = require_target(config)
    if not untrained:
        _check_export_against_features(config)
    tokenizer = load_target_tokenizer(target)
    work = _work(config, ctx, tokenizer, config.thinking)
    chosen = backend or config.eval.backend
    if chosen in ("vllm", "sglang") and not untrained:
        from eagleops.pipeline.training.eval.served import evaluate_served, evaluate_sglang

        serve = evaluate_served if chosen == "vllm" else evaluate_sglang
        results = serve(config, ctx, work, config.export_dir)
    else:
        results = evaluate_offline(config, ctx, work, reply_stop_ids(tokenizer, target.model), untrained=untrained)
    result = results[0]
    ctx.metrics(**result.to_json())
    if not untrained:
        _report(config, ctx, results)  # the table, one row a set: the held-out prompts' is this result
        return result
    per_position, k = result.acceptance_rate_per_position, result.draft_tokens
    ctx.log(
        "info",
        f"eval ({result.backend}, untrained drafter): acceptance length {result.acceptance_length:.2f} over {result.verify_steps} verify steps ({k} draft tokens); per position {per_position}",
    )
    return result
