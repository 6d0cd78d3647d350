"""Verbs and extract kinds, one registry entry each: the call and result types, the engine task that
serves it, and its cost in tokens. Torch-free: the gateway and the worker read it too.

    encode               EncodeCall  -> EncodeResult   engine/tasks/encode.py
    score                ScoreCall   -> ScoreResult    engine/tasks/score.py
    extract:gliner       ExtractCall -> ExtractResult  engine/tasks/extract_gliner.py
    extract:token_class  ExtractCall -> ExtractResult  engine/tasks/extract_token_class.py
    extract:zero_shot    ExtractCall -> ExtractResult  engine/tasks/extract_zero_shot.py
    extract:gliclass     ExtractCall -> ExtractResult  engine/tasks/extract_gliclass.py
    extract:gliner2      ExtractCall -> ExtractResult  engine/tasks/extract_gliner2.py
    extract:glirel       ExtractCall -> ExtractResult  engine/tasks/extract_glirel.py
    extract:classify     ExtractCall -> ExtractResult  engine/tasks/extract_classify.py
    extract:image_labels ExtractCall -> ExtractResult  engine/tasks/extract_image_labels.py
    extract:generate     ExtractCall -> ExtractResult  engine/tasks/generate.py
    generate             GenerateCall -> GenerateResult engine/tasks/generate.py

`estimate_tokens(call, card)` is the one cost function: engine admission, the gateway's token
header (what workers size their pulls by) and the worker all count a call with it. It runs before
any tokenizer, from characters (~4 a token) and the card's `image_tokens` an image, and counts what
the task will really run: prompts, label prompts repeated per window, one pair per label, the frame
around every LLM-reranked pair.

The routes that make each verb's call, and the wire translation each reads, are rows of the route
table (api/table.py, `RouteSpec.verb`), which the app and the OpenAPI document are built from.

A new verb or kind is a registry line here, its task file, and its estimate below (a new verb also
its call and result types in calls.py, and its routes' rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .calls import (
    AnyCall,
    EncodeCall,
    EncodeResult,
    ExtractCall,
    ExtractResult,
    GenerateCall,
    GenerateResult,
    Input,
    Result,
    ScoreCall,
    ScoreResult,
    text_of,
)
from .catalog import ModelCard
from .errors import InvalidRequest

AnyCallType = type[EncodeCall] | type[ScoreCall] | type[ExtractCall] | type[GenerateCall]


@dataclass(frozen=True)
class Kind:
    """One verb (or extract kind) as the system serves it."""

    name: str
    call: AnyCallType
    result: type[Result]
    task: str  # "module:Class" under shoal.engine.tasks (imported by the engine only)
    estimate: Callable[[AnyCall, ModelCard], int]


# What an image costs on a card that does not say (`image_tokens`): a ViT-B/16's 196 patches + 1.
IMAGE_TOKENS = 197


def raw_tokens(value: Input, card: ModelCard | None = None, prefix: int = 0) -> int:
    """Tokens an input will cost, before preprocessing and uncut: a text ~4 characters a token
    (`prefix` more characters of prompt), plus specials; an image its card's `image_tokens`."""
    text = text_of(value)
    if text is None:
        return (card.image_tokens if card is not None else None) or IMAGE_TOKENS
    return (prefix + len(text)) // 4 + 2


def text_tokens(value: Input, max_length: int, card: ModelCard | None = None, prefix: int = 0) -> int:
    """`raw_tokens`, a text's cut to what one sequence of `max_length` keeps (an image is never cut:
    it is resized to the tower's resolution)."""
    tokens = raw_tokens(value, card, prefix)
    return tokens if text_of(value) is None else min(max_length, tokens)


# A GLiNER window keeps at least this many tokens for text next to the label prompt.
MIN_TEXT_TOKENS = 16
# Windows per document at most when a cross-encoder scores windows (window_overlap_tokens).
MAX_WINDOWS = 32


def _encode(call: AnyCall, card: ModelCard) -> int:
    assert isinstance(call, EncodeCall)
    prefix = (
        card.prompts.get(call.prompt_name, "") if call.prompt_name is not None else card.prompt_for(None, call.is_query)
    )
    return sum(text_tokens(item, card.max_length, card, len(prefix)) for item in call.items)


