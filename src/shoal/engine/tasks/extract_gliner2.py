"""extract, kind gliner2: GLiNER2 schema extraction (entities, relations, text classification and
structured records, one forward).

The schema (`gliner2_schema`) becomes one prompt per task, joined by [SEP_STRUCT], then [SEP_TEXT],
the words of the structures' choices (case kept) and the text's words, each tokenized on its own as
GLiNER2's processor does: no [CLS] or [SEP], the text split by GLiNER2's word pattern and
lower-cased, a "." word appended to a text that does not end in ".", "!" or "?". Relations,
classifications and structures decode in `gliner2_decode`.

Entities: per type, candidates at or above `threshold`, highest first, each kept unless its
characters overlap one already kept of the same type; an entity that reaches into the appended "."
ends at the text's end. Relations: per type, as many instances as its count gate says; an
instance's head and tail are each the best-scoring span for that instance and field (the first in
(start, width) order on a tie), kept when both reach `threshold` and neither is the appended "."
alone (the package would report "." past the text's end). Classifications: softmax over a task's
labels (sigmoid for multi_label, or as its class_act says); single-label gives the best,
multi-label those at or above its cls_threshold (else the best), top_k of them.

Long texts: a text too long for one sequence is read in overlapping word windows, each with the
whole prompt, as the package's `batch_extract_long` reads its chunks (a chunk of `max_words` words
loses its appended "." to that word cap, so only the last window has one). Entities merge as in
the gliner kind, each from the window that owns its start. Relations and classifications are read
in every window and merged as `batch_extract_long` merges chunks: an instance found in several
windows (both ends in their overlap) once, with the scores of the finding whose better end scored
higher; a single-label task's best-scoring window; a multi-label task's labels from every window,
each once at its higher score; a structure's records as `gliner2_decode.merge_records` says.
Every window repeats the prompt and the choices' words.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from dataclasses import dataclass, field, fields

import numpy as np

from ...calls import Entity, ExtractCall, ExtractedItem, ExtractResult, Record
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import Gliner2Prompt
from ...spans import owned_starts, word_windows
from ...verbs import MIN_TEXT_TOKENS
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract, windows_per_text
from .gliner2_decode import classify, merge_labels, merge_records, merge_relations, window_records, window_relations
from .gliner2_schema import SEP_STRUCT, SEP_TEXT, Schema, marker_words, parse_schema


@functools.cache
def _word_pattern() -> re.Pattern[str]:
    """GLiNER2's whitespace word splitter: URLs, e-mail addresses, @handles, runs of word
    characters (with combining marks and zero-width joiners, joined by - or _), else one symbol."""
    marks = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)).startswith("M"))
    word = f"[\\w{re.escape(marks)}\u200c\u200d]"
    return re.compile(
        rf"(?:https?://[^\s]+|www\.[^\s]+)|[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{{2,}}|@[a-z0-9_]+|{word}+(?:[-_]{word}+)*|\S",
        re.IGNORECASE,
    )


MAX_WINDOW_WORDS = 384
# Beyond this many entity candidates, a request's decoding runs in a worker thread; beyond the
# second, a 400 that says what to change (a low threshold with many types on long texts).
OFF_LOOP_CANDIDATES = 4096
MAX_CANDIDATES = 262_144


@dataclass(frozen=True)
class TaskMarks:
    kind: str  # "structures", "entities", "relations" or "classifications"
    markers: np.ndarray  # [1 + fields] positions of [P] and each field's marker
    thresholds: np.ndarray | None = None  # structures: each field's threshold (float32)


@dataclass(frozen=True)
class Gliner2Spec(ExtractSpec):
    tasks: tuple[TaskMarks, ...] = ()
    prefix: int = 0  # word_tokens starts with this many prefix words (the choices), then the text's


@dataclass(frozen=True)
class _Window:
    first: int  # the text's word the window starts at
    owned: tuple[int, int]  # the text's words whose entities this window answers for
    starts: np.ndarray  # character offsets of the window's words
    ends: np.ndarray
    limit: int  # where the window's text ends: an end past it is cut there, a start at it is no span


@dataclass
class _Text:
    text: str
    windows: list[_Window] = field(default_factory=list)


def split_words(text: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    (
        """GLiNER2's words of `text` (lower-cased, a "." appended when the text does not end in
    sentence punctuation) and their character offsets into `text` + that "."""
        ""
    )
    if not text.endswith((".", "!", "?")):
        text = text + "."
    words, starts, ends = [], [], []
    for match in _word_pattern().finditer(text):
        words.append(match.group().lower())
        starts.append(match.start())
        ends.append(match.end())
    return words, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


@dataclass
class Gliner2Plan(ExtractPlan):
    schema: Schema | None = None
    read: list[_Text] = field(default_factory=list)  # per text: its words' offsets and windows


