"""Continuous batching: sequences join and leave between steps.

    add(request) ─ a KV cache slot (InvalidRequest past the context, Overloaded with none free)
    step()       ─ prefill the sequences that joined (their prompts packed in one step) and pick
                   their first token; one decode step for every sequence already running; a
                   sequence leaves at its stop: an end-of-sequence token, max_new_tokens, a stop
                   string, its deadline, or cancel(); its slot is free for the next step
    run(requests) ─ add all, step until none runs (one-at-a-time and batched give the same tokens)

Tokens are ids; `decode` (ids -> text) is needed only for stop strings. A request with a grammar
(constraints.Grammars) gets a matcher: its mask of allowed tokens is filled on a thread while the
step runs and applied to its logits; the sequence stops when the grammar is complete.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequest
from . import sampling
from .constraints import Grammars, Masks
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
    grammar: str | None = None  # from constraints.Grammars: only what it allows is generated


@dataclass
class Sequence:
    request: GenerationRequest
    slot: int
    tokens: list[int] = field(default_factory=list)  # generated (an end-of-sequence token included)
    # "stop" (eos, a stop string, a complete grammar), "length", "deadline", "cancelled", "error"
    finish_reason: str | None = None
    text: str | None = None  # with stop strings: the text up to the first
    generator: torch.Generator | None = None
    prefilled: bool = False
    cancelled: bool = False
    matcher: Any = None  # the grammar's, when constrained

    @property
    def complete(self) -> bool:
        """Whether a constrained output is whole (the grammar accepts it); True unconstrained."""
        return self.matcher is None or bool(self.matcher.is_accepting())

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
        grammars: Grammars | None = None,
        max_prefill_tokens: int = 4096,
    ) -> None:
        self.decoder = decoder
        self.cache = decoder.cache
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        self.max_prefill_tokens = max_prefill_tokens
        self.grammars = grammars
        self.masks = Masks(decoder.vocab_size) if grammars is not None else None
        self._mask_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.running: list[Sequence] = []

    def add(self, request: GenerationRequest) -> Sequence:
        if not request.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if request.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, not {request.max_new_tokens}")
        sampling.check(request.temperature, request.top_p)
        if request.stop and self.decode is None:
            raise InvalidRequest("stop strings need the model's tokenizer")
        if request.grammar is not None and self.grammars is None:
            raise InvalidRequest("constrained output needs the model's tokenizer")
        matcher = self.grammars.matcher(request.grammar) if self.grammars and request.grammar is not None else None
        slot = self.cache.alloc(len(request.prompt_ids) + request.max_new_tokens)
        generator = None
        if request.temperature > 0:
            generator = torch.Generator(device=self.cache.k.device)
            if request.seed is not None:
                generator.manual_seed(request.seed)
            else:
                generator.seed()  # a fresh seed of its own (not the process's generator)
        seq = Sequence(request, slot, generator=generator, matcher=matcher)
        self.running.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The sequence stops before the next step (its slot is freed then)."""
        seq.cancelled = True

    def step(self) -> list[Sequence]:
        """One round (see the module docstring); returns the sequences that finished in it."""
        now = time.monotonic()
        for seq in self.running:
            if seq.cancelled or now > seq.request.deadline:
                seq.finish_reason = "cancelled" if seq.cancelled else "deadline"
        finished = self._leave_done()
        joining: list[Sequence] = []
        budget = self.max_prefill_tokens
        for seq in self.running:
            if not seq.prefilled and (not joining or len(seq.request.prompt_ids) <= budget):
                joining.append(seq)
                budget -= len(seq.request.prompt_ids)
        decoding = [seq for seq in self.running if seq.prefilled]
        try:
            self._advance_all(joining, decoding)
        except BaseException:
            # A failed step (the device, a mask) leaves its sequences' caches half written: they
            # end with "error" and free their slots, rather than run on from a state no token was
            # chosen for; the error goes to the caller.
            for seq in joining + decoding:
                if not seq.done:
                    seq.finish_reason = "error"
            self._leave_done()
            raise
        return finished + self._leave_done()

    def _leave_done(self) -> list[Sequence]:
        done = [seq for seq in self.running if seq.done]
        for seq in done:
            self._leave(seq)
        return done

    def _advance_all(self, joining: list[Sequence], decoding: list[Sequence]) -> None:
        if joining:
            logits = self._step(joining, [Segment(s.slot, list(s.request.prompt_ids)) for s in joining])
            for seq, row in zip(joining, logits):
                seq.prefilled = True
                self._advance(seq, row)
        if decoding:
            logits = self._step(decoding, [Segment(s.slot, [s.tokens[-1]]) for s in decoding])
            for seq, row in zip(decoding, logits):
                self._advance(seq, row)

    def run(self, requests: Iterable[GenerationRequest]) -> list[Sequence]:
        sequences = [self.add(r) for r in requests]
        while self.running:
            self.step()
        return sequences

    def _step(self, sequences: list[Sequence], segments: list[Segment]) -> torch.Tensor:
        """The decoder's step, with the constrained sequences' masks filled meanwhile (on a thread:
        a mask depends only on the tokens so far) and applied to their logits."""
        constrained = [i for i, seq in enumerate(sequences) if seq.matcher is not None]
        if not constrained:
            return self.decoder.step(segments)
        assert self.masks is not None  # a matcher comes from grammars, which made masks
        if self._mask_thread is None:
            self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shoal-masks")
        masks = self.masks
        filling = self._mask_thread.submit(masks.fill, [sequences[i].matcher for i in constrained])
        logits = self.decoder.step(segments).clone()  # out of inference mode: masked in place
        rows = torch.tensor(constrained)
        chosen = logits[rows]
        masks.apply(chosen, filling.result())
        logits[rows] = chosen
        return logits

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.slot)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        request = seq.request
        token = sampling.next_token(logits, request.temperature, request.top_p, seq.generator)
        seq.tokens.append(token)
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed it: a bug, not the caller's
                raise RuntimeError(f"the grammar refused token {token}: {seq.matcher.get_error()}")
            if seq.matcher.is_stopped():  # nothing more may come (or an end-of-sequence token came)
                seq.finish_reason = "stop"
                return
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
