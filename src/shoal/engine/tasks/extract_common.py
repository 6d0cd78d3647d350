"""What the extract kinds share: the plan, the checks of labels and options, and the result.

Each kind is its own task (extract_gliner.py, extract_token_class.py, extract_zero_shot.py) and
says which of ExtractCall's kind-specific options it takes (`options`); an option another kind
takes is refused with the kinds it applies to. Nothing is cut silently: a zero-shot text that did
not fit says `truncated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...calls import ExtractCall, ExtractedItem, ExtractResult, Modality
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...verbs import KINDS, estimate_tokens, unique_labels
from ..backend import ModelInfo
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .inputs import images_of, texts_of

MAX_LABELS = 100
MAX_LABEL_CHARS = 200
# ExtractCall's options that only some kinds take (each kind's task lists its own in `options`).
KIND_OPTIONS = (
    "max_span_width",
    "hypothesis_template",
    "aggregation",
    "flat_ner",
    "multi_label",
    "top_k",
    "raw_scores",
    "function_to_apply",
    "text_pairs",
    "truncate",
    "schema",
    "max_new_tokens",
)


@dataclass
class ExtractPlan:
    card: ModelCard
    call: ExtractCall
    kind: str
    labels: list[str]  # de-duplicated, in request order
    threshold: float | None
    estimated_tokens: int
    texts: list[str]  # the call's items, for the kinds that read texts
    images: list[bytes] = field(default_factory=list)  # or their images' bytes (image_labels)
    # Filled by tokenize, one entry per sequence: the text it reads and what collect needs of it.
    owners: list[int] = field(default_factory=list)
    windows: list[tuple] = field(default_factory=list)
    per_text: list[tuple] = field(default_factory=list)  # what the kind's collect needs of each text
    truncated: list[bool] = field(default_factory=list)  # texts cut to fit
    specs: list[ExtractSpec] = field(default_factory=list)  # per sequence, when they differ
    model: ModelInfo | None = None  # the model tokenize planned for (collect reads its heads' labels)

    @property
    def num_items(self) -> int:
        return len(self.texts) or len(self.images)


def plan_extract(
    card: ModelCard,
    call: ExtractCall,
    kind: str,
    options: frozenset[str],
    *,
    labels_required: bool,
    fold_labels: bool = False,
    default_threshold: float | None = None,
    reads: Modality = "text",
) -> ExtractPlan:
    """The checks every kind makes, then the plan: texts, labels, threshold, the kind's options."""
    if not call.items:
        raise InvalidRequest("no items to extract from", details={"option": "items"})
    texts, images = [], []
    if reads == "text":
        texts = texts_of(call.items, card, task="extracts from")
    else:
        images = images_of(call.items, card, task="labels")
    labels = check_labels(call.labels, required=labels_required, fold=fold_labels)
    threshold = call.threshold if call.threshold is not None else card.extract.threshold if card.extract else None
    if threshold is None:
        threshold = default_threshold
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
        raise InvalidRequest(f"threshold must be between 0 and 1, not {threshold!r}", details={"option": "threshold"})
    for option in KIND_OPTIONS:
        if getattr(call, option) is not None and option not in options:
            raise InvalidRequest(
                f"{option} applies to {' and '.join(_kinds_taking(option))} models; model {card.id} is {kind}",
                details={"option": option},
            )
    return ExtractPlan(card, call, kind, labels, threshold, estimate_tokens(call, card), texts, images)


def _kinds_taking(option: str) -> list[str]:
    from . import task_of_kind  # the registry's tasks, each with its `options`

    return [
        name.split(":", 1)[1]
        for name in KINDS
        if name.startswith("extract:") and option in getattr(task_of_kind(name), "options", ())
    ]


def one_spec_each(plan: ExtractPlan, seqs: list[Encoded], output: str) -> list[ExtractSpec]:
    return plan.specs or [ExtractSpec((output,))] * len(seqs)


def result(
    plan: ExtractPlan, seqs: list[Encoded], items: list[tuple], windows: np.ndarray, timings: PhaseSeconds
) -> ExtractResult:
    """The call's result from one (entities, labels) pair per text."""
    truncated = plan.truncated or [False] * len(items)
    out = [
        ExtractedItem(entities=item[0], labels=item[1], num_windows=int(windows[i]), truncated=truncated[i])
        for i, item in enumerate(items)
    ]
    return ExtractResult(items=out, num_tokens=sum(len(s) for s in seqs), request_id=plan.call.request_id, **timings)


def windows_per_text(plan: ExtractPlan) -> np.ndarray:
    """Sequences read per text (0: a text without words)."""
    return np.bincount(np.asarray(plan.owners, dtype=np.int64), minlength=plan.num_items)


def check_labels(labels: list, required: bool, fold: bool = False) -> list[str]:
    if not isinstance(labels, list):
        raise InvalidRequest("labels must be a list of strings", details={"option": "labels"})
    if required and not labels:
        raise InvalidRequest(
            "labels is empty: send the entity types (or classes) to look for, "
            'e.g. "labels": ["person", "organization"]',
            details={"option": "labels"},
        )
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(
            f"{len(labels)} labels is more than one request may send ({MAX_LABELS})",
            details={"option": "labels", "max": MAX_LABELS},
        )
    for index, label in enumerate(labels):
        if not isinstance(label, str) or not label.strip():
            raise InvalidRequest(
                f"labels[{index}] is empty: every label needs some text", details={"option": "labels", "index": index}
            )
        if len(label) > MAX_LABEL_CHARS:
            raise InvalidRequest(
                f"labels[{index}] is {len(label)} characters long; a label may have at most {MAX_LABEL_CHARS}",
                details={"option": "labels", "index": index, "max": MAX_LABEL_CHARS},
            )
    return unique_labels(labels, fold)
