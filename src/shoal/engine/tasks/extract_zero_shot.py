"""extract, kind zero_shot: a score per requested label for each text (NLI entailment).

One (text, hypothesis) pair per label, the text cut to fit (and then said `truncated`);
entailment logits softmaxed across labels, or against contradiction per label (`multi_label`).
"""

from __future__ import annotations

import numpy as np

from ...calls import ExtractCall, ExtractResult, LabelScore
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import NliLabels
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, one_spec_each, plan_extract, result


class ZeroShotTask:
    verb = "extract"
    options = frozenset({"hypothesis_template", "multi_label"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        plan = plan_extract(card, call, "zero_shot", self.options, labels_required=True)
        hypotheses_of(card, call, plan.labels[:1])
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        call, tok = plan.call, model.text
        plan.model = model
        model.head(NliLabels)  # a model without entailment labels fails here, not after its forward
        hypotheses = hypotheses_of(plan.card, call, plan.labels)
        texts = [t for t in plan.texts for _ in hypotheses]
        seqs = await pool.encode(tok, texts, True, pairs=hypotheses * len(plan.texts), cut_first=True, what="items")
        k = len(hypotheses)
        plan.owners = [i for i in range(len(plan.texts)) for _ in hypotheses]
        plan.truncated = [any(s.truncated for s in seqs[i * k : (i + 1) * k]) for i in range(len(plan.texts))]
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return one_spec_each(plan, seqs, "nli")

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # a score per label

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return False

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        windows = np.ones(len(plan.texts), dtype=np.int64)  # one reading of each text
        return result(plan, seqs, self._items(plan, outputs), windows, timings)

    def _items(self, plan: ExtractPlan, outputs: list) -> list[tuple]:
        call, k = plan.call, len(plan.labels)
        assert plan.model is not None
        head = plan.model.head(NliLabels)
        items = []
        for index in range(len(plan.texts)):
            logits = np.stack(outputs[index * k : (index + 1) * k]).astype(np.float64)  # [labels, nli labels]
            if bool(call.multi_label) or k == 1:
                pair = logits[:, [head.contradiction_id, head.entailment_id]]
                pair = np.exp(pair - pair.max(axis=1, keepdims=True))
                scores = pair[:, 1] / pair.sum(axis=1)
            else:
                entail = logits[:, head.entailment_id]
                entail = np.exp(entail - entail.max())
                scores = entail / entail.sum()
            order = sorted(range(k), key=lambda i: -scores[i])
            labels = [
                LabelScore(plan.labels[i], float(scores[i]))
                for i in order
                if plan.threshold is None or scores[i] >= plan.threshold
            ]
            items.append((None, labels))
        return items


def hypotheses_of(card: ModelCard, call: ExtractCall, labels: list[str]) -> list[str]:
    """The call's (else the card's) `hypothesis_template` filled with each label (as transformers'
    pipelines fill it), once the template is known to place the label exactly once."""
    assert card.extract is not None
    template = call.hypothesis_template or card.extract.hypothesis_template
    sentinel = "\x00label\x00"
    try:
        placed = template.format(sentinel).count(sentinel) if isinstance(template, str) else 0
    except (IndexError, KeyError, ValueError, AttributeError):
        placed = 0
    if placed != 1:
        raise InvalidRequest(
            f"hypothesis_template must contain {{}} exactly once (where the label goes), as a "
            f"format string; got {template!r}",
            details={"option": "hypothesis_template"},
        )
    return [template.format(label) for label in labels]
