"""Constrained decoding with llguidance: a JSON Schema, a regex or a list of choices becomes a
grammar, compiled and checked once per distinct constraint (an LRU of `CACHE_SIZE`), and each
constrained sequence gets a matcher that says, before every step, which tokens may come next.

    Grammars(tokenizer json, vocab size, eos ids)
      .json_schema(schema) / .regex(pattern) / .choice(options)  ─ a grammar (InvalidRequest if bad)
      .matcher(grammar)                                            ─ a fresh matcher per sequence
    Masks(width).fill(matchers)  ─ the allowed tokens of each constrained sequence, as a bitmask
                                   row per sequence (computed while the step runs: see batcher)

A matcher allows an end-of-sequence token only where the grammar may end, and stops when nothing
more may come (a JSON object closed): either ends the sequence with a complete, valid output.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import InvalidRequest

CACHE_SIZE = 256


class Grammars:
    """Grammars for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        import llguidance

        self._ll = llguidance
        eos = list(eos_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()

    def json_schema(self, schema: Any) -> str:
        """A grammar for JSON that validates against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"a JSON Schema is an object, not {type(schema).__name__}")
        key = "json:" + json.dumps(schema, sort_keys=True)
        return self._compiled(
            key,
            lambda: self._ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}),
            "JSON Schema",
        )

    def regex(self, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InvalidRequest(f"the regex does not compile: {exc}") from None
        return self._compiled("regex:" + pattern, lambda: self._ll.LLMatcher.grammar_from_regex(pattern), "regex")

    def choice(self, options: Sequence[str]) -> str:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequest("choices must be a non-empty list of non-empty strings")
        pattern = "|".join(re.escape(o) for o in options)
        return self._compiled(
            "choice:" + json.dumps(list(options)), lambda: self._ll.LLMatcher.grammar_from_regex(pattern), "choice"
        )

    def _compiled(self, key: str, build: Any, what: str) -> str:
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        try:
            grammar = build()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidRequest(f"the {what} cannot be used: {exc}") from None
        # The whole check: an unknown type, a bad reference or an unsatisfiable schema fails here.
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequest(f"the {what} cannot be used: {error}")
        self._cache[key] = grammar
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> Any:
        matcher = self._ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequest(f"the constraint cannot be used: {matcher.get_error()}")
        return matcher


class Masks:
    """Bitmask rows of allowed tokens, `fill`ed for a step's constrained sequences, applied to
    their logits."""

    def __init__(self, vocab_size: int) -> None:
        import llguidance.torch as lt

        self._lt = lt
        self.vocab_size = vocab_size
        self._bits = lt.allocate_token_bitmask(1, vocab_size)

    def fill(self, matchers: Sequence[Any]) -> torch.Tensor:
        """One row per matcher (int32 words, a bit per token)."""
        if self._bits.shape[0] < len(matchers):
            self._bits = self._lt.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, matcher in enumerate(matchers):
            self._lt.fill_next_token_bitmask(matcher, self._bits, row)
        return self._bits[: len(matchers)]

    def apply(self, logits: torch.Tensor, bits: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place (`logits` `[n, vocab]`, float32)."""
        self._lt.apply_token_bitmask_inplace(logits, bits.to(logits.device, non_blocking=True))
