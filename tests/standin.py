"""`StandIn`: an in-memory `Service` for tests of the API without the engine.

No torch, no tokenizers, no `shoal.engine`: each text's vector is drawn from a generator seeded by
a hash of the model id and the text, so it is the same in every process and can be recomputed by
the test (`StandIn.vector`). Options are honoured as the engine honours them: Matryoshka
`dimensions` (truncate before normalising), `normalize` (default: the model's), and `output_dtype`
float32 / float16 / int8 (scaled so the largest component is ±127) / binary and ubinary
(sign bits, packbits; binary less 128, as int8).
Only dense output is served. "Tokens" are whitespace words plus two special tokens per text.

Score calls go to `standin/rerank` (tasks: score only), which scores a (query, document) pair by word
overlap (`StandIn.pair_score`) and ranks as the engine does: best first, ties by index, `top_k` kept.
A pair is query words + document words + three special tokens and takes `RERANK_MAX_LENGTH`; a
longer one is cut (`truncated`), scored by windows (`window_overlap_tokens`), or refused with
`InputTooLong` (`truncate: false`). Each model refuses the verb it does not serve with the engine's
message (`model X does not score; it serves: encode`).
"""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np

from shoal.calls import (
    AnyCall,
    AnyResult,
    EncodeCall,
    EncodedItem,
    EncodeResult,
    ScoreCall,
    ScoredItem,
    ScoreResult,
    text_of,
)
from shoal.errors import InputTooLong, InvalidRequest, UnknownModel
from shoal.metrics import Metrics
from shoal.service import Capacity, CardProblem, ModelStatus, Token
from shoal.vectors import OUTPUT_DTYPES, finish

RERANK_MODEL = "standin/rerank"
RERANK_MAX_LENGTH = 16  # tokens in a pair: query words + document words + [CLS] [SEP] [SEP]
MODELS = (
    ModelStatus(
        id="standin/dense-16",
        tasks=("encode",),
        outputs=("dense",),
        max_length=64,
        verified="unverified",
        loaded=False,
        architecture="standin",
        dimensions=16,
        pooling="mean",
        description="16 hashed dimensions, normalised by default",
    ),
    ModelStatus(
        id="standin/dense-8-raw",
        tasks=("encode",),
        outputs=("dense",),
        max_length=32,
        verified="unverified",
        loaded=False,
        architecture="standin",
        dimensions=8,
        pooling="cls",
        description="8 hashed dimensions, not normalised by default",
    ),
    ModelStatus(
        id=RERANK_MODEL,
        tasks=("score",),
        outputs=(),
        max_length=RERANK_MAX_LENGTH,
        verified="unverified",
        loaded=False,
        architecture="standin",
        description="scores (query, document) pairs by word overlap",
    ),
)
# Whether each model normalises when a call leaves `normalize` unset (a card's `normalize`).
NORMALIZES = {"standin/dense-16": True, "standin/dense-8-raw": False}
MAX_QUEUED_TOKENS = 100_000
# The words any stand-in in this process has tokenized, by id (what `detokenize` reads), and the
# special tokens' ids.
WORDS: dict[int, str] = {}
SPECIAL = {101: "[CLS]", 102: "[SEP]"}


def count_tokens(text: str) -> int:
    return len(text.split()) + 2  # [CLS] words [SEP]


