"""Token predictions -> entity spans (NER), numpy only, as transformers' `TokenClassificationPipeline`
computes them with `aggregation_strategy` simple / first / max / average.

    logits [n, labels] --softmax--> per-token scores; special tokens (word id -1) skipped
    simple:               each token is an entity: its argmax label and that label's probability
    first / max / average: tokens of one word (consecutive tokens sharing a word id) become one
                           entity: the first token's argmax, the argmax of the token with the
                           highest probability, or the argmax of the mean distribution
    grouping:             adjacent entities merge while their tags match and the next is not a
                          `B-` tag (a tag without a `B-`/`I-` prefix counts as `I-`); a group is
                          named by its first label after the first `-`; `O` groups are dropped;
                          a group's score is the mean of its entities' scores

Spans are character offsets into the text, and each entity's `text` is `text[start:end]` (the
pipeline's `word` is its tokens joined back, lowercased for uncased vocabularies). Words come from
the tokenizer's word ids; the pipeline instead derives them from token strings (exact for
WordPiece, a whitespace heuristic for byte-level BPE and SentencePiece, where punctuation glued to
a word joins it).
"""

from __future__ import annotations

import re

import numpy as np

STRATEGIES = ("simple", "first", "max", "average")


def aggregate_entities(
    logits: np.ndarray, id2label: dict[int, str], offsets: np.ndarray, word_ids: np.ndarray, text: str, strategy: str
) -> list[dict]:
    """Entity spans `{text, label, score, start, end}` in order, from one sequence's token logits
    `[n, labels]`, its character `offsets` `[n, 2]` into `text` and `word_ids` `[n]` (-1: special)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"aggregation strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    logits = np.asarray(logits, dtype=np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = shifted / shifted.sum(axis=-1, keepdims=True)  # [n, labels]
    kept = [i for i in range(len(probs)) if int(word_ids[i]) >= 0]
    if strategy == "simple":
        units = [[i] for i in kept]
    else:
        units = _words(kept, word_ids)
    # One (label, score, start, end) per token (simple) or per word.
    entities = [
        (*_pick(probs[unit], strategy, id2label), int(offsets[unit[0]][0]), int(offsets[unit[-1]][1])) for unit in units
    ]
    return [g for g in (_group(run, text) for run in _runs(entities)) if g["label"] != "O"]


def _words(kept: list[int], word_ids: np.ndarray) -> list[list[int]]:
    """Consecutive kept tokens with one word id, as lists of token indices."""
    words: list[list[int]] = []
    for i in kept:
        if words and int(word_ids[i]) == int(word_ids[words[-1][-1]]):
            words[-1].append(i)
        else:
            words.append([i])
    return words


def _pick(probs: np.ndarray, strategy: str, id2label: dict[int, str]) -> tuple[str, float]:
    """The label and score of one token or word from its tokens' distributions `[k, labels]`."""
    if strategy in ("simple", "first"):
        row = probs[0]
    elif strategy == "max":
        row = probs[int(np.argmax(probs.max(axis=-1)))]  # the first token holding the highest probability
    else:
        row = np.nanmean(probs, axis=0)
    index = int(np.argmax(row))
    return id2label[index], float(row[index])


def _tag(label: str) -> tuple[str, str]:
    """(B or I, tag): a label without a `B-`/`I-` prefix continues like an `I-` tag."""
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def _runs(entities: list[tuple]) -> list[list[tuple]]:
    """Adjacent entities with the same tag, each run started by a `B-` tag or a change of tag."""
    runs: list[list[tuple]] = []
    for entity in entities:
        if runs:
            bi, tag = _tag(entity[0])
            if bi != "B" and tag == _tag(runs[-1][-1][0])[1]:
                runs[-1].append(entity)
                continue
        runs.append([entity])
    return runs


def _group(run: list[tuple], text: str) -> dict:
    start, end = run[0][2], run[-1][3]
    return {
        "text": text[start:end],
        "label": run[0][0].split("-", 1)[-1],
        "score": float(np.nanmean([e[1] for e in run])),
        "start": start,
        "end": end,
    }


