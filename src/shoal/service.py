"""The Service protocol: the one seam between the HTTP API and whatever serves the calls.

The in-process `Engine` implements it; the cluster gateway's remote service will too, so the same
routes serve a single node and a cluster. Nothing here imports torch, tokenizers or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from .calls import AnyCall, AnyResult
from .metrics import Metrics

if TYPE_CHECKING:
    from .catalog import ModelCard


class ModelStatus(msgspec.Struct, frozen=True, omit_defaults=True):
    """What `/v1/models` says about one model."""

    id: str
    tasks: tuple[str, ...]
    outputs: tuple[str, ...]
    max_length: int
    verified: str
    loaded: bool
    architecture: str | None = None
    dimensions: int | None = None
    pooling: str | None = None
    prompts: tuple[str, ...] = ()
    description: str = ""
    extract: str | None = None  # an extraction model's kind: gliner, token_class or zero_shot
    # Residency: not_loaded, loading, loaded or failed (then `error` says why, as a client sees it);
    # on a cluster gateway also no_worker (no live worker serves it).
    state: str = "not_loaded"
    bytes: int | None = None  # measured bytes while loaded (its tensors and resident adapters)
    pinned: bool = False
    device: str | None = None
    adapters: tuple[str, ...] = ()  # the adapters a request may name
    adapters_loaded: tuple[str, ...] = ()
    error: str | None = None
    aliases: tuple[str, ...] = ()  # other names a request may use for it
    # Where its weights are: local (a load needs no network), downloadable (from the Hub, when it
    # answers) or unavailable (this server cannot load it); None where not known (a gateway).
    weights: str | None = None
    # A text classifier's own labels by logit index (config.json's id2label), known while it is
    # loaded; TEI's `/info` reports them.
    labels: tuple[str, ...] = ()
    # What the model computes in (float32, bfloat16, float16, int8, int4): the loaded model's, else what a
    # load on this server's device would choose (engine/precision.py); None where not known.
    precision: str | None = None


def status_of_card(
    card: ModelCard,
    *,
    loaded: bool = False,
    state: str = "not_loaded",
    bytes: int | None = None,
    pinned: bool = False,
    device: str | None = None,
    adapters_loaded: tuple[str, ...] = (),
    error: str | None = None,
    aliases: tuple[str, ...] = (),
    weights: str | None = None,
    labels: tuple[str, ...] = (),
) -> ModelStatus:
    """A card's `ModelStatus`; the keywords are the fields the server measures (residency: state,
    bytes...), as `ModelStatus` documents them."""
    return ModelStatus(
        id=card.id,
        tasks=card.tasks,
        outputs=card.outputs if "encode" in card.tasks else (),
        max_length=card.max_length,
        verified=card.verified,
        architecture=card.architecture,
        dimensions=card.dimensions,
        pooling=card.pooling,
        prompts=tuple(sorted(card.prompts)),
        description=card.description,
        extract=card.extract.kind if card.extract else None,
        adapters=tuple(sorted(card.adapters)),
        loaded=loaded,
        state=state,
        bytes=bytes,
        pinned=pinned,
        device=device,
        adapters_loaded=adapters_loaded,
        error=error,
        aliases=aliases,
        weights=weights,
        labels=labels,
    )


class Token(msgspec.Struct, frozen=True):
    """One token of a text: its id, its text (a special token's own), and its character span."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class CardProblem(msgspec.Struct, frozen=True):
    """A card or adapter folder that could not be read: it is not served; the others are."""

    file: str
    error: str


# What an operator may do to a model (`POST /v1/models/{id}/<action>`).
ADMIN_ACTIONS = ("load", "unload", "pin", "unpin")


class Capacity(msgspec.Struct, frozen=True):
    """How much more work the service takes now, in (estimated) tokens."""

    queued_tokens: int
    max_queued_tokens: int
    tokens_per_s: float | None  # measured throughput; None before the first batch

    @property
    def free_tokens(self) -> int:
        return max(0, self.max_queued_tokens - self.queued_tokens)


@runtime_checkable
class Service(Protocol):
    """Runs calls of every verb. `run` raises the ShoalError the call ends in."""

    metrics: Metrics

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def warm(self, model_ids: list[str]) -> None: ...

    async def run(self, call: AnyCall) -> AnyResult: ...

    def models(self) -> list[ModelStatus]: ...

    def model(self, model_id: str) -> ModelStatus:
        """One model's status; UnknownModel if it is not served here."""
        ...

    def problems(self) -> list[CardProblem]:
        """Cards and adapters that could not be read."""
        ...

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        """One of ADMIN_ACTIONS on a model, then its status."""
        ...

    async def tokenize(
        self,
        model_id: str,
        texts: list[str],
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
        *,
        may_download: bool = True,
    ) -> list[list[Token]]:
        """Each text's tokens as the model's tokenizer cuts it (TEI's /tokenize); `may_download`
        as a call's."""
        ...

    async def detokenize(
        self,
        model_id: str,
        ids: list[list[int]],
        skip_special_tokens: bool = True,
        *,
        may_download: bool = True,
    ) -> list[str]:
        """Each sequence of token ids as the model's tokenizer decodes it (TEI's /decode);
        InvalidRequest for an id outside its vocabulary; `may_download` as a call's."""
        ...

    def has_model(self, model_id: str) -> bool: ...

    def capacity(self) -> Capacity: ...

    @property
    def ready(self) -> bool: ...