class Gliner2Task:
    verb = "extract"
    options = frozenset({"schema"})

    def plan(self, card: ModelCard, call: ExtractCall) -> Gliner2Plan:
        plan = plan_extract(card, call, "gliner2", self.options, labels_required=False, default_threshold=0.5)
        schema = parse_schema(plan.labels, call.schema)
        return Gliner2Plan(**{f.name: getattr(plan, f.name) for f in fields(plan)}, schema=schema)

    async def tokenize(self, plan: Gliner2Plan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        model.head(Gliner2Prompt)  # a 502 naming the model when its folder gave no GLiNER2 head
        schema = plan.schema
        assert schema is not None
        tok, threshold = model.text, plan.threshold
        assert threshold is not None
        prompts = schema.prompts()
        # The prompt's ids and where each task's markers are in it, once per request.
        prompt_ids: list[int] = []
        tasks = []
        for index, (kind, words) in enumerate(prompts):
            if index:
                prompt_ids += tok.plain_ids(SEP_STRUCT)
            firsts = []
            for word in words:
                firsts.append(len(prompt_ids))
                prompt_ids += tok.plain_ids(word)
            tasks.append(TaskMarks(kind, np.asarray([firsts[w] for w in marker_words(words)])))
        structures = iter(schema.structures)
        tasks = [
            TaskMarks(
                t.kind,
                t.markers,
                np.asarray(
                    [threshold if f.threshold is None else f.threshold for f in next(structures).fields], np.float32
                ),
            )
            if t.kind == "structures"
            else t
            for t in tasks
        ]
        prompt_ids += tok.plain_ids(SEP_TEXT)
        prefix_firsts = []  # the choices' words, after [SEP_TEXT] and before the text
        for word in schema.prefix_words():
            prefix_firsts.append(len(prompt_ids))
            prompt_ids += tok.plain_ids(word)
        room = tok.max_length - len(prompt_ids)
        if room < MIN_TEXT_TOKENS:
            raise InvalidRequest(
                f"the schema takes {len(prompt_ids)} of the model's {tok.max_length} tokens, leaving too little "
                "for the text: send fewer or shorter labels, descriptions, examples or choices",
                details={"option": "schema", "prompt_tokens": len(prompt_ids)},
            )
        overlap = plan.card.extract.window_overlap_words if plan.card.extract else 64
        max_words = (plan.card.extract.max_words if plan.card.extract else None) or MAX_WINDOW_WORDS

        def windows_of(chunk: list[str], start: int) -> list:
            out = []
            for text in chunk:
                words, starts, ends = split_words(text)
                ids = [tok.plain_ids(w)[:room] for w in words]
                counts = np.asarray([len(i) for i in ids], dtype=np.int64)
                spans = word_windows(counts, room, max_words, overlap) if words else []
                seqs, windows = [], []
                for a, b in spans:
                    seq, firsts = list(prompt_ids), []
                    for word in ids[a:b]:
                        firsts.append(len(seq))
                        seq += word
                    # The last window ends with the text (and its appended "."), another with its last word.
                    limit = len(text) if b == len(words) else int(ends[b - 1])
                    word_tokens = np.minimum(np.asarray(prefix_firsts + firsts, dtype=np.int64), len(seq) - 1)
                    seqs.append((Encoded(np.asarray(seq, dtype=np.int64)), word_tokens))
                    windows.append((a, starts[a:b], ends[a:b], limit))
                out.append((text, spans, seqs, windows))
            return out

        per_text = await pool.map(windows_of, plan.texts)
        seqs: list[Encoded] = []
        for index, (text, spans, encoded, windows) in enumerate(per_text):
            info = _Text(text)
            plan.read.append(info)
            for (seq, word_tokens), (a, w_starts, w_ends, limit), own in zip(
                encoded, windows, owned_starts(spans) if spans else []
            ):
                seqs.append(seq)
                plan.owners.append(index)
                info.windows.append(_Window(a, own, w_starts, w_ends, limit))
                plan.specs.append(
                    Gliner2Spec(
                        ("gliner2",),
                        word_tokens=word_tokens,
                        threshold=threshold,
                        owned=(own[0] - a, own[1] - a),
                        tasks=tuple(tasks),
                        prefix=len(prefix_firsts),
                    )
                )
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return plan.specs

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # entities are bounded by the text's words, labels and relations by the schema

    def collect_off_loop(self, plan: Gliner2Plan, outputs: list) -> bool:
        return _num_candidates(plan, outputs) > OFF_LOOP_CANDIDATES

    def collect(self, plan: Gliner2Plan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        schema, texts = plan.schema, plan.read
        assert schema is not None
        candidates = _num_candidates(plan, outputs)
        if candidates > MAX_CANDIDATES:
            raise InvalidRequest(
                f"{candidates} candidate spans score at or above threshold {plan.threshold}, more than one "
                f"request may decode ({MAX_CANDIDATES}): raise the threshold, or send fewer entity types "
                "or shorter texts",
                details={"option": "threshold", "candidates": candidates},
            )
        kinds = [kind for kind, _ in schema.prompts()]
        per_text: list[list] = [[] for _ in texts]
        for owner, out in zip(plan.owners, outputs):
            per_text[owner].append(out)
        windows = windows_per_text(plan)
        items = []
        for index, info in enumerate(texts):
            outs = per_text[index]
            entities = _entities(schema, kinds, info, outs) if schema.entity_types else None
            classes = None
            if schema.classifications:
                at = [i for i, kind in enumerate(kinds) if kind == "classifications"]
                classes = {
                    task.task: merge_labels(task, [classify(task, out[i]) for out in outs])
                    for task, i in zip(schema.classifications, at)
                }
            relations = None
            if schema.relations:
                at = [i for i, kind in enumerate(kinds) if kind == "relations"]
                relations = {
                    r.name: merge_relations(
                        [
                            window_relations(info.text, w.starts, w.ends, w.limit, out[i])
                            for w, out in zip(info.windows, outs)
                        ]
                    )
                    for r, i in zip(schema.relations, at)
                }
            structures = None
            if schema.structures:
                structures = _structures(schema, kinds, info, outs, plan)
            labels = next(iter(classes.values())) if classes and len(classes) == 1 else None
            items.append(
                ExtractedItem(
                    entities=entities,
                    labels=labels,
                    classifications=classes,
                    relations=relations,
                    structures=structures,
                    num_windows=int(windows[index]),
                )
            )
        return ExtractResult(
            items=items, num_tokens=sum(len(s) for s in seqs), request_id=plan.call.request_id, **timings
        )


def _num_candidates(plan: Gliner2Plan, outputs: list) -> int:
    """The spans the request's entity and structure tasks found at or above their thresholds."""
    if plan.schema is None:
        return 0
    at = [i for i, (kind, _) in enumerate(plan.schema.prompts()) if kind in ("entities", "structures")]
    return sum(len(out[i][0]) for out in outputs for i in at)


def _structures(
    schema: Schema, kinds: list[str], info: _Text, outs: list, plan: Gliner2Plan
) -> dict[str, list[Record]]:
    at = [i for i, kind in enumerate(kinds) if kind == "structures"]
    prefix = schema.prefix_words()
    spec = plan.specs[0]
    assert isinstance(spec, Gliner2Spec)
    out = {}
    for structure, i in zip(schema.structures, at):
        thresholds = spec.tasks[i].thresholds
        assert thresholds is not None
        per_window = [
            window_records(structure, thresholds, prefix, info.text, w.starts, w.ends, w.limit, o[i])
            for w, o in zip(info.windows, outs)
        ]
        out[structure.name] = merge_records(per_window)
    return out


def _entities(schema: Schema, kinds: list[str], info: _Text, outs: list) -> list[Entity]:
    """Each window's candidates of the entities task, from the window that owns their start, then
    per type highest first, kept unless overlapping one kept before (in characters)."""
    task = kinds.index("entities")
    parts = []
    for window, out in zip(info.windows, outs):
        s, k, m, p = out[task]
        s = s.astype(np.int64)
        lo, hi = window.owned
        keep = (s + window.first >= lo) & (s + window.first < hi)
        s, k, m, p = s[keep], k[keep], m[keep], p[keep]
        # (first word, width, type, score, characters from, to, the window's end)
        parts.append((s + window.first, k, m, p, window.starts[s], window.ends[s + k], np.full(len(s), window.limit)))
    if not parts:
        return []
    s, k, m, p, a_of, b_of, limit_of = (np.concatenate(column) for column in zip(*parts))
    order = np.lexsort((k, s))  # (start, width), the order of the reference's candidates
    m, p, a_of, b_of, limit_of = m[order], p[order], a_of[order], b_of[order], limit_of[order]
    found: list[tuple[int, int, int, float]] = []
    for label in range(len(schema.entity_types)):
        mine = np.nonzero(m == label)[0]
        kept: list[tuple[int, int]] = []
        for j in sorted(mine.tolist(), key=lambda j: -float(p[j])):  # stable: ties keep candidate order
            a, b, limit = int(a_of[j]), int(b_of[j]), int(limit_of[j])
            if any(a < e and c < b for c, e in kept):
                continue
            kept.append((a, b))
            if a < limit:  # not the appended "." alone
                found.append((a, min(b, limit), label, float(p[j])))
    found.sort(key=lambda e: (e[0], e[1], e[2]))
    return [
        Entity(text=info.text[a:b], label=schema.entity_types[label], score=score, start=a, end=b)
        for a, b, label, score in found
    ]