# --- GLiNER: words, windows and span decoding -------------------------------------------------

# GLiNER's whitespace word splitter: runs of word characters (joined by - or _), else one symbol.
_WORD = re.compile(r"\w+(?:[-_]\w+)*|\S")


def split_words(text: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The words of `text` and their character starts and ends `[w]` (as GLiNER splits them)."""
    words, starts, ends = [], [], []
    for match in _WORD.finditer(text):
        words.append(match.group())
        starts.append(match.start())
        ends.append(match.end())
    return words, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def word_windows(token_counts: np.ndarray, room: int, max_words: int, overlap: int) -> list[tuple[int, int]]:
    """Half-open word ranges `[start, end)` that cover every word: each at most `max_words` words
    whose `token_counts` sum to at most `room` (a word alone always fits: its tokens are capped to
    the room by the caller), consecutive ones sharing up to `overlap` words (at most half the
    earlier window, and always moving on by at least one word)."""
    n = len(token_counts)
    windows: list[tuple[int, int]] = []
    start = 0
    while start < n:
        end, used = start, 0
        while end < n and end - start < max_words and (end == start or used + int(token_counts[end]) <= room):
            used += int(token_counts[end])
            end += 1
        if windows and end <= windows[-1][1]:  # no word the last window lacked (a long word next):
            start = windows[-1][1]  # begin at it instead of re-reading the overlap
            continue
        windows.append((start, end))
        if end >= n:
            break
        start = max(start + 1, end - min(overlap, (end - start) // 2))
    return windows


def owned_starts(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each window, the span starts it answers for: overlaps are split at their middle, so a
    span is read in the window where it has the most context on both sides."""
    cuts = [windows[0][0]] + [(b[0] + a[1]) // 2 for a, b in zip(windows, windows[1:])] + [windows[-1][1]]
    return list(zip(cuts, cuts[1:]))


def decode_spans(
    starts: np.ndarray, widths: np.ndarray, classes: np.ndarray, scores: np.ndarray, flat_ner: bool, multi_label: bool
) -> list[tuple[int, int, int, float]]:
    """GLiNER's greedy decoding of candidate spans (all above the threshold, in the order
    (start, width, class) of the score tensor): highest score first, a span is kept unless it
    clashes with one already kept; the kept ones are returned as (start, end, class, score) in order
    of start, `end` inclusive.

    Clash: the same (start, end) unless `multi_label`; otherwise, when `flat_ner`, any overlap;
    when nested, an overlap where neither span contains the other.
    """
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")  # ties keep tensor order
    widest = int(np.max(widths)) + 1 if len(widths) else 1
    kept: list[tuple[int, int, int, float]] = []
    # Flat: kept spans never overlap (but for one span's several labels), so the span holding each
    # word decides a clash in O(width). Nested: a kept span that overlaps (s, e) starts at most
    # `widest` words before it, so kept spans indexed by start decide in O(width^2).
    holder: dict[int, tuple[int, int]] = {}
    ends_at: dict[int, set[int]] = {}
    for i in order.tolist():
        s, e = int(starts[i]), int(starts[i]) + int(widths[i])
        if flat_ner:
            clash = any(
                (held := holder.get(w)) is not None and (held != (s, e) or not multi_label) for w in range(s, e + 1)
            )
        else:
            clash = any(
                _clash(s, e, ks, ke, multi_label) for ks in range(s - widest + 1, e + 1) for ke in ends_at.get(ks, ())
            )
        if not clash:
            kept.append((s, e, int(classes[i]), float(scores[i])))
            if flat_ner:
                holder.update((w, (s, e)) for w in range(s, e + 1))
            else:
                ends_at.setdefault(s, set()).add(e)
    kept.sort(key=lambda span: span[0])
    return kept


def _clash(s: int, e: int, ks: int, ke: int, multi_label: bool) -> bool:
    """Nested decoding: the same span (unless multi-label), or a partial overlap."""
    if (s, e) == (ks, ke):
        return not multi_label
    overlap = not (s > ke or ks > e)
    nested = (s <= ks and e >= ke) or (ks <= s and ke >= e)
    return overlap and not nested
