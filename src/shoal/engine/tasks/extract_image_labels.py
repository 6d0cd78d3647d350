"""extract, kind image_labels: zero-shot image classification by a dual encoder (CLIP, SigLIP).

Each label fills the card's (or the call's) `hypothesis_template` into a text; the label texts and
the images run as one batch through the model's dense head, and each image's labels are scored by
the model's own similarity: CLIP's logits softmaxed across the labels, SigLIP's each a sigmoid (as
transformers' zero-shot-image-classification pipeline scores them). Labels best first.
"""

from __future__ import annotations

import numpy as np

from ...calls import ExtractCall, ExtractResult, LabelScore
from ...catalog import ModelCard
from ...head_info import Similarity
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, EncodeSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract, result
from .extract_zero_shot import hypotheses_of
from .inputs import prepare


class ImageLabelsTask:
    verb = "extract"
    options = frozenset({"hypothesis_template"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        plan = plan_extract(card, call, "image_labels", self.options, labels_required=True, reads="image")
        hypotheses_of(card, call, plan.labels[:1])  # a bad template fails before any work
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        plan.model = model
        model.head(Similarity)  # a model without its own similarity fails here, not after its forward
        prompts = hypotheses_of(plan.card, plan.call, plan.labels)
        values = [*prompts, *plan.images]
        modalities = ["text"] * len(prompts) + ["image"] * len(plan.images)
        seqs = await prepare(pool, model, values, modalities, is_query=False, truncate=True)  # type: ignore[arg-type]
        plan.owners = list(range(len(plan.images)))  # each image read once (the prompts are shared)
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[EncodeSpec]:
        return [EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")] * len(seqs)

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # a score per label

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return False

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        assert plan.model is not None
        similarity = plan.model.head(Similarity)
        k = len(plan.labels)
        labels = np.stack([item.dense for item in outputs[:k]]).astype(np.float64)  # [k, dim], normalised
        images = np.stack([item.dense for item in outputs[k:]]).astype(np.float64)  # [n, dim]
        logits = images @ labels.T * similarity.scale + similarity.bias  # [n, k]
        if similarity.sigmoid:
            scores = 1.0 / (1.0 + np.exp(-logits))
        else:
            scores = np.exp(logits - logits.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
        items = []
        for row in scores:
            order = sorted(range(k), key=lambda i: -row[i])
            kept = [LabelScore(plan.labels[i], float(row[i])) for i in order]
            items.append((None, [s for s in kept if plan.threshold is None or s.score >= plan.threshold]))
        windows = np.ones(len(plan.images), dtype=np.int64)
        # the result counts every token run: the label prompts' too
        return result(plan, seqs, items, windows, timings)
