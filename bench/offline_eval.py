"""What offline eval costs against plain decoding of the same prompts (issue 33: "at most 2x").

    python bench/offline_eval.py [--run eagleops-demo-real/run.toml] [--prompts 8] [--new-tokens 64] [--rounds 3]
        [--uncached 2]

The run must have been through export (``eagleops demo --real`` leaves one: SmolLM2 and its
drafter, ShareGPT-length held-out prompts). Timed here with ``time.perf_counter`` around whole
calls, rounds interleaved, on the same prompts:

* **baseline**: transformers' own ``model.generate`` (greedy, its KV cache): plain decoding done by
  code that is not ours;
* **eval**: what ``eagleops eval`` (``backend = "hf"``) does per prompt: speculative decoding with
  the exported drafter (``speculative_generate``) and the plain decoding it is compared with
  (``greedy_generate``), both through our KV-cached ``CachedTarget``;
* **speculative**: the speculative part alone;
* **uncached** (``--uncached N`` prompts, 0 to skip): the eval as it was before the cache, every
  verify step a forward over the whole sequence (``git show bacdf7a:pipeline/training/eval/offline.py``),
  rebuilt here to measure what the cache saves.

Ratios are against the baseline's time for the same prompts and tokens (each side generates
``--new-tokens`` or stops at the reply's end: the token counts are printed beside).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _uncached(model, drafter, prompt, aux_layers, k, max_new, stops):
    """The pre-cache eval: every verify step runs the target over the whole sequence, and the
    drafter's step 0 over the whole context."""
    import torch
    from tests.test_decoding import _uncached_chain  # the chain drafted over the whole context, as eval drafted it then

    from eagleops.pipeline.training.modeling.layers import engine_layer_ids

    def target_pass(ids):
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i] for i in engine_layer_ids(aux_layers, "hf")], dim=-1).float(), out.logits[0].argmax(
            -1
        ).tolist()

    def propose(aux, tokens):
        return _uncached_chain(drafter, aux, tokens[0].tolist(), k)

    with torch.no_grad():
        aux, greedy = target_pass(prompt)
        seq, pending, generated = list(prompt), greedy[-1], []
        while len(generated) < max_new and pending not in stops:
            drafts = propose(aux[:, : len(seq)], torch.tensor([seq[1:] + [pending]]))
            aux, greedy = target_pass(seq + [pending] + drafts)
            base, accepted = len(seq), 0
            while accepted < k and drafts[accepted] == greedy[base + accepted]:
                accepted += 1
            new = [pending] + drafts[:accepted]
            seq, generated, pending = seq + new, generated + new, greedy[base + accepted]
            if any(t in stops for t in new):
                break
    return generated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=ROOT / "eagleops-demo-real" / "run.toml")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--uncached", type=int, default=2, help="prompts for the pre-cache eval (0: skip it)")
    args = parser.parse_args(argv)

    import torch

    from eagleops.pipeline.config import load_run
    from eagleops.pipeline.training.artifacts import FeaturesIndex
    from eagleops.pipeline.training.eval.decoding import CachedTarget, greedy_generate, speculative_generate
    from eagleops.pipeline.training.eval.stage import _held_out_prompts, _prompt_ids
    from eagleops.pipeline.training.modeling.drafter import load_exported
    from eagleops.pipeline.training.modeling.profile import head_and_embeddings, target_profile
    from eagleops.pipeline.training.modeling.target import load_target, load_target_tokenizer
    from eagleops.pipeline.training.modeling.turns import reply_stop_ids

    config = load_run(args.run)
    target = config.target
    tokenizer = load_target_tokenizer(target)
    model, device, dtype = load_target(target)
    aux_layers = FeaturesIndex.read(config.features_dir).capture.aux_layers
    drafter = load_exported(config.export_dir, head_and_embeddings(target_profile(config))[1]).to(device).eval()
    stops = reply_stop_ids(tokenizer, target.model)
    prompts = [_prompt_ids(tokenizer, row) for row in _held_out_prompts(config)][: args.prompts]
    cached = CachedTarget(model, aux_layers, device)
    k, n = args.draft_tokens, args.new_tokens
    print(f"load {os.getloadavg()[0]:.2f}; torch {torch.__version__} {torch.get_num_threads()} threads, {device} {dtype}; "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {n} new, {k} drafts", flush=True)  # fmt: skip

    def baseline() -> int:
        made = 0
        for p in prompts:
            with torch.no_grad():
                out = model.generate(torch.tensor([p], device=device), max_new_tokens=n, do_sample=False, eos_token_id=sorted(stops),
                                     pad_token_id=sorted(stops)[0], attention_mask=torch.ones((1, len(p)), dtype=torch.long, device=device))  # fmt: skip
            made += out.shape[1] - len(p)
        return made

    def speculative() -> int:
        return sum(len(speculative_generate(cached, drafter, p, k=k, max_new_tokens=n, stops=stops)[0]) for p in prompts)

    def plain() -> int:
        return sum(len(greedy_generate(cached, p, n, stops)) for p in prompts)

    times: dict[str, list[float]] = {"baseline": [], "speculative": [], "plain (ours)": []}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, run in (("baseline", baseline), ("speculative", speculative), ("plain (ours)", plain)):
            started = time.perf_counter()
            tokens[name] = run()
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["baseline"])
    eval_s = statistics.median(times["speculative"]) + statistics.median(times["plain (ours)"])
    print(f"\n{'':24s} {'seconds':>8s} {'tokens':>7s} {'vs baseline':>11s}")
    for name in times:
        t = statistics.median(times[name])
        print(f"{name:24s} {t:8.2f} {tokens[name]:7d} {t / base:10.2f}x")
    print(f"{'eval (both)':24s} {eval_s:8.2f} {'':7s} {eval_s / base:10.2f}x")
    if args.uncached:
        few = prompts[: args.uncached]
        started = time.perf_counter()
        made = sum(len(_uncached(model, drafter, p, aux_layers, k, n, stops)) for p in few)
        old = time.perf_counter() - started
        started = time.perf_counter()
        sum(len(speculative_generate(cached, drafter, p, k=k, max_new_tokens=n, stops=stops)[0]) for p in few)
        new = time.perf_counter() - started
        print(
            f"{'uncached speculative':24s} {old:8.2f} {made:7d}   {old / new:.1f}x the cached one on the same {len(few)} prompts ({new:.2f}s)"
        )
    print(f"median of {args.rounds} interleaved rounds; load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