def _score(call: AnyCall, card: ModelCard) -> int:
    assert isinstance(call, ScoreCall)
    longest = card.max_length
    mode = card.score.kind if card.score is not None else card.outputs[0]
    query_tokens = text_tokens(call.query, longest // 2, card)
    overlap = call.window_overlap_tokens
    if isinstance(overlap, int) and overlap >= 0:  # every window repeats the query and the overlap
        room = max(2, longest - query_tokens - 3)
        step = max(1, room - overlap)
        whole = [min(raw_tokens(d, card), room + (MAX_WINDOWS - 1) * step) for d in call.documents]
        return sum(d + -(-d // step) * (query_tokens + 3 + overlap) for d in whole)
    per_doc = (
        call.max_tokens_per_doc if isinstance(call.max_tokens_per_doc, int) and call.max_tokens_per_doc > 0 else longest
    )
    doc_tokens = [text_tokens(d, per_doc, card) for d in call.documents]
    if mode == "llm" and card.score is not None:  # the prefix, template and suffix frame every document
        s = card.score
        query_tokens += text_tokens(s.prefix + s.template + s.suffix + (call.instruction or s.instruction), longest)
    if mode in ("cross_encoder", "llm"):
        return sum(min(longest, query_tokens + d) for d in doc_tokens)
    return text_tokens(call.query, longest, card) + sum(doc_tokens)


def unique_labels(labels: list[str], fold: bool) -> list[str]:
    """Labels de-duplicated in request order; with `fold`, labels that lowercase alike are one (the
    first as sent is kept)."""
    first: dict[str, str] = {}
    for label in labels:
        first.setdefault(label.lower() if fold else label, label)
    return list(first.values())


def _labels(call: ExtractCall, card: ModelCard) -> list[str]:
    """The labels the task will prompt with (before the task has checked them)."""
    labels = [label for label in call.labels if isinstance(label, str)] if isinstance(call.labels, list) else []
    fold = card.extract is not None and card.extract.kind == "gliner" and card.extract.lowercase_labels
    return unique_labels(labels, fold)


def _gliner(call: AnyCall, card: ModelCard) -> int:
    """Each window of a text repeats the label prompt ([ENT] label ... [SEP])."""
    assert isinstance(call, ExtractCall)
    longest = card.max_length
    prompt = sum(text_tokens(label, longest) for label in _labels(call, card)) + 1
    room = max(MIN_TEXT_TOKENS, longest - prompt - 2)
    text = [raw_tokens(t, card) for t in call.items]
    return sum(t + -(-t // room) * prompt for t in text)


def _token_class(call: AnyCall, card: ModelCard) -> int:
    assert isinstance(call, ExtractCall)
    return sum(raw_tokens(t, card) for t in call.items)


def _classify(call: AnyCall, card: ModelCard) -> int:
    """Each text (with its pair's second text) once, cut at max_length."""
    assert isinstance(call, ExtractCall)
    pairs = call.text_pairs if isinstance(call.text_pairs, list) else []
    seconds = [raw_tokens(p, card) if isinstance(p, str) else 0 for p in pairs] + [0] * len(call.items)
    return sum(min(card.max_length, raw_tokens(t, card) + s) for t, s in zip(call.items, seconds))


def _zero_shot(call: AnyCall, card: ModelCard) -> int:
    """One (text, hypothesis) pair per label."""
    assert isinstance(call, ExtractCall)
    labels = max(1, len(_labels(call, card)))
    return sum(min(card.max_length, raw_tokens(t, card) + 12) for t in call.items) * labels


def _gliclass(call: AnyCall, card: ModelCard) -> int:
    """Each text once, with the label prompt (<<LABEL>> label ... <<SEP>>), cut at max_length."""
    assert isinstance(call, ExtractCall)
    prompt = sum(text_tokens(label, card.max_length) for label in _labels(call, card)) + 1
    return sum(min(card.max_length, raw_tokens(t, card) + prompt) for t in call.items)


def _glirel(call: AnyCall, card: ModelCard) -> int:
    """Each text once, whole, with the relation-type prompt ([REL] type ... [SEP])."""
    assert isinstance(call, ExtractCall)
    prompt = sum(text_tokens(label, card.max_length) + 1 for label in _labels(call, card)) + 1
    return sum(raw_tokens(t, card) + prompt for t in call.items)


def _image_labels(call: AnyCall, card: ModelCard) -> int:
    """Each image once, and one prompt (the template around the label) per label."""
    assert isinstance(call, ExtractCall)
    around = len(card.extract.hypothesis_template) if card.extract is not None else 0
    prompts = sum(min(card.max_length, raw_tokens(label, card, around)) for label in _labels(call, card))
    return sum(raw_tokens(item, card) for item in call.items) + prompts


def _max_new_tokens(call: ExtractCall | GenerateCall, card: ModelCard) -> int:
    asked = call.max_new_tokens
    default = card.generate.max_new_tokens if card.generate is not None else 256
    return asked if isinstance(asked, int) and asked > 0 else default


def _generate(call: AnyCall, card: ModelCard) -> int:
    """The prompt (messages with ~8 tokens of template each) and the new tokens asked for."""
    assert isinstance(call, GenerateCall)
    messages = call.messages if isinstance(call.messages, list) else []
    prompt = sum(len(m.content) // 4 + 8 for m in messages) + len(call.prompt or "") // 4
    return min(card.max_length, prompt + _max_new_tokens(call, card))


def _extract_generate(call: AnyCall, card: ModelCard) -> int:
    """Per text: the frame around it (the card's system message and prompt), the text, and the new
    tokens asked for."""
    assert isinstance(call, ExtractCall)
    g = card.generate
    frame = len(g.extract_system + g.extract_prompt) if g is not None else 0
    new = _max_new_tokens(call, card)
    return sum(min(card.max_length, raw_tokens(t, card, frame) + 16 + new) for t in call.items)


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("encode", EncodeCall, EncodeResult, "encode:EncodeTask", _encode),
        Kind("score", ScoreCall, ScoreResult, "score:ScoreTask", _score),
        Kind("extract:gliner", ExtractCall, ExtractResult, "extract_gliner:GlinerTask", _gliner),
        Kind("extract:token_class", ExtractCall, ExtractResult, "extract_token_class:TokenClassTask", _token_class),
        Kind("extract:zero_shot", ExtractCall, ExtractResult, "extract_zero_shot:ZeroShotTask", _zero_shot),
        Kind("extract:image_labels", ExtractCall, ExtractResult, "extract_image_labels:ImageLabelsTask", _image_labels),
        Kind("extract:classify", ExtractCall, ExtractResult, "extract_classify:ClassifyTask", _classify),
        Kind("extract:gliclass", ExtractCall, ExtractResult, "extract_gliclass:GliclassTask", _gliclass),
        Kind("extract:gliner2", ExtractCall, ExtractResult, "extract_gliner2:Gliner2Task", _gliner),
        Kind("extract:glirel", ExtractCall, ExtractResult, "extract_glirel:GlirelTask", _glirel),
        Kind("extract:generate", ExtractCall, ExtractResult, "generate:ExtractGenerateTask", _extract_generate),
        Kind("generate", GenerateCall, GenerateResult, "generate:GenerateTask", _generate),
    )
}

VERB_OF_CALL: dict[type, str] = {kind.call: name.split(":")[0] for name, kind in KINDS.items()}


def kind_of(call: AnyCall, card: ModelCard) -> Kind:
    """The registry entry that serves `call` on `card`; an InvalidRequest if the card does not
    serve the call's verb."""
    verb = VERB_OF_CALL.get(type(call))
    if verb is None:
        raise InvalidRequest(f"this server does not serve {type(call).__name__} calls")
    if verb not in card.tasks or (verb == "extract" and card.extract is None):
        raise InvalidRequest(
            f"model {card.id} does not {verb}; it serves: {', '.join(card.tasks)}",
            details={"model": card.id, "tasks": list(card.tasks)},
        )
    name = f"extract:{card.extract.kind}" if verb == "extract" and card.extract is not None else verb
    kind = KINDS.get(name)
    if kind is None:
        raise InvalidRequest(f"model {card.id}: this server has no task for {name}", details={"model": card.id})
    return kind


def estimate_tokens(call: AnyCall, card: ModelCard | None) -> int:
    """About how many tokens `call` will run on `card`: the one estimate (see the module's
    docstring). Without a card (the model is unknown) or for a call the card does not serve, the
    call's characters alone."""
    if card is not None:
        try:
            return max(1, kind_of(call, card).estimate(call, card))
        except InvalidRequest:
            pass  # the engine refuses the call; its size still sizes the pull that carries it
    return max(1, _characters(call) // 4 + 2)


def _characters(call: AnyCall) -> int:
    if isinstance(call, ScoreCall):
        return _length(call.query) * len(call.documents) + sum(map(_length, call.documents))
    if isinstance(call, GenerateCall):
        messages = call.messages if isinstance(call.messages, list) else []
        return sum(len(m.content) for m in messages) + len(call.prompt or "")
    return sum(map(_length, call.items))


def _length(value: Input) -> int:
    """An input's characters (an image: what IMAGE_TOKENS tokens of text would be)."""
    text = text_of(value)
    return 4 * IMAGE_TOKENS if text is None else len(text)
