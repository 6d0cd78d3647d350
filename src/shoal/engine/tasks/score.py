"""score: rank documents against one query. How depends on the card:

cross_encoder  one sequence per (query, document) pair, segment ids as the tokenizer gives them;
               a long document is truncated (the query is kept whole up to half the length),
               or scored in overlapping windows, keeping its best window
llm            one sequence per pair: prefix + template(instruction, query, document) + suffix;
               only the templated part is truncated (from its end: the document)
encoder        the query (as a query) and each document (as a document) through the card's
               first output: cosine of dense vectors, dot product of sparse ones, MaxSim of
               multi-vectors; a dual encoder (CLIP, SigLIP) scores with its own similarity,
               and its query and documents may be texts or images
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ...calls import Modality, ScoreCall, ScoredItem, ScoreResult, SparseVector, text_of
from ...catalog import ModelCard
from ...errors import InputTooLong, InvalidRequest
from ...head_info import LlmFrame, Similarity
from ...vectors import maxsim
from ...verbs import MAX_WINDOWS, estimate_tokens
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, EncodeSpec, PhaseSeconds, ScoreSpec
from .encode import PromptTokens
from .inputs import check_inputs, prepare, texts_of, value_of

_PAIRED = ("cross_encoder", "llm")


@dataclass
class ScorePlan:
    card: ModelCard
    call: ScoreCall
    mode: str  # cross_encoder | llm | dense | sparse | multivector
    estimated_tokens: int
    query: str  # "" for an image query (an encoder card that reads images)
    documents: list[str]  # texts; an image document's entry is ""
    # The query then the documents: their modalities (all "text" but on a card that reads images).
    modalities: list[Modality] = field(default_factory=list)
    similarity: Similarity | None = None  # a dual encoder's own score (filled by tokenize)
    # Filled by tokenize: the document each sequence belongs to (-1: the query), which documents
    # were cut to fit, and (encoders) the prompt tokens of the query and of each document.
    owners: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    prompt_tokens: tuple[int, int] = (0, 0)

    @property
    def num_items(self) -> int:
        return len(self.documents) + (self.mode not in _PAIRED)


class ScoreTask:
    verb = "score"

    def __init__(self) -> None:
        self._prompt_tokens = PromptTokens()

    def plan(self, card: ModelCard, call: ScoreCall) -> ScorePlan:
        if "score" not in card.tasks:
            raise InvalidRequest(
                f"model {card.id} does not score; it serves: {', '.join(card.tasks)}",
                details={"model": card.id, "tasks": list(card.tasks)},
            )
        mode = card.score.kind if card.score is not None else card.outputs[0]
        if mode in _PAIRED:  # rerankers read text pairs
            (query,) = texts_of([call.query], card, "query", indexed=False, task="scores")
            query_modality: Modality = "text"
        else:
            (query_modality,) = check_inputs([call.query], card, "query", indexed=False)
            query = text_of(call.query) or ""
        if query_modality == "text" and not query.strip():
            raise InvalidRequest(
                "the query is empty: send the text to score the documents against", details={"option": "query"}
            )
        if not call.documents:
            raise InvalidRequest("no documents to score", details={"option": "documents"})
        if mode in _PAIRED:
            documents = texts_of(call.documents, card, "documents", task="scores")
            modalities: list[Modality] = ["text"] * (len(documents) + 1)
        else:
            modalities = [query_modality, *check_inputs(call.documents, card, "documents")]
            documents = [text_of(d) or "" for d in call.documents]
        for option in ("top_k", "max_tokens_per_doc"):
            value = getattr(call, option)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequest(f"{option} must be an integer >= 1, not {value!r}", details={"option": option})
        overlap = call.window_overlap_tokens
        if overlap is not None:
            if mode != "cross_encoder":
                raise InvalidRequest(
                    f"window_overlap_tokens applies to cross-encoders; model {card.id} scores by {_HOW[mode]}",
                    details={"option": "window_overlap_tokens"},
                )
            if not isinstance(overlap, int) or overlap < 0:
                raise InvalidRequest(
                    f"window_overlap_tokens must be an integer >= 0, not {overlap!r}",
                    details={"option": "window_overlap_tokens"},
                )
        if call.instruction is not None and mode != "llm":
            raise InvalidRequest(
                f"instruction applies to LLM rerankers; model {card.id} scores by {_HOW[mode]}",
                details={"option": "instruction"},
            )
        return ScorePlan(card, call, mode, estimate_tokens(call, card), query, documents, modalities)

    async def tokenize(self, plan: ScorePlan, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]:
        call = plan.call
        documents = plan.documents
        if call.max_tokens_per_doc is not None:
            tok = model.tokenizer_for(False)
            cuts = await pool.map(
                lambda chunk, _: [tok.cut_to_tokens(d, call.max_tokens_per_doc) if d else (d, False) for d in chunk],
                documents,
            )
            documents = [text for text, _ in cuts]
            cut = [was_cut for _, was_cut in cuts]
        else:
            cut = [False] * len(documents)

        if plan.mode == "cross_encoder":
            seqs, owners, cut_too = await _pairs(plan, model, pool, documents)
            cut = [a or b for a, b in zip(cut, cut_too)]
        elif plan.mode == "llm":
            seqs = await _framed(plan, model.head(LlmFrame), pool, documents)
            owners = list(range(len(documents)))
        else:
            card = plan.card
            query_prompt, document_prompt = card.prompt_for(None, True), card.prompt_for(None, False)
            query_modality, *modalities = plan.modalities
            if query_modality == "text":
                seqs = await pool.encode(
                    model.tokenizer_for(True),
                    [query_prompt + plan.query],
                    call.truncate,
                    what="the query",
                    indexed=False,
                )
            else:
                seqs = await prepare(
                    pool, model, [value_of(call.query)], [query_modality], is_query=True, truncate=True, what="query"
                )
            values = [
                document_prompt + text if m == "text" else value_of(item)
                for text, item, m in zip(documents, call.documents, modalities)
            ]
            seqs += await prepare(
                pool, model, values, modalities, is_query=False, truncate=call.truncate, what="documents"
            )
            owners = [-1, *range(len(documents))]
            plan.similarity = next((h for h in model.heads if isinstance(h, Similarity)), None)
            if plan.mode == "dense":  # a pooling that leaves prompts out needs their lengths
                count = self._prompt_tokens.count
                plan.prompt_tokens = (
                    count(model.tokenizer_for(True), query_prompt) if query_prompt else 0,
                    count(model.tokenizer_for(False), document_prompt) if document_prompt else 0,
                )
        truncated = list(cut)
        if call.window_overlap_tokens is None:  # windows cover what one sequence would have cut
            for seq, owner in zip(seqs, owners):
                if owner >= 0 and seq.truncated:
                    truncated[owner] = True
        plan.owners, plan.truncated = owners, truncated
        return seqs

    def specs(self, plan: ScorePlan, seqs: list[Encoded]) -> list[ScoreSpec] | list[EncodeSpec]:
        if plan.mode in _PAIRED:
            return [ScoreSpec(raw=plan.call.raw_scores)] * len(seqs)
        query_tokens, document_tokens = plan.prompt_tokens
        spec = EncodeSpec(
            normalize=True, dimensions=None, output_dtype="float32", outputs=(plan.mode,), prompt_tokens=document_tokens
        )
        return [replace(spec, is_query=True, prompt_tokens=query_tokens)] + [spec] * (len(seqs) - 1)

    def check_size(self, plan: ScorePlan, seqs: list[Encoded], max_result_bytes: int) -> None:
        return None  # a score per document: always small

    def collect_off_loop(self, plan: ScorePlan, outputs: list) -> bool:
        return False  # vectors and scores: collecting them is cheap

    def collect(self, plan: ScorePlan, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> ScoreResult:
        n = len(plan.documents)
        if plan.mode in _PAIRED:
            scores = np.full(n, -np.inf)
            windows = np.zeros(n, dtype=np.int64)
            for owner, score in zip(plan.owners, outputs):
                scores[owner] = max(scores[owner], score)
                windows[owner] += 1
        else:
            query, documents = outputs[0], outputs[1:]
            scores = np.array([_similarity(plan.mode, query, d) for d in documents])
            if plan.call.unit_scores:
                scores = unit_scores(plan.mode, scores, query)
            elif plan.similarity is not None:  # the cosines, as the dual encoder scores them
                raw, similarity = plan.call.raw_scores, plan.similarity
                scores = np.array([similarity.score(float(cosine), raw) for cosine in scores])
            windows = np.ones(n, dtype=np.int64)
        if plan.mode in _PAIRED and plan.call.unit_scores:
            logits = plan.call.raw_scores or (plan.card.score is not None and plan.card.score.activation == "none")
            scores = unit_scores("logit" if logits else "probability", scores, None)
        order = sorted(range(n), key=lambda i: -scores[i])[: plan.call.top_k]
        items = [
            ScoredItem(index=i, score=float(scores[i]), truncated=plan.truncated[i], num_windows=int(windows[i]))
            for i in order
        ]
        return ScoreResult(
            items=items, num_tokens=sum(len(s) for s in seqs), request_id=plan.call.request_id, **timings
        )


_HOW = {
    "cross_encoder": "a cross-encoder",
    "llm": "an LLM reranker",
    "dense": "cosine of dense vectors",
    "sparse": "dot product of sparse vectors",
    "multivector": "MaxSim of multi-vectors",
}


async def _pairs(
    plan: ScorePlan, model: ModelInfo, pool: TokenizerPool, documents: list[str]
) -> tuple[list[Encoded], list[int], list[bool]]:
    """Cross-encoder sequences, the document each belongs to, and which documents were cut before
    pairing. Documents are truncated first: the query keeps up to half the length (a longer query
    is cut, and then every pair counts as truncated), so it always leaves the document room."""
    call, tok = plan.call, model.text
    query, query_cut = tok.cut_to_tokens(plan.query, max(1, tok.max_length // 2))
    if query_cut and not call.truncate:
        raise InputTooLong(
            f"the query is longer than half the model's max_length of {tok.max_length} tokens; "
            "shorten it or send truncate: true",
            details={"option": "query", "max_length": tok.max_length},
        )
    if call.window_overlap_tokens is None:
        seqs = await pool.encode(tok, [query] * len(documents), call.truncate, pairs=documents)
        return seqs, list(range(len(documents))), [query_cut] * len(documents)
    groups = await pool.map(
        lambda chunk, _: tok.encode_pair_windows(query, chunk, call.window_overlap_tokens, MAX_WINDOWS), documents
    )
    seqs = [seq for windows, _ in groups for seq in windows]
    owners = [i for i, (windows, _) in enumerate(groups) for _ in windows]
    return seqs, owners, [query_cut or cut for _, cut in groups]


async def _framed(plan: ScorePlan, frame: LlmFrame, pool: TokenizerPool, documents: list[str]) -> list[Encoded]:
    """LLM-reranker sequences: prefix + the templated pair (cut from its end if too long) + suffix."""
    call = plan.call
    prefix = np.asarray(frame.prefix_ids, dtype=np.int64)
    suffix = np.asarray(frame.suffix_ids, dtype=np.int64)
    texts = [frame.text(plan.query, d, call.instruction) for d in documents]
    bodies = await pool.encode(frame.body, texts, call.truncate, what="documents")
    return [Encoded(np.concatenate([prefix, body.ids, suffix]), truncated=body.truncated) for body in bodies]


def unit_scores(kind: str, scores: np.ndarray, query) -> np.ndarray:
    """Scores of one kind mapped into 0..1, each by a fixed increasing function (the ranking
    is kept, and the same score always maps to the same value, whatever the other documents):

        probability   as it is (a cross-encoder's sigmoid or softmax, an LLM reranker's P(yes))
        logit         sigmoid (a cross-encoder's raw logit)
        dense         (cosine + 1) / 2 (a dual encoder's too: its cosine, before its own scale)
        sparse        s / (1 + s) of the dot product (>= 0; SPLADE weights are not bounded)
        multivector   (MaxSim / query tokens + 1) / 2: the mean of each query token's best cosine
    """
    if kind == "logit":
        out = 1.0 / (1.0 + np.exp(-scores))
    elif kind == "dense":
        out = (scores + 1.0) / 2.0
    elif kind == "sparse":
        positive = np.maximum(scores, 0.0)
        out = positive / (1.0 + positive)
    elif kind == "multivector":
        out = (scores / max(1, len(query.multivector)) + 1.0) / 2.0
    else:
        out = scores
    return np.clip(out, 0.0, 1.0)


def _similarity(mode: str, query, document) -> float:
    if mode == "dense":  # both normalised: the dot product is the cosine
        return float(np.dot(query.dense, document.dense))
    if mode == "sparse":
        return _sparse_dot(query.sparse, document.sparse)
    return maxsim(query.multivector, document.multivector)


def _sparse_dot(a: SparseVector, b: SparseVector) -> float:
    common, ia, ib = np.intersect1d(a.indices, b.indices, assume_unique=True, return_indices=True)
    return float(np.dot(a.values[ia].astype(np.float64), b.values[ib].astype(np.float64))) if len(common) else 0.0
