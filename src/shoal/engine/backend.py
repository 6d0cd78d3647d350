"""The backend seam: what the engine asks of whatever runs a model's forward. No torch here.

    Backend.load(card) ─▶ LoadedModel ─┬ .info : ModelInfo    what tasks, cache and device read
                                       ├ .forward(Batch, specs) -> one output per sequence
                                       ├ .num_bytes, .workspace_bytes      measured, for the cache
                                       ├ .add_adapter / .remove_adapter / .adapter_slot / .adapter_bytes
                                       └ .close()

`ModelInfo` is the torch-free description of a loaded model: its card, its preprocessors, one per
modality it reads (`Preprocessor`: the text one is the tokenizer, with a query and a document
variant for late interaction; an image one makes patch rows), and what its
heads tell the tasks that plan for them (`HeadInfo` values: GLiNER's prompt tokens, a token
classifier's label map, an NLI model's entailment ids, an LLM reranker's frame). Tasks plan from
it alone: they never see torch tensors or head objects.

The torch backend (engine/runner.py) is the one implementation today; an ONNX Runtime or a GPU
backend with another forward would be another, built by a `Backend` the engine is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ModelLoadError
from ..head_info import GlinerPrompt, H, HeadInfo, LlmFrame, NliLabels, TokenLabels
from .precision import precision_of

if TYPE_CHECKING:
    from ..catalog import ModelCard
    from .tokenizer import TextTokenizer
    from .types import Batch, Encoded, Spec


class Preprocessor(Protocol):
    """One modality's inputs into the sequences the scheduler packs: a text's tokens, an image's
    placeholder ids with its patch rows as a feature slot. A sequence's length is its cost in
    every token budget, so an image's patches count as tokens. Runs on the tokenizer pool's
    threads, never on the event loop or a device lane."""

    modality: str  # "text", "image": what `calls.modality_of` says of the inputs it takes

    def prepare(self, values: Sequence[Any], truncate: bool, *, first_index: int, what: str) -> list[Encoded]:
        """One sequence per value (a text, an image file's bytes); an InvalidRequest (or
        InputTooLong) names the bad one as `what[first_index + i]`."""
        ...


# --- the description -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model as the engine sees it: the card it was loaded from, its preprocessors and its
    heads' descriptions. The same object for the model's whole life in the cache."""

    card: ModelCard
    text: TextTokenizer  # the model's tokenizer: documents, pairs, words
    outputs: tuple[str, ...]  # what its heads compute ("dense", "score", "entities", ...)
    query_text: TextTokenizer | None = None  # late interaction: queries shaped as queries; None: `text`
    document_text: TextTokenizer | None = None  # late interaction: documents; None: `text`
    heads: tuple[HeadInfo, ...] = field(default_factory=tuple)
    image: Preprocessor | None = None  # a model that reads images: their preprocessor

    @property
    def precision(self) -> str:
        """What the model computes in ("float32", "bfloat16", "float16", or "int8" / "int4" Linears): the
        loaded card is the one `engine/precision.py` chose for the device."""
        return precision_of(self.card)

    def tokenizer_for(self, is_query: bool) -> TextTokenizer:
        """The text preprocessor of a query or of a document."""
        chosen = self.query_text if is_query else self.document_text
        return chosen or self.text

    def preprocessor(self, modality: str, is_query: bool = False) -> Preprocessor:
        """The preprocessor of `modality`; a ModelLoadError (502, naming the model) if the model
        has none: its card says it reads what its checkpoint gave no preprocessor for."""
        if modality == "text":
            return self.tokenizer_for(is_query)
        if modality == "image" and self.image is not None:
            return self.image
        raise ModelLoadError(f"model {self.card.id} has no {modality} preprocessor", details={"model": self.card.id})

    def head(self, kind: type[H]) -> H:
        """The head description of `kind`; a ModelLoadError (502, naming the model) if the model
        has none: its card's task needs a head its checkpoint did not give."""
        for info in self.heads:
            if isinstance(info, kind):
                return info
        raise ModelLoadError(f"model {self.card.id} has no {kind.__name__} head", details={"model": self.card.id})


# --- the contracts ---------------------------------------------------------------------------------


class LoadedModel(Protocol):
    """One model loaded by a backend onto its device. `forward` is called from device lanes (two at
    once on a CPU); the adapter methods from a loader thread; the rest from the event loop."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def num_bytes(self) -> int:
        """Measured bytes of every tensor the model and its heads hold."""
        ...

    @property
    def workspace_bytes(self) -> int:
        """Measured (or bounded) bytes one largest batch needs beside the weights."""
        ...

    def forward(self, batch: Batch, specs: Sequence[Spec]) -> list[object]:
        """One padding-free batch; one output per sequence, as its spec asks (an EncodedItem, a
        score, a GLiNER head's span candidates, a token classifier's logits...)."""
        ...

    def add_adapter(self, name: str, directory: Path) -> int:
        """Install the PEFT LoRA adapter in `directory` under `name`; its slot."""
        ...

    def remove_adapter(self, name: str) -> None: ...

    def adapter_slot(self, name: str) -> int | None: ...

    def adapter_bytes(self, name: str) -> int: ...

    def close(self) -> None:
        """Called on eviction; a batch already running keeps its reference until it ends."""
        ...


class Backend(Protocol):
    """Loads cards into LoadedModels on one device."""

    name: str

    def load(self, card: ModelCard) -> LoadedModel: ...

    def estimate_bytes(self, card: ModelCard) -> int:
        """Bytes a load of `card` will take, before loading it."""
        ...


__all__ = [
    "Backend",
    "GlinerPrompt",
    "HeadInfo",
    "LlmFrame",
    "LoadedModel",
    "ModelInfo",
    "NliLabels",
    "Preprocessor",
    "TokenLabels",
]
