"""OpenAI's chat completions (`POST /v1/chat/completions`): the request, the answer, and the SSE
chunks of a streamed answer, as the `openai` client reads them.

Generation options map to `calls.GenerateCall`: `max_completion_tokens` (or the older `max_tokens`)
to max_new_tokens, `response_format` {"type": "json_schema", "json_schema": {"schema": ...}} to a
JSON Schema constraint, {"type": "json_object"} to any JSON object. What shoal does not do (tools,
log-probabilities, several choices, penalties) is refused with a 400 naming the field, never
ignored. OpenAI's default temperature is 1 (sampling); send 0 for greedy.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec

from ..calls import GenerateCall, GenerateResult, Message
from ..errors import InvalidRequest

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: NonEmpty
    content: str | list[TextPart] | None = None
    name: str | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # the older name
    temperature: float | None = None  # None: OpenAI's 1
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    n: int | None = None
    user: str | None = None
    # Refused unless left at their defaults (shoal does not do them): a 400 names the field.
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    timeout_s: float | None = None  # shoal's: the call's deadline


class ChoiceMessage(msgspec.Struct):
    role: str
    content: str


class Choice(msgspec.Struct):
    index: int
    message: ChoiceMessage
    finish_reason: str
    logprobs: None = None


class ChatUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]  # no default: omit_defaults would leave it out
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None


def chat_call(req: ChatRequest, request_id: str | None = None) -> GenerateCall:
    """The GenerateCall of a chat request (InvalidRequest naming what shoal does not do)."""
    for name, value, default in (
        ("tools", req.tools, None),
        ("tool_choice", req.tool_choice, None),
        ("logprobs", req.logprobs, None),
        ("top_logprobs", req.top_logprobs, None),
        ("logit_bias", req.logit_bias, None),
    ):
        if value not in (default, False, [], {}, "none"):
            raise InvalidRequest(f"{name} is not served by shoal's chat completions", details={"option": name})
    for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)):
        if value not in (None, 0, 0.0):
            raise InvalidRequest(f"{name} is not served (only 0)", details={"option": name})
    if req.n not in (None, 1):
        raise InvalidRequest("n: one choice per request (send n 1, or several requests)", details={"option": "n"})
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        elif m.content is None:
            raise InvalidRequest(f"messages[{i}].content is empty", details={"option": "messages"})
        else:
            content = m.content
        messages.append(Message(m.role, content))
    schema, json_object = None, False
    if req.response_format is not None and req.response_format.type == "json_schema":
        given = req.response_format.json_schema
        if given is None or not isinstance(given.schema, dict):
            raise InvalidRequest(
                "response_format json_schema needs json_schema.schema (the JSON Schema of the answer)",
                details={"option": "response_format"},
            )
        schema = given.schema
    elif req.response_format is not None and req.response_format.type == "json_object":
        json_object = True
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return GenerateCall(
        model=req.model,
        messages=messages,
        max_new_tokens=max_new,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        json_schema=schema,
        json_object=json_object,
        request_id=request_id,
        timeout_s=req.timeout_s,
    )


def chat_chunk(
    ident: str, created: int, model: str, choices: list[ChunkChoice], usage: ChatUsage | None = None
) -> ChatChunk:
    return ChatChunk(ident, "chat.completion.chunk", created, model, choices, usage)


def completion_id(request_id: str | None) -> str:
    return f"chatcmpl-{request_id or uuid.uuid4().hex}"


def chat_response(req: ChatRequest, result: GenerateResult, request_id: str | None) -> ChatResponse:
    return ChatResponse(
        id=completion_id(request_id),
        created=int(time.time()),
        model=req.model,
        choices=[Choice(0, ChoiceMessage("assistant", result.text), result.finish_reason)],
        usage=usage_of(result),
    )


def usage_of(result: GenerateResult) -> ChatUsage:
    return ChatUsage(result.prompt_tokens, result.completion_tokens, result.prompt_tokens + result.completion_tokens)