class StandIn:
    """A `shoal.service.Service` that computes hashed vectors and word-overlap scores in process; it
    records the calls it serves."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self._models = {status.id: status for status in MODELS}
        self._started = False
        self._stopped = False
        self.warmed: list[str] = []
        self.calls: list[AnyCall] = []

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._stopped = True

    async def warm(self, model_ids: list[str]) -> None:
        for model_id in model_ids:
            self._status(model_id)
            if model_id not in self.warmed:
                self.warmed.append(model_id)

    @property
    def ready(self) -> bool:
        return self._started and not self._stopped

    @property
    def stopped(self) -> bool:
        return self._stopped

    # --- Service ---------------------------------------------------------------------------------

    def models(self) -> list[ModelStatus]:
        return [
            msgspec.structs.replace(
                status, loaded=status.id in self.warmed, state="loaded" if status.id in self.warmed else "not_loaded"
            )
            for status in MODELS
        ]

    def has_model(self, model_id: str) -> bool:
        return model_id in self._models

    def model(self, model_id: str) -> ModelStatus:
        self._status(model_id)
        return next(status for status in self.models() if status.id == model_id)

    def problems(self) -> list[CardProblem]:
        return []

    async def tokenize(
        self,
        model_id: str,
        texts: list[str],
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
        *,
        may_download: bool = True,
    ) -> list[list[Token]]:
        """Whitespace words (the stand-in's "tokens"), ids from the word's hash, [CLS] ... [SEP]."""
        self._status(model_id)
        out = []
        for text in texts:
            tokens, start = [], 0
            for word in text.split():
                start = text.index(word, start)
                token_id = int(hashlib.sha256(word.encode()).hexdigest()[:6], 16)
                WORDS[token_id] = word
                tokens.append(Token(token_id, word, False, start, start + len(word)))
                start += len(word)
            if add_special_tokens:
                tokens = [Token(101, "[CLS]", True, None, None), *tokens, Token(102, "[SEP]", True, None, None)]
            out.append(tokens)
        return out

    async def detokenize(
        self,
        model_id: str,
        ids: list[list[int]],
        skip_special_tokens: bool = True,
        *,
        may_download: bool = True,
    ) -> list[str]:
        """The words of ids this process's stand-ins have tokenized, joined by spaces; [CLS] and
        [SEP] unless skipped; any other id is refused, as the engine refuses one outside the vocabulary."""
        self._status(model_id)
        words = {**WORDS} if skip_special_tokens else {**WORDS, **SPECIAL}
        texts = []
        for i, sequence in enumerate(ids):
            unknown = [t for t in sequence if t not in words and t not in SPECIAL]
            if unknown:
                raise InvalidRequest(f"token id {unknown[0]} (sequence {i}) is not in the stand-in's vocabulary")
            texts.append(" ".join(words[t] for t in sequence if t in words))
        return texts

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        self._status(model_id)
        if action == "load" and model_id not in self.warmed:
            self.warmed.append(model_id)
        elif action == "unload" and model_id in self.warmed:
            self.warmed.remove(model_id)
        return self.model(model_id)

    def capacity(self) -> Capacity:
        return Capacity(queued_tokens=0, max_queued_tokens=MAX_QUEUED_TOKENS, tokens_per_s=None)

    async def run(self, call: AnyCall) -> AnyResult:
        if isinstance(call, ScoreCall):
            return self._score(call)
        if not isinstance(call, EncodeCall):
            raise InvalidRequest(f"the stand-in does not serve {type(call).__name__} calls")
        status = self._serving(call.model, "encode")
        if call.outputs not in (None, ("dense",)):
            raise InvalidRequest(f"{call.model} outputs only dense vectors", details={"outputs": list(call.outputs)})
        if call.dimensions is not None and not 1 <= call.dimensions <= status.dimensions:
            raise InvalidRequest(
                f"dimensions {call.dimensions} is outside 1..{status.dimensions} for {call.model}",
                details={"option": "dimensions", "max": status.dimensions},
            )
        normalize = NORMALIZES.get(call.model, True) if call.normalize is None else call.normalize
        self.calls.append(call)
        items = [
            EncodedItem(
                dense=self.vector(
                    call.model, text, dimensions=call.dimensions, normalize=normalize, output_dtype=call.output_dtype
                )
            )
            for text in map(text_of, call.items)
        ]
        num_tokens = sum(count_tokens(text_of(item) or "") for item in call.items)
        self.metrics.tokens.labels(call.model).inc(num_tokens)
        self.metrics.items.labels(call.model).inc(len(call.items))
        return EncodeResult(items=items, num_tokens=num_tokens, request_id=call.request_id)

    def _score(self, call: ScoreCall) -> ScoreResult:
        self._serving(call.model, "score")
        # The engine's checks (engine/tasks/score.py), in its words; the stand-in is a cross-encoder.
        if not call.query.strip():
            raise InvalidRequest(
                "the query is empty: send the text to score the documents against", details={"option": "query"}
            )
        if not call.documents:
            raise InvalidRequest("no documents to score", details={"option": "documents"})
        for option in ("top_k", "max_tokens_per_doc"):
            value = getattr(call, option)
            if value is not None and value < 1:
                raise InvalidRequest(f"{option} must be an integer >= 1, not {value!r}", details={"option": option})
        if call.window_overlap_tokens is not None and call.window_overlap_tokens < 0:
            raise InvalidRequest(
                f"window_overlap_tokens must be an integer >= 0, not {call.window_overlap_tokens!r}",
                details={"option": "window_overlap_tokens"},
            )
        if call.instruction is not None:
            raise InvalidRequest(
                f"instruction applies to LLM rerankers; model {call.model} scores by a cross-encoder",
                details={"option": "instruction"},
            )
        self.calls.append(call)
        scored = [
            self.score(
                call.query,
                doc,
                index=i,
                raw_scores=call.raw_scores,
                truncate=call.truncate,
                max_tokens_per_doc=call.max_tokens_per_doc,
                window_overlap_tokens=call.window_overlap_tokens,
            )
            for i, doc in enumerate(call.documents)
        ]
        items = [item for item, _ in scored]
        num_tokens = sum(tokens for _, tokens in scored)
        ranked = sorted(items, key=lambda item: (-item.score, item.index))[: call.top_k]
        self.metrics.tokens.labels(call.model).inc(num_tokens)
        self.metrics.items.labels(call.model).inc(len(call.documents))
        return ScoreResult(items=ranked, num_tokens=num_tokens, request_id=call.request_id)

    # --- the scores ------------------------------------------------------------------------------

    @staticmethod
    def pair_score(query: str, document_words: list[str], raw_scores: bool = False) -> float:
        """A "logit" in [-2, 2] from the share of query words the document has; sigmoid unless raw."""
        query_words = {w.lower() for w in query.split()}
        shared = query_words & {w.lower() for w in document_words}
        logit = 4.0 * len(shared) / max(1, len(query_words)) - 2.0
        return logit if raw_scores else 1.0 / (1.0 + math.exp(-logit))

    @classmethod
    def score(
        cls,
        query: str,
        document: str,
        *,
        index: int = 0,
        raw_scores: bool = False,
        truncate: bool = True,
        max_tokens_per_doc: int | None = None,
        window_overlap_tokens: int | None = None,
    ) -> tuple[ScoredItem, int]:
        """What `run` answers for one document of a score call, and the tokens it cost."""
        query_len = len(query.split())
        room = RERANK_MAX_LENGTH - query_len - 3  # document words that fit beside the query
        if room < 1:
            raise InputTooLong(
                f"the query leaves no room for a document within {RERANK_MAX_LENGTH} tokens: shorten it",
                details={"max_length": RERANK_MAX_LENGTH},
            )
        words = document.split()
        truncated = False
        if max_tokens_per_doc is not None and len(words) > max_tokens_per_doc:
            words, truncated = words[:max_tokens_per_doc], True
        if len(words) <= room:
            windows = [words]
        elif window_overlap_tokens is not None:
            if window_overlap_tokens >= room:
                raise InvalidRequest(
                    f"window_overlap_tokens {window_overlap_tokens} must be under the window's {room} document tokens",
                    details={"option": "window_overlap_tokens"},
                )
            windows, start = [], 0
            while True:
                windows.append(words[start : start + room])
                if start + room >= len(words):
                    break
                start += room - window_overlap_tokens
        elif not truncate:
            raise InputTooLong(
                f"pairs[{index}] is longer than the model's max_length of {RERANK_MAX_LENGTH} tokens; "
                "shorten it or send truncate: true",
                details={"index": index, "max_length": RERANK_MAX_LENGTH},
            )
        else:
            windows, truncated = [words[:room]], True
        best = max(cls.pair_score(query, window, raw_scores) for window in windows)
        num_tokens = sum(query_len + len(window) + 3 for window in windows)
        return ScoredItem(index=index, score=best, truncated=truncated, num_windows=len(windows)), num_tokens

    # --- the vectors -----------------------------------------------------------------------------

    @staticmethod
    def raw_vector(model_id: str, text: str, num_dims: int) -> np.ndarray:
        """`[num_dims]` float32, seeded by blake2b(model id, text): stable across processes."""
        digest = hashlib.blake2b(f"{model_id}\0{text}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return rng.standard_normal(num_dims).astype(np.float32)

    @classmethod
    def vector(
        cls,
        model_id: str,
        text: str,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        output_dtype: str = "float32",
    ) -> np.ndarray:
        """What `run` answers for `text` with these options (None: the model's default)."""
        num_dims = next(status.dimensions for status in MODELS if status.id == model_id)
        v = cls.raw_vector(model_id, text, num_dims)
        if output_dtype not in OUTPUT_DTYPES:
            raise InvalidRequest(f"output_dtype {output_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
        normalize = NORMALIZES.get(model_id, True) if normalize is None else normalize
        return finish(v, dimensions=dimensions, normalize=normalize, output_dtype=output_dtype)

    def _serving(self, model_id: str, task: str) -> ModelStatus:
        """The model's status; InvalidRequest, as the engine words it, if it does not serve `task`."""
        status = self._status(model_id)
        if task not in status.tasks:
            raise InvalidRequest(
                f"model {model_id} does not {task}; it serves: {', '.join(status.tasks)}",
                details={"model": model_id, "tasks": list(status.tasks)},
            )
        return status

    def _status(self, model_id: str) -> ModelStatus:
        try:
            return self._models[model_id]
        except KeyError:
            raise UnknownModel(f"unknown model {model_id!r}", details={"model": model_id}) from None
