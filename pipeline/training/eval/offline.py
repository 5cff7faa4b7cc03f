"""eval's offline backend: the acceptance length of the exported drafter, by real speculative
decoding with the target in transformers (``decoding``: both KV-cached, so its cost grows with
the tokens decoded).

On held-out prompts (``prepared/eval.jsonl``) and each benchmark: the drafter proposes
``draft_tokens`` tokens in a chain (top-1), the target verifies them greedily in one forward
pass, the longest agreeing prefix is accepted plus the target's own next token (``acceptance``
turns the steps into figures). Every prompt is also decoded plainly (greedy, one token a step):
the two outputs are compared and both timed, which gives the offline speedup.

Greedy verification promises the target's greedy output only up to arithmetic: verifying k+1
tokens in one forward sums in another order than decoding them one by one, so where the top two
logits are within rounding of each other the two paths can pick different tokens and diverge
from there. In fp32 that is rare; in bf16 it is common on long replies. eval counts the outputs
that differ and says so.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from eagleops.pipeline.config import BLOCK_DRAFTERS, RunConfig
from eagleops.pipeline.training.artifacts import EvalResult, FeaturesIndex
from eagleops.pipeline.training.context import StageContext
from eagleops.pipeline.training.eval.acceptance import acceptance_from_steps
from eagleops.pipeline.training.eval.benchmarks import Work
from eagleops.pipeline.training.eval.decoding import CachedTarget, greedy_generate, speculative_generate
from eagleops.pipeline.training.modeling.drafter import build_drafter, load_exported
from eagleops.pipeline.training.modeling.drafter_config import drafting
from eagleops.pipeline.training.modeling.profile import head_and_embeddings, target_profile
from eagleops.pipeline.training.modeling.target import load_target, require_target

__all__ = ["evaluate_offline"]


def evaluate_offline(
    config: RunConfig, ctx: StageContext, work: list[Work], stops: Collection[int], *, untrained: bool
) -> list[EvalResult]:
    """One result per set of ``work`` (the held-out prompts, then each benchmark), every prompt
    decoded speculatively and checked against the target's own greedy decoding."""
    target = require_target(config)
    model, device, _ = load_target(target)
    aux_layers = FeaturesIndex.read(config.features_dir).capture.aux_layers  # the export's too: ``evaluate`` checked
    if untrained:
        drafter = build_drafter(config, aux_layers, seed=config.train.seed + 1)
        k = config.train.block_size - 1 if config.train.drafter in BLOCK_DRAFTERS else config.eval.draft_tokens
    else:
        _, k = drafting(config.layout.exported_config, config.eval.draft_tokens)
        head, embeddings = head_and_embeddings(target_profile(config))
        drafter = load_exported(config.export_dir, embeddings, head)
    drafter = drafter.to(device).eval()
    cached = CachedTarget(model, aux_layers, device)
    results = []
    for name, questions, run in work:
        steps: list[int] = []
        mismatched: list[bool] = []
        timing = {"speculative_s": 0.0, "plain_s": 0.0, "tokens": 0, "plain_tokens": 0}

        def decode(prompt: list[int], steps: list[int] = steps, mismatched: list[bool] = mismatched, timing: dict = timing) -> list[int]:
            ctx.checkpoint()
            started = time.perf_counter()
            generated, accepted = speculative_generate(cached, drafter, prompt, k=k, max_new_tokens=config.eval.max_new_tokens, stops=stops)
            between = time.perf_counter()
            plain = greedy_generate(cached, prompt, config.eval.max_new_tokens, stops)
            timing["speculative_s"] += between - started
            timing["plain_s"] += time.perf_counter() - between
            timing["tokens"] += len(generated)
            timing["plain_tokens"] += len(plain)
            mismatched.append(generated != plain)
            steps.extend(accepted)
            return generated

        run(decode)
        acceptance = acceptance_from_steps(steps, k)
        results.append(
            EvalResult(
                drafter="untrained" if untrained else str(config.export_dir),
                prompts=questions,
                verify_steps=acceptance.verify_steps,
                draft_tokens=k,
                acceptance_length=acceptance.length,
                acceptance_rate_per_position=acceptance.rate_per_position,
                greedy_mismatches=sum(mismatched),
                outputs=len(mismatched),
                tok_per_s=_rate(timing["tokens"], timing["speculative_s"]),
                tok_per_s_without_drafter=_rate(timing["plain_tokens"], timing["plain_s"]),
                benchmark=name,
            )
        )
    return results


def _rate(tokens: float, seconds: float) -> float | None:
    return round(tokens / seconds, 2) if seconds > 0 and tokens else None
