"""generate, and extract kind generate: prompts for a decoder, and what its generations become.

    GenerateTask         a chat (`messages`, framed by the model's chat template, the assistant's
                         turn next) or a raw `prompt` -> one sequence; its text, finish reason and
                         token counts back
    ExtractGenerateTask  each text framed as a chat (the card's extract_system and extract_prompt
                         around the text) -> one sequence per text, constrained to JSON the call's
                         schema allows; the parsed record back

Tasks plan and collect; the sequences run on the model's generation loop (engine/generation.py),
one `GenerateSpec` each, not in device batches (`generates`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...calls import ExtractCall, ExtractedItem, ExtractResult, GenerateCall, Generated, GenerateResult
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import ChatFrame
from ...verbs import estimate_tokens
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, GenerateSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract

MAX_STOP_STRINGS = 8
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class GeneratePlan:
    card: ModelCard
    call: GenerateCall
    spec: GenerateSpec
    estimated_tokens: int
    num_items: int = 1
    model: ModelInfo | None = None
    prompt_tokens: list[int] = field(default_factory=list)


class GenerateTask:
    verb = "generate"
    generates = True

    def plan(self, card: ModelCard, call: GenerateCall) -> GeneratePlan:
        if (call.messages is None) == (call.prompt is None):
            raise InvalidRequest("send exactly one of `messages` (a chat) and `prompt` (raw text)")
        if call.messages is not None:
            if not call.messages:
                raise InvalidRequest("messages is empty: send at least one message", details={"option": "messages"})
            for i, message in enumerate(call.messages):
                if message.role not in ROLES:
                    raise InvalidRequest(
                        f"messages[{i}].role must be one of {', '.join(ROLES)}, not {message.role!r}",
                        details={"option": "messages"},
                    )
        elif not call.prompt:
            raise InvalidRequest("prompt is empty", details={"option": "prompt"})
        shapes = [
            name
            for name, given in (
                ("json_schema", call.json_schema is not None),
                ("json_object", call.json_object),
                ("regex", call.regex is not None),
                ("choice", call.choice is not None),
            )
            if given
        ]
        if len(shapes) > 1:
            raise InvalidRequest(f"the output takes one shape; this call asks for {' and '.join(shapes)}")
        constraint: tuple[str, Any] | None = None
        if shapes:
            value = {"json_schema": call.json_schema, "json_object": None, "regex": call.regex, "choice": call.choice}
            constraint = (shapes[0], value[shapes[0]])
        spec = generate_spec(card, call.max_new_tokens, call.temperature, call.top_p, call.seed, call.stop, constraint)
        return GeneratePlan(card, call, spec, estimate_tokens(call, card))

    async def tokenize(self, plan: GeneratePlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        plan.model = model
        call = plan.call
        frame = model.head(ChatFrame)
        if call.messages is not None:
            # OpenAI's "developer" is its newer name for "system" (templates know only the latter).
            messages = [{"role": _ROLE.get(m.role, m.role), "content": m.content} for m in call.messages]
            text = await pool.map(lambda chunk, _: [frame.render(chunk[0])], [messages])
            prompt = text[0]
        else:
            assert call.prompt is not None
            prompt = call.prompt
        ids = (await pool.map(lambda chunk, _: [model.text.plain_ids(t) for t in chunk], [prompt]))[0]
        return [Encoded(np.asarray(ids, dtype=np.int64))]

    def specs(self, plan: GeneratePlan, seqs: list[Encoded]) -> list[GenerateSpec]:
        return [fitted(plan.spec, plan.card, seq, plan.call.max_new_tokens) for seq in seqs]

    def check_size(self, plan: GeneratePlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None

    def collect_off_loop(self, plan: GeneratePlan, outputs: list) -> bool:
        return False

    def collect(self, plan: GeneratePlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> GenerateResult:
        (out,) = outputs
        assert isinstance(out, Generated)
        return GenerateResult(
            text=out.text,
            finish_reason=out.finish_reason or "stop",
            prompt_tokens=len(seqs[0]),
            completion_tokens=len(out.token_ids),
            request_id=plan.call.request_id,
            **timings,
        )


class ExtractGenerateTask:
    verb = "extract"
    generates = True
    options = frozenset({"schema", "max_new_tokens"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        plan = plan_extract(card, call, "generate", self.options, labels_required=False)
        if plan.labels:
            raise InvalidRequest(
                "a generating model reads no labels: describe the fields in `schema` (a JSON Schema)",
                details={"option": "labels"},
            )
        if not isinstance(call.schema, dict) or not call.schema:
            raise InvalidRequest(
                'schema is required: the JSON Schema of each text\'s record, e.g. {"type": "object", '
                '"properties": {"name": {"type": "string"}}, "required": ["name"]}',
                details={"option": "schema"},
            )
        spec = generate_spec(card, call.max_new_tokens, 0.0, 1.0, None, [], ("json_schema", call.schema))
        plan.specs = [spec]  # type: ignore[list-item]  # one GenerateSpec, every text's
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        plan.model = model
        frame = model.head(ChatFrame)
        generate = plan.card.generate
        assert generate is not None

        def frame_texts(chunk: list[str], _: int) -> list[list[int]]:
            return [
                model.text.plain_ids(
                    frame.render(
                        [
                            {"role": "system", "content": generate.extract_system},
                            {"role": "user", "content": generate.extract_prompt.replace("{text}", t)},
                        ]
                    )
                )
                for t in chunk
            ]

        ids = await pool.map(frame_texts, plan.texts)
        plan.owners = list(range(len(plan.texts)))
        return [Encoded(np.asarray(i, dtype=np.int64)) for i in ids]

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[GenerateSpec]:
        spec: GenerateSpec = plan.specs[0]  # type: ignore[assignment]
        return [fitted(spec, plan.card, seq, plan.call.max_new_tokens) for seq in seqs]

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return False

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        items = []
        for out in outputs:
            assert isinstance(out, Generated)
            data = None
            if out.finish_reason == "stop":  # complete: the grammar accepted it, so it parses
                data = json.loads(out.text)
            items.append(ExtractedItem(data=data, finish_reason=out.finish_reason))
        return ExtractResult(
            items=items,
            num_tokens=sum(len(s) for s in seqs),
            generated_tokens=sum(len(out.token_ids) for out in outputs),
            request_id=plan.call.request_id,
            **timings,
        )


_ROLE = {"developer": "system"}


def fitted(spec: GenerateSpec, card: ModelCard, seq: Encoded, asked: object) -> GenerateSpec:
    """The spec, its default max_new_tokens (the call named none) cut to what the context leaves
    after the prompt, as OpenAI's API does; a number the call named is kept (too many: a 400)."""
    if asked is not None:
        return spec
    room = max(1, card.max_length - len(seq))
    return spec if spec.max_new_tokens <= room else dataclasses.replace(spec, max_new_tokens=room)


