"""extract, kind gliner: entities of the requested labels (zero-shot span NER).

The label prompt ([ENT] label ... [SEP]) is built once per request; each text is split into words
and read in word windows that fit next to it; the head returns candidate spans per window, which
are merged (each span read in the window where it has the most context) and decoded greedily,
flat or nested.
"""

from __future__ import annotations

import numpy as np

from ...calls import Entity, ExtractCall, ExtractResult
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...head_info import GlinerPrompt
from ...spans import decode_spans, owned_starts, split_words, word_windows
from ...verbs import MIN_TEXT_TOKENS
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, ExtractSpec, PhaseSeconds
from .extract_common import ExtractPlan, plan_extract, result, windows_per_text

# Beyond this many candidates, a request's decoding runs in a worker thread, not on the event loop.
OFF_LOOP_CANDIDATES = 4096
# Span candidates one request may decode (a low threshold with many labels on long texts makes
# millions): beyond it, a 400 that says what to change.
MAX_CANDIDATES = 262_144


class GlinerTask:
    verb = "extract"
    options = frozenset({"max_span_width", "flat_ner", "multi_label"})

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        assert card.extract is not None
        plan = plan_extract(
            card,
            call,
            "gliner",
            self.options,
            labels_required=True,
            fold_labels=card.extract.lowercase_labels,
            default_threshold=0.5,
        )
        if call.max_span_width is not None and (not isinstance(call.max_span_width, int) or call.max_span_width < 1):
            raise InvalidRequest(
                f"max_span_width must be an integer >= 1, not {call.max_span_width!r}",
                details={"option": "max_span_width"},
            )
        return plan

    async def tokenize(self, plan: ExtractPlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        head, tok, ex, call = model.head(GlinerPrompt), model.text, plan.card.extract, plan.call
        threshold = plan.threshold
        assert threshold is not None  # the gliner plan defaults it
        assert ex is not None
        if call.max_span_width is not None and call.max_span_width > head.max_width:
            raise InvalidRequest(
                f"max_span_width {call.max_span_width} is wider than the model's spans ({head.max_width} words)",
                details={"option": "max_span_width", "max": head.max_width},
            )
        labels = [label.lower() for label in plan.labels] if ex.lowercase_labels else plan.labels
        for index, label in enumerate(labels):
            if label.strip() in (head.ent_token, head.sep_token, "[FLERT]"):
                raise InvalidRequest(
                    f"labels[{index}] {label!r} is one of the model's prompt tokens; name an entity type",
                    details={"option": "labels", "index": index},
                )
        prompt = [w for label in labels for w in (head.ent_token, label)] + [head.sep_token]
        prompt_tokens = int(tok.word_token_counts(prompt).sum())
        room = tok.max_length - 2 - prompt_tokens
        if room < MIN_TEXT_TOKENS:
            raise InvalidRequest(
                f"the {len(labels)} labels take {prompt_tokens} of the model's {tok.max_length} "
                "tokens, leaving too little for the text: send fewer or shorter labels",
                details={"option": "labels", "prompt_tokens": prompt_tokens},
            )
        max_words = ex.max_words or head.max_words
        skip = 0 if head.embed_ent_token else 1  # the label's own first token instead of [ENT]
        last = head.last_subtoken

        def windows_of(chunk: list[str], start: int) -> list:
            out = []
            for text in chunk:
                words, starts, ends = split_words(text)
                counts = tok.word_token_counts(words)
                spans = (
                    word_windows(np.minimum(counts, room), room, max_words, ex.window_overlap_words) if words else []
                )
                seqs = tok.encode_words([prompt + words[a:b] for a, b in spans]) if spans else []
                read = [
                    _window(seq, b - a, len(prompt), room if counts[a:b].max() > room else None, last)
                    for seq, (a, b) in zip(seqs, spans)
                ]
                out.append(
                    (
                        (starts, ends, counts == 0),
                        list(zip(read, [a for a, _ in spans], owned_starts(spans) if spans else [])),
                    )
                )
            return out

        per_text = await pool.map(windows_of, plan.texts)
        seqs, width = [], min(head.max_width, call.max_span_width or head.max_width)
        for index, (bounds, windows) in enumerate(per_text):
            plan.per_text.append(bounds)
            for (seq, word_tokens, prompt_positions), first_word, own in windows:
                seqs.append(seq)
                plan.owners.append(index)
                plan.windows.append((first_word, own))
                plan.specs.append(
                    ExtractSpec(
                        ("entities",),
                        word_tokens=word_tokens,
                        prompt_tokens=prompt_positions + skip,
                        threshold=threshold,
                        max_width=width,
                        owned=(own[0] - first_word, own[1] - first_word),
                    )
                )
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list[Encoded]) -> list[ExtractSpec]:
        return plan.specs

    def check_size(self, plan: ExtractPlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # entities are bounded by the text's words

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        """Many span candidates (a low threshold, many labels, long texts): decode in a thread."""
        return sum(len(out[0]) for out in outputs) > OFF_LOOP_CANDIDATES

    def collect(self, plan: ExtractPlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ExtractResult:
        return result(plan, seqs, self._items(plan, outputs), windows_per_text(plan), timings)

    def _items(self, plan: ExtractPlan, outputs: list) -> list[tuple]:
        call, n = plan.call, len(plan.texts)
        candidates = sum(len(out[0]) for out in outputs)
        if candidates > MAX_CANDIDATES:
            raise InvalidRequest(
                f"{candidates} candidate spans score above threshold {plan.threshold}, more than one "
                f"request may decode ({MAX_CANDIDATES}): raise the threshold, or send fewer labels "
                "or shorter texts",
                details={"option": "threshold", "candidates": candidates},
            )
        merge = plan.card.extract is not None and plan.card.extract.merge_adjacent
        found: list[list] = [[] for _ in range(n)]
        for owner, (first_word, (lo, hi)), (s, k, c, p) in zip(plan.owners, plan.windows, outputs):
            s = s.astype(np.int64) + first_word
            keep = (s >= lo) & (s < hi)  # each span from the window that owns its start
            found[owner].append((s[keep], k[keep], c[keep], p[keep]))
        items = []
        for index, parts in enumerate(found):
            starts, ends, dropped = plan.per_text[index]
            text = plan.texts[index]
            entities: list[Entity] = []
            if parts:
                s, k, c, p = (np.concatenate(column) for column in zip(*parts))
                if dropped.any():  # no span starts or ends on a word the tokenizer drops (a lone accent, ZWSP)
                    keep = ~(dropped[s] | dropped[s + k])
                    s, k, c, p = s[keep], k[keep], c[keep], p[keep]
                for start, end, label, score in decode_spans(
                    s, k, c, p, call.flat_ner is not False, bool(call.multi_label)
                ):
                    a, b = int(starts[start]), int(ends[end])
                    if (
                        merge
                        and entities
                        and entities[-1].label == plan.labels[label]
                        and 0 <= a - entities[-1].end <= 1
                    ):
                        first = entities.pop()
                        a, score = first.start, first.score
                    entities.append(Entity(text=text[a:b], label=plan.labels[label], score=score, start=a, end=b))
            items.append((entities, None))
        return items


def _window(seq: Encoded, num_words: int, num_prompt_words: int, cap: int | None, last: bool) -> tuple:
    """A GLiNER window's sequence, the position of each of its words' first (`last`: last) token,
    and of each label's [ENT] token. With `cap`, a word longer than the whole room keeps its first
    `cap` tokens. A word the tokenizer drops entirely reads the closing special token."""
    ids, word_ids = seq.ids, seq.word_ids
    assert word_ids is not None  # encode_words gives word ids
    if cap is not None:
        rank = np.zeros(len(ids), dtype=np.int64)
        for i in range(1, len(ids)):
            rank[i] = rank[i - 1] + 1 if word_ids[i] == word_ids[i - 1] and word_ids[i] >= 0 else 0
        keep = (word_ids < num_prompt_words) | (rank < cap)
        ids, word_ids = ids[keep], word_ids[keep]
    positions: dict[int, int] = {}
    for pos, w in enumerate(word_ids.tolist()):
        if w >= 0 and (last or w not in positions):
            positions[w] = pos
    word_tokens = np.full(num_words, len(ids) - 1, dtype=np.int64)
    for w, pos in positions.items():
        if w >= num_prompt_words:
            word_tokens[w - num_prompt_words] = pos
    first: dict[int, int] = {}
    for pos, w in enumerate(word_ids.tolist()):
        first.setdefault(w, pos)
    prompt_positions = np.asarray([first[w] for w in range(0, num_prompt_words - 1, 2)], dtype=np.int64)
    return Encoded(np.asarray(ids, dtype=np.int64)), word_tokens, prompt_positions
