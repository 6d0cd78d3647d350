"""extract, kind classify: a text classifier's own labels scored for each text (or text pair).

One sequence per text (its pair's second text after it, `text_pairs`), cut at max_length unless
`truncate` is false (then an over-long one is a 422 naming it). The logits take the function the
model's config implies (transformers' text-classification pipeline: softmax, sigmoid or none), the
call's `function_to_apply` (the pipeline's argument of that name), or none with `raw_scores`;
labels come back best first, all of them or the `top_k` best, only those over `threshold`, and
only those the call's `labels` name when it names some (a label the model does not have is a 400
listing the ones it has).
"""

from __future__ import annotations

import numpy as np

from ...calls import ExtractCall, ExtractResult, LabelScore
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import ClassLabels
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, one_spec_each, plan_extract, result


class ClassifyTask:
    verb = "extract"
    options = frozenset({"top_k", "raw_scores", "function_to_apply", "text_pairs", "truncate"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        plan = plan_extract(card, call, "classify", self.options, labels_required=False)
        top_k = call.top_k
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise InvalidRequest(f"top_k must be an integer >= 1, not {top_k!r}", details={"option": "top_k"})
        function = call.function_to_apply
        if function is not None and function not in FUNCTIONS:
            raise InvalidRequest(
                f"function_to_apply must be one of {', '.join(FUNCTIONS)}, not {function!r}",
                details={"option": "function_to_apply"},
            )
        if call.raw_scores and function not in (None, "none"):
            raise InvalidRequest(
                f"raw_scores asks for the logits and function_to_apply for {function}: send one of them",
                details={"option": "function_to_apply"},
            )
        pairs = call.text_pairs
        if pairs is not None and (
            not isinstance(pairs, list) or len(pairs) != len(plan.texts) or not all(isinstance(p, str) for p in pairs)
        ):
            raise InvalidRequest(
                f"text_pairs must be a list of {len(plan.texts)} strings, one second text per item",
                details={"option": "text_pairs"},
            )
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        call = plan.call
        plan.model = model
        labels = model.head(ClassLabels)  # a model without a classifier fails here, not after its forward
        unknown = [label for label in plan.labels if label not in labels.names]
        if unknown:
            raise InvalidRequest(
                f"model {plan.card.id} has no label {unknown[0]!r}; its labels: {', '.join(labels.names)}",
                details={"option": "labels", "labels": list(labels.names)},
            )
        truncate = True if call.truncate is None else bool(call.truncate)
        seqs = await pool.encode(model.text, plan.texts, truncate, pairs=call.text_pairs, what="items")
        plan.owners = list(range(len(plan.texts)))
        plan.truncated = [s.truncated for s in seqs]
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return one_spec_each(plan, seqs, "class_logits")

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # a score per label

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return False

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        assert plan.model is not None
        labels = plan.model.head(ClassLabels)
        function = "none" if plan.call.raw_scores else plan.call.function_to_apply or labels.function
        wanted = set(plan.labels)
        items = []
        for logits in outputs:
            scores = activate(np.asarray(logits, dtype=np.float64), function)
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            ranked = [
                LabelScore(labels.names[i], float(scores[i]))
                for i in order
                if (not wanted or labels.names[i] in wanted) and (plan.threshold is None or scores[i] >= plan.threshold)
            ]
            items.append((None, ranked[: plan.call.top_k] if plan.call.top_k else ranked))
        return result(plan, seqs, items, np.ones(len(plan.texts), dtype=np.int64), timings)


FUNCTIONS = ("softmax", "sigmoid", "none")


def activate(logits: np.ndarray, function: str) -> np.ndarray:
    """`logits` `[labels]` through "softmax", "sigmoid" or "none"."""
    if function == "softmax":
        shifted = np.exp(logits - logits.max())
        return shifted / shifted.sum()
    if function == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    return logits