def generate_spec(
    card: ModelCard,
    max_new_tokens: Any,
    temperature: Any,
    top_p: Any,
    seed: Any,
    stop: Any,
    constraint: tuple[str, Any] | None,
) -> GenerateSpec:
    """The call's options checked (a 400 naming the bad one) against the card."""
    assert card.generate is not None
    if max_new_tokens is None:
        max_new_tokens = card.generate.max_new_tokens
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InvalidRequest(
            f"max_new_tokens must be an integer >= 1, not {max_new_tokens!r}", details={"option": "max_new_tokens"}
        )
    if max_new_tokens >= card.max_length:
        raise InvalidRequest(
            f"max_new_tokens {max_new_tokens} leaves no room for the prompt in this model's context "
            f"of {card.max_length} positions",
            details={"option": "max_new_tokens", "context": card.max_length},
        )
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise InvalidRequest(
            f"temperature must be between 0 and 2, not {temperature!r}", details={"option": "temperature"}
        )
    if not isinstance(top_p, (int, float)) or not 0 <= top_p <= 1:
        raise InvalidRequest(f"top_p must be between 0 and 1, not {top_p!r}", details={"option": "top_p"})
    if top_p == 0:  # only the likeliest token: greedy (OpenAI's API takes 0)
        temperature, top_p = 0.0, 1.0
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequest(f"seed must be an integer, not {seed!r}", details={"option": "seed"})
    if seed is not None:
        seed %= 2**63  # any int64, as OpenAI's API takes it
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(
            f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings", details={"option": "stop"}
        )
    if constraint is not None:
        kind, value = constraint
        if kind == "json_schema" and not isinstance(value, dict):
            raise InvalidRequest("a JSON Schema is an object", details={"option": "json_schema"})
        if kind == "regex" and (not isinstance(value, str) or not value):
            raise InvalidRequest("regex must be a non-empty string", details={"option": "regex"})
        if kind == "choice" and (
            not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequest("choice must be a non-empty list of non-empty strings", details={"option": "choice"})
    return GenerateSpec(int(max_new_tokens), float(temperature), float(top_p), seed, tuple(stop), constraint)
