"""eval's served backends, ``backend = "vllm"`` (or ``"sglang"``): vLLM serves the target with our exported drafter, as it would in
production, and the acceptance comes from its own spec-decode counters.

The held-out prompts and each benchmark's questions are sent as token ids (rendered by the target's chat template, never
re-tokenised), greedy, one at a time. Counters are read before and after, so the figures are
deltas over each set (the held-out prompts, each benchmark), not since the server started. The same prompts then go through a plain
vLLM (no drafter): its outputs must equal the speculative ones, and its tok/s is the baseline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagleops.pipeline.config import RunConfig
from eagleops.pipeline.placement import parse_cpu_list
from eagleops.pipeline.servers.sglang import SglangLaunch, generate_ids, sglang_python
from eagleops.pipeline.servers.supervisor import SupervisedServer
from eagleops.pipeline.servers.vllm import complete_ids, launch_for, read_metrics, vllm_server
from eagleops.pipeline.training.artifacts import EvalResult
from eagleops.pipeline.training.context import StageContext, serving
from eagleops.pipeline.training.eval.acceptance import Acceptance, acceptance_from_counts
from eagleops.pipeline.training.eval.benchmarks import Decode, Work
from eagleops.pipeline.training.modeling.drafter_config import drafting

__all__ = ["DIFFERENCES", "evaluate_served", "evaluate_sglang", "write_differences"]

DIFFERENCES = "eval-differences.jsonl"  # in the output folder: each output the drafter changed, and where

_DRAFTS = "vllm:spec_decode_num_drafts_total"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


Measured = tuple[list[list[int]], dict[str, float], float]  # (outputs, counter deltas, generated tok/s) of one set


def _timed(work: list[Work], decode: Decode, ctx: StageContext, counters: Callable[[], dict[str, float]]) -> list[Measured]:
    """Each set of ``work`` decoded in turn, with its own counter deltas and rate."""
    measured = []
    for _, _, run in work:
        before = counters()
        started = time.perf_counter()
        outputs = run(decode)
        elapsed = time.perf_counter() - started
        after = counters()
        deltas = {key: value - before.get(key, 0.0) for key, value in after.items()}
        measured.append((outputs, deltas, sum(map(len, outputs)) / elapsed if elapsed > 0 else 0.0))
    return measured


def _decode(config: RunConfig, ctx: StageContext, work: list[Work], spec: dict[str, Any] | None) -> list[Measured]:
    """Every set of ``work`` through one vLLM server, with the drafter (``spec``) or without."""
    serve = config.serve
    if serve is None:  # checked when the run file was read; the type checker wants it here too
        raise ValueError("no [serve] table")
    launch = launch_for(config, speculative_config=spec)
    name = "vllm-eval-speculative" if spec else "vllm-eval-plain"
    log_path = config.layout.server_log(name)
    server = vllm_server(launch, log_path=log_path, log=ctx.log, startup_timeout_s=serve.startup_timeout_s, max_restarts=0)
    with serving(server, ctx):

        def decode(prompt: list[int]) -> list[int]:
            ctx.checkpoint()
            return complete_ids(server.base_url, launch.served_name, prompt, config.eval.max_new_tokens)

        return _timed(work, decode, ctx, lambda: read_metrics(server.base_url))


def evaluate_served(config: RunConfig, ctx: StageContext, work: list[Work], export_dir: Path) -> list[EvalResult]:
    method, k = drafting(export_dir / "config.json", config.eval.draft_tokens)
    spec = {"method": method, "model": str(export_dir), "num_speculative_tokens": k}
    questions = sum(n for _, n, _ in work)
    ctx.log(
        "info", f"eval: vLLM with the drafter ({method}, {k} draft tokens), then without, over {questions} questions in {len(work)} sets"
    )
    speculative = _decode(config, ctx, work, spec)
    plain = _decode(config, ctx, work, None)
    write_differences(config.output_dir, work, speculative, plain)
    results = []
    for (name, n, _), (spec_out, deltas, spec_tps), (plain_out, _, plain_tps) in zip(work, speculative, plain):
        # vLLM counts drafts (verify steps), accepted tokens, and the drafts whose j-th token was accepted
        accepted_at = [deltas.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{j}]", 0.0) for j in range(k)]
        acceptance = acceptance_from_counts(deltas.get(_DRAFTS, 0.0), deltas.get(_ACCEPTED, 0.0), accepted_at)
        results.append(_served_result("vllm", export_dir, k, acceptance, n, (spec_out, plain_out), (spec_tps, plain_tps), name))
    return results


def _sglang_decode(config: RunConfig, ctx: StageContext, work: list[Work], draft: Path | None) -> list[Measured]:
    """Every set through SGLang with or without the drafter; its counters are the replies' own
    (``completion_tokens``, ``spec_verify_ct``), summed per set."""
    serve = config.serve
    if serve is None or config.target is None:  # checked when the run file was read
        raise ValueError("no [serve] or [target] table")
    # the export's config.json read once: how it drafts (a chain, or one block)
    method, k = drafting(draft / "config.json", config.eval.draft_tokens) if draft else ("eagle3", config.eval.draft_tokens)
    launch = SglangLaunch(
        python=sglang_python(serve.python),
        model=serve.model or config.target.model,
        tensor_parallel_size=serve.tensor_parallel_size,
        data_parallel_size=serve.data_parallel_size,
        extra_args=serve.extra_args,
        env={key: str(value) for key, value in serve.env.items()},
        draft=draft,
        draft_tokens=k,
        block=method == "dflash",
        cpus=parse_cpu_list(serve.cpus),
    )
    name = "sglang-eval-speculative" if draft else "sglang-eval-plain"
    server = SupervisedServer(name, launch.argv, log_path=config.layout.server_log(name), log=ctx.log,
                              env=launch.env, startup_timeout_s=serve.startup_timeout_s, max_restarts=0, cpus=launch.cpus)  # fmt: skip
    totals = {"generated": 0.0, "verify_steps": 0.0}
    with serving(server, ctx):

        def decode(prompt: list[int]) -> list[int]:
            ctx.checkpoint()
            ids, meta = generate_ids(server.base_url, prompt, config.eval.max_new_tokens)
            totals["generated"] += int(meta.get("completion_tokens", len(ids)))
            totals["verify_steps"] += int(meta.get("spec_verify_ct", 0))
            return ids

        return _timed(work, decode, ctx, lambda: dict(totals))


def evaluate_sglang(config: RunConfig, ctx: StageContext, work: list[Work], export_dir: Path) -> list[EvalResult]:
    """SGLang's acceptance length: generated tokens per verify step over each set (its per-request
    ``completion_tokens / spec_verify_ct``, summed). SGLang does not split it by draft position."""
    _, k = drafting(export_dir / "config.json", config.eval.draft_tokens)
    ctx.log("info", f"eval: SGLang with the drafter ({k} draft tokens), then without, over {len(work)} sets")
    speculative = _sglang_decode(config, ctx, work, export_dir)
    plain = _sglang_decode(config, ctx, work, None)
    write_differences(config.output_dir, work, speculative, plain)
    results = []
    for (name, n, _), (spec_out, deltas, spec_tps), (plain_out, _, plain_tps) in zip(work, speculative, plain):
        steps, generated = deltas["verify_steps"], deltas["generated"]
        acceptance = acceptance_from_counts(steps, generated - steps)  # each step gains its accepted drafts + 1
        results.append(_served_result("sglang", export_dir, k, acceptance, n, (spec_out, plain_out), (spec_tps, plain_tps), name))
    return results


def write_differences(output_dir: Path, work: list[Work], speculative: list[Measured], plain: list[Measured]) -> None:
    """Every output with the drafter that is not plain decoding's, with the first token where they
    part (``eval-differences.jsonl``): what to look at when the counts say they differ."""
    with open(output_dir / DIFFERENCES, "w", encoding="utf-8") as f:
        for (name, _, _), (spec_out, _, _), (plain_out, _, _) in zip(work, speculative, plain):
            for i, (a, b) in enumerate(zip(spec_out, plain_out)):
                if a != b:
                    first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    line = {"benchmark": name, "output": i, "first_difference": first, "speculative": a, "plain": b}
                    f.write(json.dumps(line) + "\n")


def _served_result(
    backend: str,
    export_dir: Path,
    draft_tokens: int,
    acceptance: Acceptance,
    prompts: int,
    outputs: tuple[list, list],
    rates: tuple[float, float],
    benchmark: str,
) -> EvalResult:
    """An engine's eval: the same prompts decoded with the drafter and without (``outputs``,
    ``rates`` in tokens/s); greedy decoding must give the same tokens either way."""
    speculative, plain = outputs
    return EvalResult(
        drafter=str(export_dir),
        prompts=prompts,
        verify_steps=acceptance.verify_steps,
        draft_tokens=draft_tokens,
        acceptance_length=acceptance.length,
        acceptance_rate_per_position=acceptance.rate_per_position,
        greedy_mismatches=sum(a != b for a, b in zip(speculative, plain)),
        outputs=len(speculative),
        backend=backend,
        tok_per_s=round(rates[0], 2),
        tok_per_s_without_drafter=round(rates[1], 2),
        benchmark=benchmark,
    )
