"""What every task checks of a call's inputs before planning: each is well formed, of a modality the
card reads (and the task takes), and a text is valid Unicode. Errors name the input (`items[3]`,
`documents[0]`, `the query`) and say what to send instead."""

from __future__ import annotations

from collections.abc import Sequence

from ...calls import Input, Item, Modality, modality_of
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded


def check_inputs(values: Sequence[Input], card: ModelCard, what: str = "items", indexed: bool = True) -> list[Modality]:
    """The modality of each input, after checking it (see the module's docstring)."""
    modalities: list[Modality] = []
    for index, value in enumerate(values):
        name = f"{what}[{index}]" if indexed else what
        if isinstance(value, Item):
            if (value.text is None) == (value.image is None):
                has = "both a text and an image" if value.text is not None else "neither a text nor an image"
                raise InvalidRequest(f"{name} has {has}: send one of them per item", details={"index": index})
            if value.image is not None and not value.image:
                raise InvalidRequest(f"{name} is an empty image: send the image file's bytes", details={"index": index})
        elif not isinstance(value, str):
            raise InvalidRequest(f"{name} is {type(value).__name__}, not a string", details={"index": index})
        modality = modality_of(value)
        if modality not in card.modalities:
            raise InvalidRequest(
                f"{name} is {_A[modality]}, and model {card.id} reads {' and '.join(card.modalities)} only",
                details={"index": index, "model": card.id, "modalities": list(card.modalities)},
            )
        if modality == "text":
            _check_unicode(_text(value), name, index)
        modalities.append(modality)
    return modalities


def texts_of(
    values: Sequence[Input], card: ModelCard, what: str = "items", indexed: bool = True, task: str = ""
) -> list[str]:
    """The texts of `values`, for a task that reads text only (`task` names it in the error, as
    "ranks pairs" or "extracts entities"); any other modality is refused by input."""
    modalities = check_inputs(values, card, what, indexed)
    for index, modality in enumerate(modalities):
        if modality != "text":
            name = f"{what}[{index}]" if indexed else what
            raise InvalidRequest(
                f"{name} is {_A[modality]}; model {card.id} {task or 'takes'} texts only",
                details={"index": index, "model": card.id},
            )
    return [_text(value) for value in values]


def images_of(values: Sequence[Input], card: ModelCard, what: str = "items", task: str = "") -> list[bytes]:
    """The image bytes of `values`, for a task that reads images only (`task` names it)."""
    modalities = check_inputs(values, card, what)
    for index, modality in enumerate(modalities):
        if modality != "image":
            raise InvalidRequest(
                f"{what}[{index}] is {_A[modality]}; model {card.id} {task or 'takes'} images only",
                details={"index": index, "model": card.id},
            )
    return [value.image for value in values if isinstance(value, Item) and value.image is not None]


def value_of(item: Input, prefix: str = "") -> str | bytes:
    """What a checked input's preprocessor takes: its text (after `prefix`, a prompt), or its image's bytes."""
    if isinstance(item, Item):
        if item.image is not None:
            return item.image
        assert item.text is not None
        item = item.text
    return prefix + item if prefix else item


async def prepare(
    pool: TokenizerPool,
    model: ModelInfo,
    values: list,
    modalities: Sequence[Modality],
    *,
    is_query: bool,
    truncate: bool,
    what: str = "items",
) -> list[Encoded]:
    """One sequence per value (`value_of` each input), each through its modality's preprocessor,
    in the values' order; texts alone go to the tokenizer in one piece."""
    if all(m == "text" for m in modalities):
        return await pool.encode(model.tokenizer_for(is_query), values, truncate, what=what)
    by_index: dict[int, Encoded] = {}
    for modality in dict.fromkeys(modalities):
        indices = [i for i, m in enumerate(modalities) if m == modality]
        preprocessor = model.preprocessor(modality, is_query)
        by_index.update(
            zip(indices, await pool.prepare(preprocessor, [values[i] for i in indices], indices, truncate, what))
        )
    return [by_index[i] for i in range(len(values))]


def _text(value: Input) -> str:
    if isinstance(value, str):
        return value
    assert value.text is not None
    return value.text


def _check_unicode(text: str, name: str, index: int) -> None:
    """A lone UTF-16 surrogate is not Unicode text: the HTTP decoders refuse it already; in-process
    callers reach this check."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{name} has a lone surrogate {text[exc.start]!r} at character {exc.start}: send valid Unicode text",
            details={"index": index, "position": exc.start},
        ) from None


_A = {"text": "a text", "image": "an image"}
