"""Choosing the next token from a step's logits: greedy (temperature 0), or sampled from the
softmax at `temperature` over the smallest set of tokens whose probability reaches `top_p`, with a
generator seeded per sequence (the same seed gives the same tokens, alone or batched)."""

from __future__ import annotations

import torch

from ..errors import InvalidRequest

# Temperatures below this decode greedily.
MIN_TEMPERATURE = 1e-4


def check(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise InvalidRequest(f"temperature must be >= 0 (0: greedy), not {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], not {top_p}")


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from one sequence's logits `[vocab]`."""
    if temperature < MIN_TEMPERATURE:  # below it the softmax is one-hot anyway (or overflows)
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # probability of the tokens ranked above
        ordered[before >= top_p] = 0.0  # keeps the first token always
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))
