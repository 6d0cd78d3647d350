"""GLiNER2 decoding, per window and merged across a long text's windows: relations (see
extract_gliner2), classification labels, and structures' records.

A structure's task predicts how many records (instances) the text holds; per record and field:

- a field without choices: the spans starting in the text whose score reaches the field's
  threshold, best first, each kept unless its characters overlap one kept before; dtype "list"
  keeps them all, "str" the best one (None when there is none). A span that is the "." appended to
  the text alone is not a value (the package would report it past the text's end); an end in it
  is cut at the text's end.
- a field with choices: each choice's score is the one-word score of the first prefix word that
  equals it (case aside) in the words before the text; "list" keeps every choice at or above the
  threshold in the order of the choices, "str" the best-scoring one (the first on a tie) if it
  reaches the threshold, else None.

A record with no value (every field None or []) is left out. A text read in several windows keeps
each window's records, in order of first finding, a record found again (the same values, scores
aside) once, at the finding with the higher best score (the package's `batch_extract_long`).
"""

from __future__ import annotations

import numpy as np

from ...calls import FieldValue, LabelScore, Record, Relation, RelationSpan
from .gliner2_schema import Classification, Structure


def window_records(
    structure: Structure,
    thresholds: np.ndarray,
    prefix_words: list[str],
    text: str,
    starts: np.ndarray,
    ends: np.ndarray,
    limit: int,
    found: tuple[np.ndarray, ...],
) -> list[Record]:
    """The records of one window: `found` is the head's (instance, field, start, width, score) of
    each span reaching its field's threshold and `[n, M, P]` the prefix words' scores; `starts`
    and `ends` the character offsets of the window's words, `limit` where its text ends."""
    inst, fld, s, k, p, prefix = found
    order = np.lexsort((k, s))  # (start, width): the order the package finds them in
    inst, fld, s, k, p = inst[order], fld[order], s[order], k[order], p[order]
    lowered = [w.lower() for w in prefix_words]
    records = []
    for n in range(prefix.shape[0]):
        record: Record = {}
        for j, f in enumerate(structure.fields):
            threshold = float(thresholds[j])
            if f.choices:
                scores = [_choice_score(prefix[n, j], lowered, choice) for choice in f.choices]
                if f.dtype == "list":
                    record[f.name] = [
                        FieldValue(c, score)
                        for c, score in zip(f.choices, scores)
                        if score is not None and score >= threshold
                    ]
                else:
                    best, best_score = None, -1.0
                    for c, score in zip(f.choices, scores):
                        if score is not None and score > best_score:
                            best, best_score = c, score
                    record[f.name] = FieldValue(best, best_score) if best and best_score >= threshold else None
                continue
            mine = np.nonzero((inst == n) & (fld == j))[0]
            kept: list[tuple[int, int, float]] = []
            for i in sorted(mine.tolist(), key=lambda i: -float(p[i])):  # stable: ties keep (start, width) order
                a, b = int(starts[s[i]]), int(ends[s[i] + k[i]])
                if not any(a < e and c < b for c, e, _ in kept):
                    kept.append((a, b, float(p[i])))
                    if f.dtype == "str":
                        break
            values = [FieldValue(text[a : min(b, limit)], score, a, min(b, limit)) for a, b, score in kept if a < limit]
            record[f.name] = values if f.dtype == "list" else (values[0] if values else None)
        if any(v is not None and v != [] for v in record.values()):
            records.append(record)
    return records


def _choice_score(scores: np.ndarray, lowered: list[str], choice: str) -> float | None:
    try:
        return float(scores[lowered.index(choice.lower())])
    except ValueError:  # not among the prefix words (cannot happen for a choice of the schema)
        return None


