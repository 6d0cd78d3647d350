"""Continuous batching: sequences join and leave between steps.

    add(request) ─ a KV cache slot (InvalidRequest past the context, Overloaded with none free)
    step()       ─ prefill the sequences that joined (their prompts packed in one step) and pick
                   their first token; one decode step for every sequence already running; a
                   sequence leaves at its stop: an end-of-sequence token, max_new_tokens, a stop
                   string, its deadline, or cancel(); its slot is free for the next step
    run(requests) ─ add all, step until none runs (one-at-a-time and batched give the same tokens)

Tokens are ids; `decode` (ids -> text) is needed only for stop strings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequest
from . import sampling
from .forward import CachedDecoder, Segment


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    deadline: float = math.inf  # time.monotonic()


@dataclass
class Sequence:
    request: GenerationRequest
    slot: int
    tokens: list[int] = field(default_factory=list)  # generated (an end-of-sequence token included)
    finish_reason: str | None = None  # "stop" (eos or a stop string), "length", "deadline", "cancelled"
    text: str | None = None  # with stop strings: the text up to the first
    generator: torch.Generator | None = None
    prefilled: bool = False
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Generator:
    """Runs sequences on a `CachedDecoder` (see the module docstring)."""

    def __init__(
        self,
        decoder: CachedDecoder,
        eos_ids: Iterable[int],
        *,
        decode: Callable[[list[int]], str] | None = None,
        max_prefill_tokens: int = 4096,
    ) -> None:
        self.decoder = decoder
        self.cache = decoder.cache
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        self.max_prefill_tokens = max_prefill_tokens
        self.running: list[Sequence] = []

    def add(self, request: GenerationRequest) -> Sequence:
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if request.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, not {request.max_new_tokens}")
        sampling.check(request.temperature, request.top_p)
        if request.stop and self.decode is None:
            raise InvalidRequest("stop strings need the model's tokenizer")
        slot = self.cache.alloc(len(request.prompt_ids) + request.max_new_tokens)
        generator = None
        if request.temperature > 0:
            generator = torch.Generator(device=self.cache.k.device)
            generator.manual_seed(request.seed if request.seed is not None else torch.seed())
        seq = Sequence(request, slot, generator=generator)
        self.running.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The sequence stops before the next step (its slot is freed then)."""
        seq.cancelled = True

    def step(self) -> list[Sequence]:
        """One round (see the module docstring); returns the sequences that finished in it."""
        finished = self._retire_early()
        joining: list[Sequence] = []
        budget = self.max_prefill_tokens
        for seq in self.running:
            if not seq.prefilled and (not joining or len(seq.request.prompt_ids) <= budget):
                joining.append(seq)
                budget -= len(seq.request.prompt_ids)
        decoding = [seq for seq in self.running if seq.prefilled]
        if joining:
            logits = self.decoder.step([Segment(s.slot, list(s.request.prompt_ids)) for s in joining])
            for seq, row in zip(joining, logits):
                seq.prefilled = True
                self._advance(seq, row)
        if decoding:
            logits = self.decoder.step([Segment(s.slot, [s.tokens[-1]]) for s in decoding])
            for seq, row in zip(decoding, logits):
                self._advance(seq, row)
        for seq in list(self.running):
            if seq.done:
                self._leave(seq)
                finished.append(seq)
        return finished

    def run(self, requests: Iterable[GenerationRequest]) -> list[Sequence]:
        sequences = [self.add(r) for r in requests]
        while self.running:
            self.step()
        return sequences

    def _retire_early(self) -> list[Sequence]:
        now = time.monotonic()
        gone = []
        for seq in list(self.running):
            if seq.cancelled or now > seq.request.deadline:
                seq.finish_reason = "cancelled" if seq.cancelled else "deadline"
                self._leave(seq)
                gone.append(seq)
        return gone

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.slot)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        request = seq.request
        token = sampling.next_token(logits, request.temperature, request.top_p, seq.generator)
        seq.tokens.append(token)
        if token in self.eos_ids:
            seq.finish_reason = "stop"
        elif request.stop:
            assert self.decode is not None  # checked in add
            text = self.decode(seq.tokens)
            cut = min((i for i in (text.find(s) for s in request.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text, seq.finish_reason = text[:cut], "stop"
        if seq.finish_reason is None and len(seq.tokens) >= request.max_new_tokens:
            seq.finish_reason = "length"
