"""Heads: what turns packed hidden states `[T, hidden]` into per-sequence outputs.

A registry keyed by the card: each output the card lists (and, for sparse, its kind) names a head
class that loads and owns its own tensors. Every head has `output` (the name a spec asks for) and
`run(hidden, specs) -> [one value per sequence, None where its spec did not ask]`.

    dense                 PoolingHead        cls / mean / last pooling, Matryoshka, dtype
    sparse (splade)       SpladeHead         masked-LM logits, log1p(relu), max per sequence
    sparse (token_weights) TokenWeightsHead  BGE-M3 lexical weights
    multivector           ColbertHead        projected token vectors; shapes query/document tokenizers
    score (cross_encoder) ClassifierHead     the checkpoint's sequence-classification head on the pair
    score (llm)           YesNoHead          P(yes) from the last token's yes/no LM-head rows
    extract (gliner)      GlinerHead         span candidates of the requested labels (GLiNER)
    extract (gliner2)     Gliner2Head        span candidates and label logits of a schema (GLiNER2)
    extract (glirel)      GlirelHead         a score per given entity pair and relation type (GLiREL)
    extract (gliclass)    GliclassHead       a logit per requested label (GLiClass)
    extract (token_class) TokenClassHead     per-token label logits (BIO/IOB2 NER)
    extract (zero_shot)   NliHead            NLI logits of (text, hypothesis) pairs
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..layers import AttentionMeta
from .gliclass import GliclassHead
from .gliner import GlinerHead
from .gliner2 import Gliner2Head
from .glirel import GlirelHead
from .multivector import ColbertHead
from .pooling import PoolingHead, finish, pool
from .score import ClassifierHead, NliHead, SequenceClassHead, YesNoHead
from .sparse import MaskedLMHead, SpladeHead, TokenWeightsHead, sparse_entries, splade, token_weights
from .token_class import TokenClassHead

__all__ = [
    "BuildContext",
    "Hidden",
    "build_heads",
    "finish",
    "pool",
    "sparse_entries",
    "splade",
    "token_weights",
    "MaskedLMHead",
    "PoolingHead",
    "SpladeHead",
    "TokenWeightsHead",
    "ColbertHead",
    "ClassifierHead",
    "YesNoHead",
    "GlinerHead",
    "GliclassHead",
    "GlirelHead",
    "NliHead",
    "SequenceClassHead",
    "TokenClassHead",
]


@dataclass(frozen=True)
class Hidden:
    """One forward's output, as every head sees it."""

    states: torch.Tensor  # [T, hidden]; [n, dim] from a model that pools itself (card pooling: model)
    input_ids: torch.Tensor  # [T]
    meta: AttentionMeta


@dataclass(frozen=True)
class BuildContext:
    """What a head's `build` may read: the card, the model, its folder and tokenizer, and `to`
    (the device and dtype its tensors go to)."""

    card: Any
    model: torch.nn.Module
    directory: Path | None
    tokenizer: Any
    to: dict


class _HeadClass(Protocol):
    """A head class: `build(ctx)` loads its tensors and returns the head."""

    def build(self, ctx: BuildContext) -> Any: ...


_REGISTRY: dict[str, _HeadClass] = {
    "dense": PoolingHead,
    "sparse:splade": SpladeHead,
    "sparse:token_weights": TokenWeightsHead,
    "multivector": ColbertHead,
    "score:cross_encoder": ClassifierHead,
    "score:llm": YesNoHead,
    "extract:gliner": GlinerHead,
    "extract:gliclass": GliclassHead,
    "extract:gliner2": Gliner2Head,
    "extract:glirel": GlirelHead,
    "extract:token_class": TokenClassHead,
    "extract:zero_shot": NliHead,
    "extract:classify": SequenceClassHead,
}


def _key(card, output: str) -> str:
    return f"sparse:{card.sparse_spec.kind}" if output == "sparse" else output


def build_heads(ctx: BuildContext) -> dict[str, Any]:
    """One head per output the card lists (when it encodes), a reranker's score head, an extraction
    model's head; by output name."""
    card = ctx.card
    heads = (
        {output: _REGISTRY[_key(card, output)].build(ctx) for output in card.outputs} if "encode" in card.tasks else {}
    )
    if card.score is not None:
        heads["score"] = _REGISTRY[f"score:{card.score.kind}"].build(ctx)
    if card.extract is not None and f"extract:{card.extract.kind}" in _REGISTRY:  # image_labels: the dense head
        head = _REGISTRY[f"extract:{card.extract.kind}"].build(ctx)
        heads[head.output] = head
    return heads
