"""extract: entities or labels from each text. How depends on the card's `extract.kind`:

    gliner       the label prompt ([ENT] label ... [SEP]) is built once per request; each text is
                 split into words and read in word windows that fit next to it; the head returns
                 candidate spans per window, which are merged (each span read in the window where
                 it has the most context) and decoded greedily, flat or nested
    token_class  each text as one sequence of tokens, or windows of max_length tokens sharing an
                 overlap; every token keeps the logits of the window it sits most inside, and the
                 whole text's tokens are aggregated into entities
    zero_shot    one (text, hypothesis) pair per label, the text cut to fit; entailment logits
                 softmaxed across labels, or against contradiction per label (multi-label)

Nothing is cut silently: a zero-shot text that did not fit says `truncated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...calls import Entity, ExtractCall, ExtractedItem, ExtractResult, LabelScore
from ...catalog import ModelCard
from ...errors import InvalidRequest
from ...spans import STRATEGIES, aggregate_entities, decode_spans, owned_starts, split_words, word_windows
from ..tokenizer import Encoded
from ..types import ExtractSpec
from .encode import check_texts, estimate_tokens

MAX_LABELS = 100
MAX_LABEL_CHARS = 200
# A GLiNER window keeps at least this many tokens for text next to the label prompt.
MIN_TEXT_TOKENS = 16
# Beyond these, a request's decoding runs in a worker thread instead of on the event loop.
OFF_LOOP_CANDIDATES = 4096
OFF_LOOP_TOKENS = 16384
# Span candidates one request may decode (a low threshold with many labels on long texts makes
# millions): beyond it, a 400 that says what to change.
MAX_CANDIDATES = 262_144


@dataclass
class ExtractPlan:
    card: ModelCard
    call: ExtractCall
    kind: str
    labels: list[str]  # de-duplicated, in request order
    threshold: float | None
    estimated_tokens: int
    # Filled by tokenize, one entry per sequence: the text it reads and what collect needs of it
    # (gliner: first word, owned span starts; token_class: first token, owned tokens).
    owners: list[int] = field(default_factory=list)
    windows: list[tuple] = field(default_factory=list)
    # Per text: gliner (word starts, word ends, words without tokens); token_class (offsets, word
    # ids) of the whole text.
    texts: list[tuple] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)  # zero_shot: texts cut to fit
    gliner_specs: list[ExtractSpec] = field(default_factory=list)
    head: Any = None  # the model's head (token_class: its id2label; zero_shot: its label ids)

    @property
    def num_items(self) -> int:
        return len(self.call.texts)


class ExtractTask:
    verb = "extract"

    def plan(self, card: ModelCard, call: ExtractCall) -> ExtractPlan:
        if "extract" not in card.tasks or card.extract is None:
            raise InvalidRequest(f"model {card.id} does not extract; it serves: {', '.join(card.tasks)}",
                                 details={"model": card.id, "tasks": list(card.tasks)})
        kind = card.extract.kind
        if not call.texts:
            raise InvalidRequest("no items to extract from", details={"option": "items"})
        check_texts(call.texts, "items")
        labels = _labels(call.labels, required=kind != "token_class",
                         fold=card.extract.lowercase_labels and kind == "gliner")
        threshold = call.threshold if call.threshold is not None else card.extract.threshold
        if threshold is None and kind == "gliner":
            threshold = 0.5
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise InvalidRequest(f"threshold must be between 0 and 1, not {threshold!r}", details={"option": "threshold"})
        for option, kinds in (("max_span_width", ("gliner",)), ("hypothesis_template", ("zero_shot",)),
                              ("aggregation", ("token_class",)), ("flat_ner", ("gliner",)),
                              ("multi_label", ("gliner", "zero_shot"))):
            if getattr(call, option) is not None and kind not in kinds:
                raise InvalidRequest(f"{option} applies to {' and '.join(kinds)} models; model {card.id} is {kind}",
                                     details={"option": option})
        if call.max_span_width is not None and (not isinstance(call.max_span_width, int) or call.max_span_width < 1):
            raise InvalidRequest(f"max_span_width must be an integer >= 1, not {call.max_span_width!r}",
                                 details={"option": "max_span_width"})
        if call.aggregation is not None and call.aggregation not in STRATEGIES:
            raise InvalidRequest(f"aggregation must be one of {', '.join(STRATEGIES)}, not {call.aggregation!r}",
                                 details={"option": "aggregation"})
        if kind == "zero_shot":
            _hypotheses(call.hypothesis_template or card.extract.hypothesis_template, labels[:1])
        longest = card.max_length
        text_tokens = [len(t) // 4 + 2 for t in call.texts]
        if kind == "gliner":
            prompt = sum(estimate_tokens(label, longest) for label in labels) + 1
            room = max(MIN_TEXT_TOKENS, longest - prompt - 2)
            estimated = sum(t + -(-t // room) * prompt for t in text_tokens)
        elif kind == "zero_shot":
            estimated = sum(min(longest, t + 12) for t in text_tokens) * len(labels)
        else:
            estimated = sum(text_tokens)
        return ExtractPlan(card, call, kind, labels, threshold, estimated)

    async def tokenize(self, plan: ExtractPlan, runner, pool) -> list:
        if plan.kind == "gliner":
            return await self._gliner(plan, runner, pool)
        if plan.kind == "token_class":
            return await self._token_class(plan, runner, pool)
        return await self._zero_shot(plan, runner, pool)

    async def _gliner(self, plan: ExtractPlan, runner, pool) -> list:
        head, tok, ex, call = runner.heads["entities"], runner.tokenizer, plan.card.extract, plan.call
        if call.max_span_width is not None and call.max_span_width > head.max_width:
            raise InvalidRequest(f"max_span_width {call.max_span_width} is wider than the model's spans "
                                 f"({head.max_width} words)", details={"option": "max_span_width", "max": head.max_width})
        labels = [label.lower() for label in plan.labels] if ex.lowercase_labels else plan.labels
        for index, label in enumerate(labels):
            if label.strip() in (head.ent_token, head.sep_token, "[FLERT]"):
                raise InvalidRequest(f"labels[{index}] {label!r} is one of the model's prompt tokens; name an entity "
                                     "type", details={"option": "labels", "index": index})
        prompt = [w for label in labels for w in (head.ent_token, label)] + [head.sep_token]
        prompt_tokens = int(tok.word_token_counts(prompt).sum())
        room = tok.max_length - 2 - prompt_tokens
        if room < MIN_TEXT_TOKENS:
            raise InvalidRequest(f"the {len(labels)} labels take {prompt_tokens} of the model's {tok.max_length} "
                                 "tokens, leaving too little for the text: send fewer or shorter labels",
                                 details={"option": "labels", "prompt_tokens": prompt_tokens})
        max_words = ex.max_words or head.max_len
        skip = 0 if head.embed_ent_token else 1  # the label's own first token instead of [ENT]
        last = head.pooling == "last"

        def windows_of(chunk: list[str], start: int) -> list:
            out = []
            for text in chunk:
                words, starts, ends = split_words(text)
                counts = tok.word_token_counts(words)
                spans = word_windows(np.minimum(counts, room), room, max_words, ex.window_overlap_words) if words else []
                seqs = tok.encode_words([prompt + words[a:b] for a, b in spans]) if spans else []
                read = [_window(seq, b - a, len(prompt), room if counts[a:b].max() > room else None, last)
                        for seq, (a, b) in zip(seqs, spans)]
                out.append(((starts, ends, counts == 0),
                            list(zip(read, [a for a, _ in spans], owned_starts(spans) if spans else []))))
            return out

        per_text = await pool.map(windows_of, call.texts)
        seqs, width = [], min(head.max_width, call.max_span_width or head.max_width)
        for index, (bounds, windows) in enumerate(per_text):
            plan.texts.append(bounds)
            for (seq, word_tokens, prompt_positions), first_word, own in windows:
                seqs.append(seq)
                plan.owners.append(index)
                plan.windows.append((first_word, own))
                plan.gliner_specs.append(ExtractSpec(("entities",), word_tokens=word_tokens,
                                                     prompt_tokens=prompt_positions + skip, threshold=plan.threshold,
                                                     max_width=width, owned=(own[0] - first_word, own[1] - first_word)))
        return seqs

    async def _token_class(self, plan: ExtractPlan, runner, pool) -> list:
        head, tok, ex = runner.heads["token_logits"], runner.tokenizer, plan.card.extract
        plan.head = head
        if plan.labels:
            known = sorted({name.split("-", 1)[-1] for name in head.id2label.values() if name != "O"})
            unknown = [label for label in plan.labels if label not in known]
            if unknown:
                raise InvalidRequest(f"model {plan.card.id} does not tag {', '.join(map(repr, unknown))}; "
                                     f"its labels are {', '.join(known)}", details={"option": "labels", "known": known})

        def windows_of(chunk: list[str], start: int) -> list:
            out = []
            for text in chunk:
                whole, lead, trail = tok.encode_whole(text)
                inner = slice(lead, len(whole) - trail)
                n, size = inner.stop - lead, tok.max_length - lead - trail
                # Token windows as GLiNER's word windows, each token one "word" of one token; an
                # empty text is one window of its special tokens alone.
                spans = word_windows(np.ones(n, dtype=np.int64), size, size, ex.window_overlap_tokens) or [(0, 0)]
                ids = whole.ids
                seqs = [Encoded(np.concatenate([ids[:lead], ids[inner][a:b], ids[inner.stop:]])) for a, b in spans]
                out.append(((whole.offsets[inner], whole.word_ids[inner]),
                            list(zip(seqs, spans, owned_starts(spans))), lead))
            return out

        per_text = await pool.map(windows_of, plan.call.texts)
        seqs = []
        for index, (whole, windows, lead) in enumerate(per_text):
            plan.texts.append(whole)
            for seq, (a, _), own in windows:
                seqs.append(seq)
                plan.owners.append(index)
                plan.windows.append((a, own, lead))
        return seqs

    async def _zero_shot(self, plan: ExtractPlan, runner, pool) -> list:
        call, tok = plan.call, runner.tokenizer
        plan.head = runner.heads["nli"]
        hypotheses = _hypotheses(call.hypothesis_template or plan.card.extract.hypothesis_template, plan.labels)
        texts = [t for t in call.texts for _ in hypotheses]
        seqs = await pool.encode(tok, texts, True, pairs=hypotheses * len(call.texts), cut_first=True, what="items")
        k = len(hypotheses)
        plan.owners = [i for i in range(len(call.texts)) for _ in hypotheses]
        plan.truncated = [any(s.truncated for s in seqs[i * k:(i + 1) * k]) for i in range(len(call.texts))]
        return seqs

    def specs(self, plan: ExtractPlan, seqs: list) -> list:
        if plan.kind == "gliner":
            return plan.gliner_specs
        output = "token_logits" if plan.kind == "token_class" else "nli"
        return [ExtractSpec((output,))] * len(seqs)

    def check_size(self, plan: ExtractPlan, seqs: list, max_result_bytes: int) -> None:
        return None  # entities are bounded by the text's words; labels by the request's

    def collect_off_loop(self, plan: ExtractPlan, outputs: list) -> bool:
        """Whether decoding is heavy enough to run in a thread: many span candidates (a low
        threshold, many labels, long texts) or many tokens to aggregate."""
        if plan.kind == "gliner":
            return sum(len(out[0]) for out in outputs) > OFF_LOOP_CANDIDATES
        if plan.kind == "token_class":
            return sum(len(out) for out in outputs) > OFF_LOOP_TOKENS
        return False

    def collect(self, plan: ExtractPlan, seqs: list, outputs: list, timings: dict[str, float]) -> ExtractResult:
        n = len(plan.call.texts)
        if plan.kind == "zero_shot":  # one sequence per label, one reading of the text
            windows = np.ones(n, dtype=np.int64)
        else:  # 0: a text without words (GLiNER reads nothing)
            windows = np.bincount(np.asarray(plan.owners, dtype=np.int64), minlength=n)
        if plan.kind == "gliner":
            items = self._collect_gliner(plan, outputs)
        elif plan.kind == "token_class":
            items = self._collect_token_class(plan, outputs)
        else:
            items = self._collect_zero_shot(plan, outputs)
        truncated = plan.truncated or [False] * n  # only zero-shot cuts texts
        items = [ExtractedItem(entities=item[0], labels=item[1], num_windows=int(windows[i]),
                               truncated=truncated[i]) for i, item in enumerate(items)]
        return ExtractResult(items=items, num_tokens=sum(len(s) for s in seqs), request_id=plan.call.request_id,
                             **timings)

    def _collect_gliner(self, plan: ExtractPlan, outputs: list) -> list:
        call, n = plan.call, len(plan.call.texts)
        candidates = sum(len(out[0]) for out in outputs)
        if candidates > MAX_CANDIDATES:
            raise InvalidRequest(f"{candidates} candidate spans score above threshold {plan.threshold}, more than one "
                                 f"request may decode ({MAX_CANDIDATES}): raise the threshold, or send fewer labels "
                                 "or shorter texts", details={"option": "threshold", "candidates": candidates})
        merge = plan.card.extract.merge_adjacent
        found: list[list] = [[] for _ in range(n)]
        for owner, (first_word, (lo, hi)), (s, k, c, p) in zip(plan.owners, plan.windows, outputs):
            s = s.astype(np.int64) + first_word
            keep = (s >= lo) & (s < hi)  # each span from the window that owns its start
            found[owner].append((s[keep], k[keep], c[keep], p[keep]))
        items = []
        for index, parts in enumerate(found):
            starts, ends, dropped = plan.texts[index]
            text = call.texts[index]
            entities = []
            if parts:
                s, k, c, p = (np.concatenate(column) for column in zip(*parts))
                if dropped.any():  # no span starts or ends on a word the tokenizer drops (a lone accent, ZWSP)
                    keep = ~(dropped[s] | dropped[s + k])
                    s, k, c, p = s[keep], k[keep], c[keep], p[keep]
                for start, end, label, score in decode_spans(s, k, c, p, call.flat_ner is not False,
                                                                     bool(call.multi_label)):
                    a, b = int(starts[start]), int(ends[end])
                    if (merge and entities and entities[-1].label == plan.labels[label]
                            and 0 <= a - entities[-1].end <= 1):
                        first = entities.pop()
                        a, score = first.start, first.score
                    entities.append(Entity(text=text[a:b], label=plan.labels[label], score=score, start=a, end=b))
            items.append((entities, None))
        return items

    def _collect_token_class(self, plan: ExtractPlan, outputs: list) -> list:
        call, card = plan.call, plan.card
        strategy = call.aggregation or card.extract.aggregation
        n = len(call.texts)
        stitched: list[np.ndarray | None] = [None] * n
        for owner, (a, (lo, hi), lead), logits in zip(plan.owners, plan.windows, outputs):
            offsets, _ = plan.texts[owner]
            if stitched[owner] is None:
                stitched[owner] = np.zeros((len(offsets), logits.shape[1]), dtype=np.float32)
            stitched[owner][lo:hi] = logits[lead + lo - a: lead + hi - a]
        items = []
        id2label = plan.head.id2label
        for index in range(n):
            offsets, word_ids = plan.texts[index]
            logits = stitched[index]
            groups = aggregate_entities(logits, id2label, offsets, word_ids, call.texts[index], strategy) \
                if logits is not None and len(logits) else []
            if card.extract.merge_adjacent:
                groups = _merge_runs(groups, call.texts[index])
            entities = [Entity(**g) for g in groups
                        if (plan.threshold is None or g["score"] >= plan.threshold)
                        and (not plan.labels or g["label"] in plan.labels)]
            items.append((entities, None))
        return items

    def _collect_zero_shot(self, plan: ExtractPlan, outputs: list) -> list:
        call, k = plan.call, len(plan.labels)
        head = plan.head
        items = []
        for index in range(len(call.texts)):
            logits = np.stack(outputs[index * k:(index + 1) * k]).astype(np.float64)  # [labels, nli labels]
            if bool(call.multi_label) or k == 1:
                pair = logits[:, [head.contradiction_id, head.entailment_id]]
                pair = np.exp(pair - pair.max(axis=1, keepdims=True))
                scores = pair[:, 1] / pair.sum(axis=1)
            else:
                entail = logits[:, head.entailment_id]
                entail = np.exp(entail - entail.max())
                scores = entail / entail.sum()
            order = sorted(range(k), key=lambda i: -scores[i])
            labels = [LabelScore(plan.labels[i], float(scores[i])) for i in order
                      if plan.threshold is None or scores[i] >= plan.threshold]
            items.append((None, labels))
        return items


def _merge_runs(groups: list[dict], text: str) -> list[dict]:
    """Consecutive entities of one label with only whitespace between them, as one (mean score)."""
    merged: list[dict] = []
    counts: list[int] = []
    for g in groups:
        last = merged[-1] if merged else None
        if last and last["label"] == g["label"] and not text[last["end"]:g["start"]].strip():
            last["score"] = (last["score"] * counts[-1] + g["score"]) / (counts[-1] + 1)
            counts[-1] += 1
            last["end"] = g["end"]
            last["text"] = text[last["start"]:g["end"]]
        else:
            merged.append(dict(g))
            counts.append(1)
    return merged


def _labels(labels: list, required: bool, fold: bool = False) -> list[str]:
    if not isinstance(labels, list):
        raise InvalidRequest("labels must be a list of strings", details={"option": "labels"})
    if required and not labels:
        raise InvalidRequest("labels is empty: send the entity types (or classes) to look for, "
                             'e.g. "labels": ["person", "organization"]', details={"option": "labels"})
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(f"{len(labels)} labels is more than one request may send ({MAX_LABELS})",
                             details={"option": "labels", "max": MAX_LABELS})
    for index, label in enumerate(labels):
        if not isinstance(label, str) or not label.strip():
            raise InvalidRequest(f"labels[{index}] is empty: every label needs some text",
                                 details={"option": "labels", "index": index})
        if len(label) > MAX_LABEL_CHARS:
            raise InvalidRequest(f"labels[{index}] is {len(label)} characters long; a label may have at most "
                                 f"{MAX_LABEL_CHARS}", details={"option": "labels", "index": index, "max": MAX_LABEL_CHARS})
    if fold:  # labels that lowercase alike are one prompt: the first as sent is kept
        first: dict[str, str] = {}
        for label in labels:
            first.setdefault(label.lower(), label)
        return list(first.values())
    return list(dict.fromkeys(labels))


def _hypotheses(template: str, labels: list[str]) -> list[str]:
    """`template.format(label)` per label (as transformers' pipeline fills it), once the template is
    known to place the label exactly once."""
    sentinel = "\x00label\x00"
    try:
        placed = template.format(sentinel).count(sentinel) if isinstance(template, str) else 0
    except (IndexError, KeyError, ValueError, AttributeError):
        placed = 0
    if placed != 1:
        raise InvalidRequest(f"hypothesis_template must contain {{}} exactly once (where the label goes), as a "
                             f"format string; got {template!r}", details={"option": "hypothesis_template"})
    return [template.format(label) for label in labels]


def _window(seq, num_words: int, num_prompt_words: int, cap: int | None, last: bool):
    """A GLiNER window's sequence, the position of each of its words' first (`last`: last) token,
    and of each label's [ENT] token. With `cap`, a word longer than the whole room keeps its first
    `cap` tokens. A word the tokenizer drops entirely reads the closing special token."""
    ids, word_ids = seq.ids, seq.word_ids
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
