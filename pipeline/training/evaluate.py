"""eval: offline acceptance length of the exported drafter, by real speculative decoding.

On held-out prompts (``prepared/eval.jsonl``): the drafter proposes ``draft_tokens`` tokens in a
chain (top-1), the target verifies them greedily in one forward pass, the longest agreeing prefix
is accepted plus the target's own next token. Acceptance length = tokens gained per target
forward (accepted drafts + 1), averaged over verify steps; the per-position rate is
P(draft j accepted | drafts 1..j-1 accepted). Greedy verification makes the output identical
to the target's own greedy decoding, which is checked on every prompt.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.errors import InputError
from pipeline.training.artifacts import EvalResult, FeaturesIndex
from pipeline.training.context import StageContext
from pipeline.training.drafter import Eagle3Drafter, build_drafter, load_exported
from pipeline.training.target import head_and_embeddings, load_target, require_target
from pipeline.training.tracking import Trackers

__all__ = ["evaluate", "speculative_generate"]


@torch.no_grad()
def _target_pass(model, ids: list[int], aux_layers, device):
    out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[layer + 1] for layer in aux_layers], dim=-1)
    return aux.float(), out.logits[0].argmax(-1).tolist()


@torch.no_grad()
def speculative_generate(
    model, drafter: Eagle3Drafter, prompt: list[int], *, aux_layers, k: int, max_new_tokens: int, eos: int | None, device
):
    """Returns (generated ids, accepted drafts per verify step)."""
    aux, greedy = _target_pass(model, prompt, aux_layers, device)
    seq, pending = list(prompt), greedy[-1]  # ``pending``: the target's next token, not yet appended
    accepted_per_step: list[int] = []
    generated: list[int] = []
    while len(generated) < max_new_tokens and pending != eos:
        tokens = torch.tensor([seq[1:] + [pending]], device=device)
        drafts = drafter.propose(aux[:, : len(seq)], tokens, k)
        candidate = seq + [pending] + drafts
        aux, greedy = _target_pass(model, candidate, aux_layers, device)
        base = len(seq)  # greedy[base + j] is the target's choice after candidate[: base + j + 1]
        accepted = 0
        while accepted < k and drafts[accepted] == greedy[base + accepted]:
            accepted += 1
        new = [pending] + drafts[:accepted]
        accepted_per_step.append(accepted)
        seq += new
        generated += new
        pending = greedy[base + accepted]
        if eos is not None and eos in new:
            generated = generated[: generated.index(eos)]
            break
    return generated[:max_new_tokens], accepted_per_step


@torch.no_grad()
def _greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None, device) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=device), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long, device=device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokens


def _held_out_prompts(config: RunConfig) -> list[dict[str, Any]]:
    path = config.prepared_dir / "eval.jsonl"
    prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: config.eval.prompts]
    if not prompts:
        raise InputError(f"{path}: no held-out prompts (prepare.eval_fraction is 0?)")
    return prompts


def _result(drafter: str, prompts: int, steps: list[int], k: int, mismatches: int) -> EvalResult:
    reached = [sum(1 for a in steps if a >= j) for j in range(k + 1)]
    return EvalResult(
        drafter=drafter,
        prompts=prompts,
        verify_steps=len(steps),
        draft_tokens=k,
        acceptance_length=round(sum(a + 1 for a in steps) / len(steps), 4) if steps else 0.0,
        acceptance_rate_per_position=[round(reached[j + 1] / reached[j], 4) if reached[j] else 0.0 for j in range(k)],
        greedy_mismatches=mismatches,
    )


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _evaluate_offline(config: RunConfig, ctx: StageContext, prompts: list[list[int]], eos: int | None, *, untrained: bool) -> EvalResult:
    target = require_target(config)
    model, device, _ = load_target(target)
    aux_layers = tuple(FeaturesIndex.read(config.features_dir).aux_layers)
    if untrained:
        drafter = build_drafter(config, aux_layers, seed=config.train.seed + 1)
    else:
        _, embeddings = head_and_embeddings(target.model)
        drafter = load_exported(config.export_dir, embeddings)
    drafter = drafter.to(device).eval()
    k = config.eval.draft_tokens
    steps: list[int] = []
    mismatches = 0
    for i, prompt in enumerate(prompts):
        ctx.checkpoint()
        generated, accepted = speculative_generate(
            model, drafter, prompt, aux_layers=aux_layers, k=k, max_new_tokens=config.eval.max_new_tokens, eos=eos, device=device
        )
        if generated != _greedy(model, prompt, len(generated), eos, device)[: len(generated)]:
            mismatches += 1
        steps += accepted
        ctx.progress(i + 1, len(prompts), "prompts")
    return _result("untrained" if untrained else str(config.export_dir), len(prompts), steps, k, mismatches)


def _report_acceptance(config: RunConfig, result: EvalResult) -> None:
    """Beside the training curves: acceptance at the step the drafter was trained to."""
    history = config.train_dir / "history.jsonl"
    step = sum(1 for _ in open(history)) if history.exists() else 0
    trackers = Trackers(config.train_dir, wandb_project=config.train.wandb_project, run_name=config.name)
    try:
        trackers.log(step, {"eval/acceptance_length": result.acceptance_length})
    finally:
        trackers.close()


def evaluate(config: RunConfig, ctx: StageContext, *, untrained: bool = False, backend: str | None = None) -> EvalResult:
    """Acceptance length on the held-out prompts, by ``backend`` (default: the run file's)."""
    from transformers import AutoTokenizer

    target = require_target(config)
    tokenizer = AutoTokenizer.from_pretrained(str(target.tokenizer_path))
    prompts = [_prompt_ids(tokenizer, row["messages"]) for row in _held_out_prompts(config)]
    chosen = backend or config.eval.backend
    if chosen in ("vllm", "sglang") and not untrained:
        from pipeline.training.served_eval import evaluate_served, evaluate_sglang

        serve = evaluate_served if chosen == "vllm" else evaluate_sglang
        result = serve(config, ctx, prompts, config.export_dir)
    else:
        result = _evaluate_offline(config, ctx, prompts, tokenizer.eos_token_id, untrained=untrained)
    if not untrained:
        (config.output_dir / "eval.json").write_text(json.dumps(result.to_json(), indent=1))
        _report_acceptance(config, result)
    ctx.metrics(**result.to_json())
    per_position, k = result.acceptance_rate_per_position, result.draft_tokens
    ctx.log(
        "info",
        f"eval ({result.backend}): acceptance length {result.acceptance_length:.2f} over {result.verify_steps} verify steps ({k} draft tokens); per position {per_position}",
    )
    return result
