"""extract, kind glirel: relations of the requested types between given entities (GLiREL).

The call's `labels` are the relation types; its `schema` gives each text's entities,
`{"entities": [[{"start": 0, "end": 12, "label": "person"}, ...], ...]}`, one list per item, in
character offsets of the item's text, each starting and ending on a word (the package's words:
runs of word characters joined by - or _, else one symbol). The entity labels travel along
untouched: GLiREL reads only the spans.

Each text with two or more entities is one sequence, read whole (GLiREL has no windows: a text
longer than the model's `max_len` words or its max_length tokens is a 400): `[REL] type ... [REL]
type [SEP]` and the text's words, tokenized word by word. The pairs are those the package forms:
every ordered pair of two entities, in the order given (head-major); with the model's
`max_entity_pair_distance`, a pair whose head comes after its tail only when their first words are
at most that many words apart. A pair is related by each type whose score is above `threshold`
(default 0.5, the package's); with `top_k`, by its best `top_k` such types. Relations are listed
per type, in pair order; the head's and tail's spans carry the relation's score.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from ...calls import ExtractCall, ExtractedItem, ExtractResult, Relation, RelationSpan
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import GlirelPrompt
from ...spans import split_words
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract, windows_per_text

MAX_ENTITIES = 200  # per text
# Pair and type scores one request may ask for (pairs grow with the square of the entities).
MAX_SCORES = 1_000_000


@dataclass(frozen=True)
class GlirelSpec(ExtractSpec):
    label_tokens: np.ndarray | None = None  # [C, 2] positions of each type's [REL] and label word
    entity_spans: np.ndarray | None = None  # [n, 2] first and last word of each entity
    pairs: np.ndarray | None = None  # [P, 2] (head, tail) entity indices


@dataclass
class GlirelPlan(ExtractPlan):
    entities: list[list[tuple[int, int, str | None]]] = field(default_factory=list)  # per text
    pairs: list[np.ndarray] = field(default_factory=list)  # per sequence, its [P, 2] entity pairs


class GlirelTask:
    verb = "extract"
    options = frozenset({"schema", "top_k"})

    def plan(self, card: ModelCard, call: ExtractCall) -> GlirelPlan:
        plan = plan_extract(card, call, "glirel", self.options, labels_required=True, default_threshold=0.5)
        if call.top_k is not None and (
            isinstance(call.top_k, bool) or not isinstance(call.top_k, int) or call.top_k < 1
        ):
            raise InvalidRequest(f"top_k must be an integer >= 1, not {call.top_k!r}", details={"option": "top_k"})
        entities = parse_entities(call.schema, plan.texts)
        scores = sum(len(e) * (len(e) - 1) for e in entities) * len(plan.labels)
        if scores > MAX_SCORES:
            raise InvalidRequest(
                f"the entities make {scores} pair and type scores, more than one request may ask for "
                f"({MAX_SCORES}): send fewer entities, types or texts per request",
                details={"option": "schema", "scores": scores},
            )
        return GlirelPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)}, entities=entities)

    async def tokenize(self, plan: GlirelPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        head, tok, threshold = model.head(GlirelPrompt), model.text, plan.threshold
        assert threshold is not None  # the plan defaults it
        prompt = [w for label in plan.labels for w in (head.rel_token, label)] + [head.sep_token]

        def read(chunk: list[tuple[int, str, list]], start: int) -> list:
            out: list = []  # per text: None (no pair), or its sequence, word positions, spans and pairs
            for index, text, entities in chunk:
                if len(entities) < 2:  # no pair to score
                    out.append(None)
                    continue
                words, starts, ends = split_words(text)
                spans = _word_spans(index, entities, starts, ends)
                if len(words) > head.max_words:
                    raise InvalidRequest(
                        f"items[{index}] has {len(words)} words; the model reads a text whole, at most "
                        f"{head.max_words} words: split it and its entities",
                        details={"option": "items", "index": index, "max_words": head.max_words},
                    )
                (seq,) = tok.encode_words([prompt + words])
                if len(seq.ids) > tok.max_length:
                    raise InvalidRequest(
                        f"items[{index}] takes {len(seq.ids)} tokens with the {len(plan.labels)} relation types; "
                        f"the model reads a text whole, at most {tok.max_length}: split it or send fewer types",
                        details={"option": "items", "index": index, "max_tokens": tok.max_length},
                    )
                positions = _word_positions(seq, len(prompt) + len(words), head.last_subtoken)
                out.append((seq, positions, spans, _pairs(spans, head.max_pair_distance)))
            return out

        items = list(zip(range(len(plan.texts)), plan.texts, plan.entities))
        seqs: list[Encoded] = []
        for index, found in enumerate(await pool.map(read, items)):
            if found is None:
                continue
            seq, positions, spans, pairs = found
            num_prompt = 2 * len(plan.labels) + 1
            seqs.append(seq)
            plan.owners.append(index)
            plan.pairs.append(pairs)
            plan.specs.append(
                GlirelSpec(
                    ("relations",),
                    word_tokens=positions[num_prompt:],
                    threshold=threshold,
                    label_tokens=positions[: num_prompt - 1].reshape(-1, 2),
                    entity_spans=spans,
                    pairs=pairs,
                )
            )
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return plan.specs

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # bounded by MAX_SCORES

    def collect_off_loop(self, plan: GlirelPlan, outputs: list) -> bool:
        return sum(out.size for out in outputs) > 65_536

    def collect(self, plan: GlirelPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        call, labels, threshold = plan.call, plan.labels, plan.threshold
        assert threshold is not None
        found: dict[int, dict[str, list[Relation]]] = {}
        for owner, pairs, probs in zip(plan.owners, plan.pairs, outputs):
            text, entities = plan.texts[owner], plan.entities[owner]
            relations: dict[str, list[Relation]] = {label: [] for label in labels}
            for (h, t), row in zip(pairs.tolist(), probs):
                chosen = [c for c in range(len(labels)) if row[c] > threshold]  # the package's strict ">"
                if call.top_k is not None:
                    chosen = sorted(chosen, key=lambda c: -row[c])[: call.top_k]  # stable: ties keep type order
                for c in sorted(chosen):
                    score = float(row[c])
                    relations[labels[c]].append(
                        Relation(
                            head=_span(text, entities[h], score), tail=_span(text, entities[t], score), score=score
                        )
                    )
            found[owner] = relations
        windows = windows_per_text(plan)
        items = [
            ExtractedItem(relations=found.get(i, {label: [] for label in labels}), num_windows=int(windows[i]))
            for i in range(len(plan.texts))
        ]
        return ExtractResult(items=items, num_tokens=sum(len(s) for s in seqs), request_id=call.request_id, **timings)


def _span(text: str, entity: tuple[int, int, str | None], score: float) -> RelationSpan:
    a, b, _ = entity
    return RelationSpan(text=text[a:b], score=score, start=a, end=b)


def parse_entities(schema: object, texts: list[str]) -> list[list[tuple[int, int, str | None]]]:
    """Each text's entities `(start, end, label)` from the call's schema, checked against the text
    (the word boundaries are checked when the text is split)."""

    def bad(message: str, **details: object) -> InvalidRequest:
        return InvalidRequest(message, details={"option": "schema", **details})

    example = '{"entities": [[{"start": 0, "end": 5, "label": "person"}, ...], ...]}'
    if not isinstance(schema, dict) or "entities" not in schema:
        raise bad(f"a GLiREL model needs each text's entities in schema: {example}")
    extra = sorted(set(schema) - {"entities"})
    if extra:
        raise bad(f"schema.{extra[0]} is not read by a GLiREL model; its schema holds only entities", field=extra[0])
    lists = schema["entities"]
    if not isinstance(lists, list) or len(lists) != len(texts):
        count = len(lists) if isinstance(lists, list) else "not a list"
        raise bad(
            f"schema.entities must hold one list of entities per item ({len(texts)}), not {count}: {example}",
            field="entities",
        )
    out = []
    for i, (entities, text) in enumerate(zip(lists, texts)):
        where = f"schema.entities[{i}]"
        if not isinstance(entities, list):
            raise bad(f"{where} must be a list of entities, {{start, end, label}}", field=where)
        if len(entities) > MAX_ENTITIES:
            raise bad(f"{where} has {len(entities)} entities; a text may have at most {MAX_ENTITIES}", field=where)
        parsed: list[tuple[int, int, str | None]] = []
        for j, entity in enumerate(entities):
            at = f"{where}[{j}]"
            if not isinstance(entity, dict) or set(entity) - {"start", "end", "label", "text"}:
                raise bad(f"{at} must be an object with start, end and (optionally) label", field=at)
            a, b, label = entity.get("start"), entity.get("end"), entity.get("label")
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (a, b)):
                raise bad(f"{at} needs integer start and end (character offsets into items[{i}])", field=at)
            assert isinstance(a, int) and isinstance(b, int)
            if not 0 <= a < b <= len(text):
                raise bad(f"{at} [{a}, {b}) is not a span of items[{i}] ({len(text)} characters)", field=at)
            if label is not None and not isinstance(label, str):
                raise bad(f"{at}.label must be a string", field=at)
            if any((a, b) == (c, d) for c, d, _ in parsed):
                raise bad(f"{at} repeats the span [{a}, {b}) of an earlier entity; send each span once", field=at)
            parsed.append((a, b, label))
        out.append(parsed)
    return out


def _word_spans(index: int, entities: list, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """`[n, 2]` first and last word of each entity; a 400 for one that cuts a word."""
    first = {int(s): w for w, s in enumerate(starts)}
    last = {int(e): w for w, e in enumerate(ends)}
    spans = []
    for j, (a, b, _) in enumerate(entities):
        if a not in first or b not in last:
            edge = "start" if a not in first else "end"
            raise InvalidRequest(
                f"schema.entities[{index}][{j}] [{a}, {b}) does not {edge} on a word of items[{index}] "
                "(GLiREL reads whole words: runs of letters and digits, or single symbols)",
                details={"option": "schema", "field": f"schema.entities[{index}][{j}]"},
            )
        spans.append((first[a], last[b]))
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def _word_positions(seq: Encoded, num_words: int, last: bool) -> np.ndarray:
    """`[w]` position of each word's first (`last`: last) token; -1 for a word with no token."""
    positions = np.full(num_words, -1, dtype=np.int64)
    assert seq.word_ids is not None
    for pos, w in enumerate(seq.word_ids.tolist()):
        if w >= 0 and (last or positions[w] < 0):
            positions[w] = pos
    return positions


def _pairs(spans: np.ndarray, max_distance: int | None) -> np.ndarray:
    """`[P, 2]` (head, tail) entity indices, head-major: every i != j; with `max_distance`, a pair
    with i > j only when the entities' first words are at most that far apart (the package's)."""
    n = len(spans)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    keep = i != j
    if max_distance is not None:
        near = np.abs(spans[:, 0][:, None] - spans[:, 0][None, :]) <= max_distance
        keep &= (i < j) | near
    return np.stack([i[keep], j[keep]], axis=1).astype(np.int64)
