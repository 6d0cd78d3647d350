"""extract, kind token_class: entities of the model's own labels (BIO/IOB2 token classifiers).

Each text is one sequence of tokens, or windows of max_length tokens sharing an overlap; every
token keeps the logits of the window it sits most inside, and the whole text's tokens are
aggregated into entities (`aggregation`: simple, first, max, average). `labels`, if sent, keeps
only those.
"""

from __future__ import annotations

import numpy as np

from ...calls import Entity, ExtractCall, ExtractResult
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import TokenLabels
from ...spans import STRATEGIES, aggregate_entities, owned_starts, word_windows
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, one_spec_each, plan_extract, result, windows_per_text

# Beyond this many tokens to aggregate, a request's decoding runs in a worker thread.
OFF_LOOP_TOKENS = 16384


class TokenClassTask:
    verb = "extract"
    options = frozenset({"aggregation"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        plan = plan_extract(card, call, "token_class", self.options, labels_required=False)
        if call.aggregation is not None and call.aggregation not in STRATEGIES:
            raise InvalidRequest(
                f"aggregation must be one of {', '.join(STRATEGIES)}, not {call.aggregation!r}",
                details={"option": "aggregation"},
            )
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        tok, ex = model.text, plan.card.extract
        assert ex is not None
        plan.model, head = model, model.head(TokenLabels)
        if plan.labels:
            known = head.entity_types
            unknown = [label for label in plan.labels if label not in known]
            if unknown:
                raise InvalidRequest(
                    f"model {plan.card.id} does not tag {', '.join(map(repr, unknown))}; "
                    f"its labels are {', '.join(known)}",
                    details={"option": "labels", "known": known},
                )

        def windows_of(chunk: list[str], start: int) -> list:
            out = []
            for text in chunk:
                whole, lead, trail = tok.encode_whole(text)
                assert whole.offsets is not None and whole.word_ids is not None  # encode_whole gives both
                inner = slice(lead, len(whole) - trail)
                n, size = inner.stop - lead, tok.max_length - lead - trail
                # Token windows as GLiNER's word windows, each token one "word" of one token; an
                # empty text is one window of its special tokens alone.
                spans = word_windows(np.ones(n, dtype=np.int64), size, size, ex.window_overlap_tokens) or [(0, 0)]
                ids = whole.ids
                seqs = [Encoded(np.concatenate([ids[:lead], ids[inner][a:b], ids[inner.stop :]])) for a, b in spans]
                out.append(
                    ((whole.offsets[inner], whole.word_ids[inner]), list(zip(seqs, spans, owned_starts(spans))), lead)
                )
            return out

        per_text = await pool.map(windows_of, plan.texts)
        seqs = []
        for index, (whole, windows, lead) in enumerate(per_text):
            plan.per_text.append(whole)
            for seq, (a, _), own in windows:
                seqs.append(seq)
                plan.owners.append(index)
                plan.windows.append((a, own, lead))
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return one_spec_each(plan, seqs, "token_logits")

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # entities are bounded by the text's tokens

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        return sum(len(out) for out in outputs) > OFF_LOOP_TOKENS

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        assert plan.model is not None
        id2label = plan.model.head(TokenLabels).id2label
        return result(plan, seqs, self._items(plan, outputs, id2label), windows_per_text(plan), timings)

    def _items(self, plan: ExtractPlan, outputs: list, id2label: dict[int, str]) -> list[tuple]:
        call, card = plan.call, plan.card
        assert card.extract is not None
        strategy = call.aggregation or card.extract.aggregation
        n = len(plan.texts)
        stitched: list[np.ndarray | None] = [None] * n
        for owner, (a, (lo, hi), lead), logits in zip(plan.owners, plan.windows, outputs):
            offsets, _ = plan.per_text[owner]
            rows = stitched[owner]
            if rows is None:
                rows = stitched[owner] = np.zeros((len(offsets), logits.shape[1]), dtype=np.float32)
            rows[lo:hi] = logits[lead + lo - a : lead + hi - a]
        items = []
        for index in range(n):
            offsets, word_ids = plan.per_text[index]
            logits = stitched[index]
            groups = (
                aggregate_entities(logits, id2label, offsets, word_ids, plan.texts[index], strategy)
                if logits is not None and len(logits)
                else []
            )
            if card.extract.merge_adjacent:
                groups = _merge_runs(groups, plan.texts[index])
            entities = [
                Entity(**g)
                for g in groups
                if (plan.threshold is None or g["score"] >= plan.threshold)
                and (not plan.labels or g["label"] in plan.labels)
            ]
            items.append((entities, None))
        return items


def _merge_runs(groups: list[dict], text: str) -> list[dict]:
    """Consecutive entities of one label with only whitespace between them, as one (mean score)."""
    merged: list[dict] = []
    counts: list[int] = []
    for g in groups:
        last = merged[-1] if merged else None
        if last and last["label"] == g["label"] and not text[last["end"] : g["start"]].strip():
            last["score"] = (last["score"] * counts[-1] + g["score"]) / (counts[-1] + 1)
            counts[-1] += 1
            last["end"] = g["end"]
            last["text"] = text[last["start"] : g["end"]]
        else:
            merged.append(dict(g))
            counts.append(1)
    return merged
