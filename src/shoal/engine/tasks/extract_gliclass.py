"""extract, kind gliclass: a score per requested label for each text (GLiClass, one forward).

Each text is one sequence with the label prompt (`<<LABEL>>label ... <<SEP>>`, no spaces, labels
as sent) after it, or before it when the model's `prompt_first`; the head returns a logit per
label. A text too long for it and the prompt is cut (and said `truncated`) so that every label
stays: the `gliclass` pipeline cuts the whole string at max_length, which drops labels when the
text comes first. Scores: each label's sigmoid (`multi_label`, the default, as the pipeline's
default "multi-label"), those at or above `threshold` (default 0.5); or the softmax across the
labels, all of them unless a threshold is given (the pipeline's "single-label" returns the best).
Labels best first.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...calls import ExtractCall, ExtractResult, LabelScore
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import GliclassPrompt
from ...verbs import MIN_TEXT_TOKENS
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract, result

MULTI_LABEL_THRESHOLD = 0.5


class GliclassTask:
    verb = "extract"
    options = frozenset({"multi_label"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        return plan_extract(card, call, "gliclass", self.options, labels_required=True)

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        head, tok = model.head(GliclassPrompt), model.text
        labels = plan.labels
        for index, label in enumerate(labels):
            if head.label_token in label or head.sep_token in label:
                raise InvalidRequest(
                    f"labels[{index}] {label!r} holds one of the model's prompt tokens "
                    f"({head.label_token}, {head.sep_token}); name a class",
                    details={"option": "labels", "index": index},
                )
        prompt = "".join(head.label_token + label for label in labels) + head.sep_token
        frame = len(tok.encode([prompt], True)[0])  # the prompt and the special tokens around it
        room = tok.max_length - frame
        if room < MIN_TEXT_TOKENS:
            raise InvalidRequest(
                f"the {len(labels)} labels take {frame} of the model's {tok.max_length} tokens, leaving "
                "too little for the text: send fewer or shorter labels",
                details={"option": "labels", "prompt_tokens": frame},
            )

        def encode(chunk: list[str], start: int) -> list[Encoded]:
            out = []
            for offset, text in enumerate(chunk):
                if head.prompt_first:  # the end of the text is what truncation cuts
                    seq = tok.encode([prompt + text], True)[0]
                else:
                    cut, truncated = tok.cut_to_tokens(text, room)
                    seq = tok.encode([cut + prompt], True)[0]
                    if truncated:
                        seq = replace(seq, truncated=True)
                found = int((seq.ids == head.label_token_id).sum())
                if found != len(labels):
                    raise InvalidRequest(
                        f"items[{start + offset}] holds the model's label token {head.label_token}; "
                        "remove it from the text",
                        details={"option": "items", "index": start + offset},
                    )
                out.append(seq)
            return out

        seqs = await pool.map(encode, plan.texts)
        plan.owners = list(range(len(seqs)))
        plan.truncated = [s.truncated for s in seqs]
        plan.specs = [
            ExtractSpec(("gliclass",), prompt_tokens=np.flatnonzero(s.ids == head.label_token_id)) for s in seqs
        ]
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return plan.specs

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # a score per label

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return False

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        multi = plan.call.multi_label is not False
        threshold = plan.threshold
        if threshold is None and multi:
            threshold = MULTI_LABEL_THRESHOLD
        items = []
        for logits in outputs:
            x = np.asarray(logits, dtype=np.float64)
            if multi:
                scores = 1.0 / (1.0 + np.exp(-x))
            else:
                e = np.exp(x - x.max())
                scores = e / e.sum()
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            items.append(
                (
                    None,
                    [
                        LabelScore(plan.labels[i], float(scores[i]))
                        for i in order
                        if threshold is None or scores[i] >= threshold
                    ],
                )
            )
        windows = np.ones(len(plan.texts), dtype=np.int64)  # one reading of each text
        return result(plan, seqs, items, windows, timings)