def merge_records(per_window: list[list[Record]]) -> list[Record]:
    """A structure's records from every window, each distinct record once (see the module's doc).
    A text read in one window keeps its records as they are."""
    if len(per_window) == 1:
        return per_window[0]
    merged: dict[tuple, Record] = {}
    for records in per_window:
        for record in records:
            key = _key(record)
            kept = merged.get(key)
            if kept is None or _best_score(record) > _best_score(kept):
                merged[key] = record
    return list(merged.values())


def _value_key(v: FieldValue) -> tuple:
    return ("choice", v.text) if v.start is None else ("span", v.start, v.end)


def _key(record: Record) -> tuple:
    return tuple(
        (name, None if v is None else tuple(map(_value_key, v)) if isinstance(v, list) else _value_key(v))
        for name, v in sorted(record.items())
    )


def _best_score(record: Record) -> float:
    scores = [x.score for v in record.values() if v is not None for x in (v if isinstance(v, list) else [v])]
    return max(scores, default=0.0)


def window_relations(
    text: str, starts: np.ndarray, ends: np.ndarray, limit: int, best: tuple[np.ndarray, ...]
) -> list[Relation]:
    """A relation type's instances in one window: those whose head and tail spans (`[count, 2]`
    start, width, score over the window's words; score -1 when none reaches the threshold) are
    both found in the text."""
    firsts, widths, scores = best
    out = []
    for instance in range(len(scores)):
        spans = []
        for f in range(2):  # head, tail
            s, score = int(firsts[instance, f]), float(scores[instance, f])
            if score < 0:  # no span reaches the threshold
                break
            a, b = int(starts[s]), int(ends[s + int(widths[instance, f])])
            if a >= limit:  # the appended "." alone
                break
            b = min(b, limit)
            spans.append(RelationSpan(text=text[a:b], score=score, start=a, end=b))
        if len(spans) == 2:
            out.append(Relation(head=spans[0], tail=spans[1]))
    return out


def merge_relations(per_window: list[list[Relation]]) -> list[Relation]:
    """One relation type's instances from every window, in order of first finding: an instance
    found again (the same head and tail spans) is kept once, with the scores of the finding whose
    better end scored higher. A text read in one window keeps its instances as they are (the
    package's `extract`; only its long-text path merges)."""
    if len(per_window) == 1:
        return per_window[0]
    merged: dict[tuple[int, int, int, int], Relation] = {}
    for relations in per_window:
        for r in relations:
            key = (r.head.start, r.head.end, r.tail.start, r.tail.end)
            kept = merged.get(key)
            if kept is None or max(r.head.score, r.tail.score) > max(kept.head.score, kept.tail.score):
                merged[key] = r
    return list(merged.values())


def merge_labels(task: Classification, per_window: list[list[LabelScore]]) -> list[LabelScore]:
    """A classification task's labels from every window: single-label, the best-scoring window's
    label (the first on a tie); multi-label, each label once, in order of first finding, at its
    higher score."""
    if len(per_window) <= 1:
        return per_window[0] if per_window else []
    if not task.multi_label:
        return max(per_window, key=lambda labels: labels[0].score)
    merged: dict[str, LabelScore] = {}
    for labels in per_window:
        for ls in labels:
            if ls.label not in merged or ls.score > merged[ls.label].score:
                merged[ls.label] = ls
    return list(merged.values())


def classify(task: Classification, logits: np.ndarray) -> list[LabelScore]:
    x = logits.astype(np.float64)
    if task.sigmoid:
        probs = 1.0 / (1.0 + np.exp(-x))
    else:
        e = np.exp(x - x.max())
        probs = e / e.sum()
    best = int(np.argmax(probs))
    if not task.multi_label:
        return [LabelScore(task.labels[best], float(probs[best]))]
    chosen = [LabelScore(label, float(probs[j])) for j, label in enumerate(task.labels) if probs[j] >= task.threshold]
    if not chosen:
        chosen = [LabelScore(task.labels[best], float(probs[best]))]
    if task.top_k is not None:
        chosen = sorted(chosen, key=lambda ls: -ls.score)[: task.top_k]
    return chosen
