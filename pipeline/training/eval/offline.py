"""eval's offline backend: the acceptance length of the exported drafter, by real speculative
decoding with the target in transformers.

On held-out prompts (``prepared/eval.jsonl``) and each benchmark: the drafter proposes ``draft_tokens`` tokens in a
chain (top-1), the target verifies them greedily in one forward pass, the longest agreeing prefix
is accepted plus the target's own next token (``acceptance`` turns the steps into figures).
Greedy verification makes the output identical to the target's own greedy decoding, which is
checked on every prompt.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from pipeline.config import RunConfig
from pipeline.training.artifacts import EvalResult, FeaturesIndex
from pipeline.training.context import StageContext
from pipeline.training.eval.acceptance import acceptance_from_steps
from pipeline.training.eval.benchmarks import Work
from pipeline.training.modeling.drafter import Eagle3Drafter, build_drafter, load_exported
from pipeline.training.modeling.layers import engine_layer_ids
from pipeline.training.modeling.target import head_and_embeddings, load_target, require_target

__all__ = ["evaluate_offline", "speculative_generate"]


@torch.no_grad()
def _target_pass(model, ids: list[int], aux_layers, device):
    out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in engine_layer_ids(aux_layers, "hf")], dim=-1)
    return aux.float(), out.logits[0].argmax(-1).tolist()


@torch.no_grad()
def speculative_generate(
    model, drafter: Eagle3Drafter, prompt: list[int], *, aux_layers, k: int, max_new_tokens: int, stops: Collection[int], device
):
    """Returns (generated ids, accepted drafts per verify step). ``stops``: every id that ends
    the target's reply (``reply_stop_ids``: its turn end, not only the tokenizer's eos)."""
    aux, greedy = _target_pass(model, prompt, aux_layers, device)
    seq, pending = list(prompt), greedy[-1]  # ``pending``: the target's next token, not yet appended
    accepted_per_step: list[int] = []
    generated: list[int] = []
    while len(generated) < max_new_tokens and pending not in stops:
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
        if any(token in stops for token in new):
            generated = _until_stop(generated, stops)
            break
    return generated[:max_new_tokens], accepted_per_step


@torch.no_grad()
def _greedy(model, prompt: list[int], max_new_tokens: int, stops: Collection[int], device) -> list[int]:
    eos = sorted(stops) or None
    out = model.generate(torch.tensor([prompt], device=device), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long, device=device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)  # fmt: skip
    return _until_stop(out[0, len(prompt) :].tolist(), stops)


def _until_stop(tokens: list[int], stops: Collection[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i]
    return tokens


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
    else:
        _, embeddings = head_and_embeddings(target.model)
        drafter = load_exported(config.export_dir, embeddings)
    drafter = drafter.to(device).eval()
    k = config.eval.draft_tokens
    results = []
    for name, questions, run in work:
        steps: list[int] = []
        mismatched: list[bool] = []

        def decode(prompt: list[int], steps: list[int] = steps, mismatched: list[bool] = mismatched) -> list[int]:
            ctx.checkpoint()
            generated, accepted = speculative_generate(
                model, drafter, prompt, aux_layers=aux_layers, k=k, max_new_tokens=config.eval.max_new_tokens, stops=stops, device=device
            )
            mismatched.append(generated != _greedy(model, prompt, len(generated), stops, device)[: len(generated)])
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
                benchmark=name,
            )
        )
    return results
