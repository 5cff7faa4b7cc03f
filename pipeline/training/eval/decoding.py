"""Decoding with a KV cache, through the language model eagleops finds in any target.

``CachedTarget`` runs the target's decoder stack (``decoder_stack``: a plain ``...ForCausalLM``'s
``model``, a multimodal wrapper's language model) and its output head step by step over a KV
cache, never through a wrapper's ``generate`` (a remote-code class that does not inherit
``GenerationMixin`` has none). Each call feeds only the new tokens, so decoding n tokens costs n
cached steps, not n passes over the whole sequence.

``speculative_generate`` is EAGLE's chain drafting against greedy verification: the drafter
proposes k tokens from its own cache (``DraftSession``), the target verifies them in one cached
forward, the longest agreeing prefix is kept plus the target's own next token, and both caches
are cut back to what was kept. ``greedy_generate`` is the plain decoding it is compared with.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from typing import Any

import torch

from eagleops.pipeline.errors import InputError
from eagleops.pipeline.training.modeling.layers import engine_layer_ids
from eagleops.pipeline.training.modeling.target import decoder_stack

__all__ = ["CachedTarget", "greedy_generate", "output_head", "speculative_generate"]


def output_head(model: Any) -> Any:
    """The module that turns the language model's last hidden state into logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        return head
    named = [module for name, module in model.named_modules() if name.endswith("lm_head")]
    if not named:
        raise InputError(f"{type(model).__name__}: no output head (get_output_embeddings() or an lm_head module)")
    return named[0]


class CachedTarget:
    """The target's language model over one sequence at a time, with its KV cache."""

    def __init__(self, model: Any, aux_layers: Sequence[int], device: Any):
        self.stack = decoder_stack(model)
        self.head = output_head(model)
        self.hidden_ids = engine_layer_ids(aux_layers, "hf")
        self.device = device
        # transformers 5.2x calls the cache ``cache``; earlier releases and remote code ``past_key_values``
        self.cache_argument = "cache" if "cache" in inspect.signature(self.stack.forward).parameters else "past_key_values"
        self.cache: Any = None
        self.length = 0

    def reset(self) -> None:
        self.cache, self.length = None, 0

    def _new_cache(self) -> Any:
        """A cache that can be cut back: sliding-window layers (gpt-oss) keep what they would
        drop past the window until a crop says what stays (transformers 5's past recording);
        None where this transformers builds its own (it then has no sliding layers to record)."""
        try:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.stack.config)
        except (ImportError, TypeError, ValueError):
            return None
        for layer in getattr(cache, "layers", ()):
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        return cache

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], aux: bool, last_only: bool = False) -> tuple[Any, list[int]]:
        if self.cache is None:
            self.cache = self._new_cache()
        n = len(ids)
        positions = torch.arange(self.length, self.length + n, device=self.device)[None, :]
        out = self.stack(
            input_ids=torch.tensor([list(ids)], device=self.device),
            position_ids=positions,
            use_cache=True,
            output_hidden_states=aux,
            **{self.cache_argument: self.cache},
        )
        self.cache = getattr(out, "cache", None) or out.past_key_values  # the same object, updated in place, after the first
        self.length += n
        last = out.last_hidden_state[:, -1:] if last_only else out.last_hidden_state  # a prompt's head: its last row alone
        return out, self.head(last)[0].argmax(-1).tolist()

    def feed(self, ids: Sequence[int], *, last_only: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Runs ``ids`` after what the cache holds: (their auxiliary hidden states [1, n, 3H] in
        fp32, the target's greedy next token after each of them, or after the last alone)."""
        out, greedy = self._forward(ids, aux=True, last_only=last_only)
        return torch.cat([out.hidden_states[i] for i in self.hidden_ids], dim=-1).float(), greedy

    def next_token(self, ids: Sequence[int]) -> int:
        """The target's greedy token after ``ids`` (fed after what the cache holds)."""
        return self._forward(ids, aux=False, last_only=True)[1][-1]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (drafts the target did not accept)."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove, in every release
            self.length = length


def _until_stop(tokens: list[int], stops: Collection[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i]
    return tokens


def greedy_generate(target: CachedTarget, prompt: Sequence[int], max_new_tokens: int, stops: Collection[int]) -> list[int]:
    """The target's own greedy reply to ``prompt``, its stop token left out."""
    target.reset()
    token, generated = target.next_token(prompt), list[int]()
    while len(generated) < max_new_tokens and token not in stops:
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        token = target.next_token([token])
    return generated


def speculative_generate(
    target: CachedTarget, drafter: Any, prompt: Sequence[int], *, k: int, max_new_tokens: int, stops: Collection[int]
) -> tuple[list[int], list[int]]:
    """(generated ids, drafts accepted at each verify step). ``stops``: every id that ends the
    target's reply (``reply_stop_ids``: its turn end, not only the tokenizer's eos)."""
    target.reset()
    aux, greedy = target.feed(prompt, last_only=True)
    pending = greedy[-1]  # the target's next token, not yet in its cache
    session = drafter.session()
    session.extend(aux, [*prompt[1:], pending])
    accepted_per_step: list[int] = []
    generated: list[int] = []
    while len(generated) < max_new_tokens and pending not in stops:
        drafts = session.propose(k)
        kept = target.length
        aux, greedy = target.feed([pending, *drafts])  # greedy[j]: the target's choice after draft j (0: after pending)
        accepted = 0
        while accepted < k and drafts[accepted] == greedy[accepted]:
            accepted += 1
        new = [pending, *drafts[:accepted]]
        accepted_per_step.append(accepted)
        generated += new
        pending = greedy[accepted]
        target.crop(kept + accepted + 1)
        if any(token in stops for token in new):
            generated = _until_stop(generated, stops)
            break
        session.extend(aux[:, : accepted + 1], [*drafts[:accepted], pending])
    return generated[:max_new_tokens], accepted_per_step
