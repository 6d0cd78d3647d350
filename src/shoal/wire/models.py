"""`GET /v1/models` and `/v1/models/{id}`: OpenAI's model objects, with shoal's fields.

Plain JSON objects (TypedDicts), as OpenAI's clients read them; `api.routes` builds them from a
`ModelStatus` and the SDK returns them as they come (its `models()`, `model()`).
"""

from __future__ import annotations

from typing import TypedDict


class AdapterEntry(TypedDict):
    id: str
    loaded: bool


class _ModelEntryIfSet(TypedDict, total=False):
    extract: str  # an extraction model's kind: gliner, token_class or zero_shot
    error: str  # why its last load failed, as a client may see it
    weights: str  # local, downloadable or unavailable (where a load would find them; a gateway omits it)
    precision: str  # float32, bfloat16, float16, int8 or int4: what it runs in (loaded) or would run in here


class ModelEntry(_ModelEntryIfSet):
    """One model: what it serves (tasks, outputs, dimensions...) and its residency (state, bytes...);
    `ModelStatus` (shoal.service) says what each field means."""

    id: str
    object: str  # "model"
    created: int
    owned_by: str
    architecture: str | None
    tasks: list[str]
    outputs: list[str]
    dimensions: int | None
    max_length: int
    pooling: str | None
    prompts: list[str]
    verified: str
    loaded: bool
    state: str
    bytes: int | None
    pinned: bool
    device: str | None
    adapters: list[AdapterEntry]
    aliases: list[str]
    description: str


class CardProblemEntry(TypedDict):
    file: str
    error: str


class _ModelListIfSet(TypedDict, total=False):
    errors: list[CardProblemEntry]  # cards that could not be read (not served)


class ModelList(_ModelListIfSet):
    object: str  # "list"
    data: list[ModelEntry]
