"""Hugging Face text-embeddings-inference (TEI): `/rerank`, `/embed`, `/embed_sparse`, `/similarity`,
`/tokenize`, `/decode`, `/predict`, `/` — their requests and bare-list responses, as TEI's router
defines them (`/info` is built in `shoal.api.tei`).

TEI's bodies name no model: the route picks one (`?model=`, `X-Shoal-Model`, else the server's
default model for the verb). TEI's defaults hold: `truncate` false (a text longer than the model
takes is an error) unless the server runs with `--auto-truncate`, as TEI's flag of that name
does; scores through the model's activation unless `raw_scores`. Only right truncation is
served; `truncation_direction: "Left"` is refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from ..calls import EncodeCall, EncodeResult, ExtractCall, ExtractResult, ScoreCall, ScoreResult
from ..errors import InvalidRequest

Inputs = str | Annotated[list[str], msgspec.Meta(min_length=1)]
Direction = Literal["Right", "right", "Left", "left"]
TokenId = Annotated[int, msgspec.Meta(ge=0)]


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True):
    query: Annotated[str, msgspec.Meta(min_length=1)]
    texts: Annotated[list[str], msgspec.Meta(min_length=1)]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None  # unset or null: the server's --auto-truncate (default false), as TEI reads it
    # TEI's OpenAPI spells them "Left" / "Right"; its own default is written "right".
    truncation_direction: Direction = "Right"


class Rank(msgspec.Struct, omit_defaults=True):
    index: int
    score: float
    text: str | None = None  # only with return_text


def score_call(
    req: RerankRequest, model: str, request_id: str | None = None, *, auto_truncate: bool = False
) -> ScoreCall:
    check_direction(req.truncation_direction)
    return ScoreCall(
        model=model,
        query=req.query,
        documents=req.texts,
        raw_scores=req.raw_scores,
        truncate=auto_truncate if req.truncate is None else req.truncate,
        request_id=request_id,
    )


def ranks(req: RerankRequest, result: ScoreResult) -> list[Rank]:
    """Best first, as TEI sorts them."""
    return [
        Rank(index=item.index, score=item.score, text=req.texts[item.index] if req.return_text else None)
        for item in result.items
    ]


# --- embeddings: /embed, /embed_sparse, /similarity, / -------------------------------------------


class EmbedRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`/embed` (and `/` on an embedder). `encoding_format` is what huggingface_hub may add."""

    inputs: Inputs
    truncate: bool | None = None  # unset: --auto-truncate's (false: a text longer than the model takes is a 422)
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    normalize: bool = True
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    encoding_format: Literal["float"] | None = None


class EmbedSparseRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`/embed_sparse`, and `/embed_all` (TEI's two requests have the same fields)."""

    inputs: Inputs
    truncate: bool | None = None  # unset: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: Inputs
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`/decode`: one sequence of token ids, or a list of them."""

    ids: Annotated[list[TokenId | list[TokenId]], msgspec.Meta(min_length=1)]
    skip_special_tokens: bool = True

    def sequences(self) -> list[list[int]]:
        if all(isinstance(i, int) for i in self.ids):
            return [[i for i in self.ids if isinstance(i, int)]]
        if all(isinstance(i, list) for i in self.ids):
            return [i for i in self.ids if isinstance(i, list)]
        raise InvalidRequest(
            "ids mixes token ids and lists of them: send one sequence ([int]) or a list of sequences ([[int]])",
            details={"path": "$.ids"},
        )


class SparseValue(msgspec.Struct):
    index: int
    value: float


class SimilarityInput(msgspec.Struct, forbid_unknown_fields=True):
    source_sentence: str
    sentences: Annotated[list[str], msgspec.Meta(min_length=1)]


class SimilarityParameters(msgspec.Struct, forbid_unknown_fields=True):
    truncate: bool | None = None  # unset: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class SimilarityRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


def texts_of(inputs: Inputs) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def check_direction(direction: str) -> None:
    if direction.lower() == "left":
        raise InvalidRequest(
            'truncation_direction "Left" is not supported: shoal truncates on the right only; send "Right" or omit it',
            details={"path": "$.truncation_direction"},
        )


def embed_call(
    req: EmbedRequest, model: str, request_id: str | None = None, *, auto_truncate: bool = False
) -> EncodeCall:
    check_direction(req.truncation_direction)
    return EncodeCall(
        model=model,
        items=texts_of(req.inputs),
        normalize=req.normalize,
        dimensions=req.dimensions,
        prompt_name=req.prompt_name,
        truncate=auto_truncate if req.truncate is None else req.truncate,
        outputs=("dense",),
        request_id=request_id,
    )


def unpooled_call(
    req: EmbedSparseRequest, model: str, output: str, request_id: str | None = None, *, auto_truncate: bool = False
) -> EncodeCall:
    """`/embed_sparse` (`output` "sparse") or `/embed_all` ("token_states": every token's last
    hidden state, unpooled and unnormalised)."""
    check_direction(req.truncation_direction)
    return EncodeCall(
        model=model,
        items=texts_of(req.inputs),
        prompt_name=req.prompt_name,
        truncate=auto_truncate if req.truncate is None else req.truncate,
        outputs=(output,),
        request_id=request_id,
    )


def similarity_call(
    req: SimilarityRequest, model: str, request_id: str | None = None, *, auto_truncate: bool = False
) -> EncodeCall:
    """The source sentence and the others in one call; `similarities` turns the vectors into scores."""
    params = req.parameters or SimilarityParameters()
    check_direction(params.truncation_direction)
    return EncodeCall(
        model=model,
        items=[req.inputs.source_sentence, *req.inputs.sentences],
        normalize=True,
        prompt_name=params.prompt_name,
        truncate=auto_truncate if params.truncate is None else params.truncate,
        outputs=("dense",),
        request_id=request_id,
    )


def similarities(result: EncodeResult) -> list[float]:
    """Cosine of each sentence with the source sentence (the vectors come normalised)."""
    vectors = np.stack(result.vectors).astype(np.float32)  # [1 + n, d]
    return [float(x) for x in vectors[1:] @ vectors[0]]


def sparse_values(result: EncodeResult) -> list[list[SparseValue]]:
    """Each text's (index, value) pairs, heaviest first; the call asked for sparse output."""
    sparse = [item.sparse for item in result.items if item.sparse is not None]
    if len(sparse) != len(result.items):
        raise ValueError("this result has no sparse vectors: its call asked for other outputs")
    return [[SparseValue(int(i), float(v)) for i, v in zip(s.indices, s.values)] for s in sparse]


# --- /predict: a text classifier (extract kind classify) -----------------------------------------

# One text, `[text]`, `[text, text_pair]`, or a batch of those lists (TEI's PredictInput).
PredictSequence = Annotated[list[str], msgspec.Meta(min_length=1, max_length=2)]
PredictInputs = str | Annotated[list[str | PredictSequence], msgspec.Meta(min_length=1)]


class PredictRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`/predict` (and `/` on a classifier). `inputs` is read as TEI reads it (`sequences`)."""

    inputs: PredictInputs
    truncate: bool | None = None  # unset: the server's --auto-truncate (default false: too long is a 422)
    truncation_direction: Direction = "Right"
    raw_scores: bool = False

    def sequences(self) -> tuple[list[tuple[str, str | None]], bool]:
        """(each sequence as (text, its pair's second text or None), whether `inputs` is a batch).

        As TEI's PredictInput: a string is one text; a list of strings is one sequence, a text
        (`[a]`) or a pair (`[a, b]`), never a batch of texts; a list of lists is a batch, each list
        a text or a pair."""
        inputs = self.inputs
        if isinstance(inputs, str):
            return [(inputs, None)], False
        texts = [s for s in inputs if isinstance(s, str)]
        batch = [s for s in inputs if not isinstance(s, str)]
        if texts and batch:
            raise InvalidRequest(
                "inputs mixes strings and lists: send one text or pair as a list of strings ([text] or "
                "[text, text_pair]), or a batch as a list of lists ([[text], [text, text_pair], ...])",
                details={"path": "$.inputs"},
            )
        if len(texts) > 2:
            raise InvalidRequest(
                f"inputs is a list of {len(texts)} strings: a list of strings is one text ([text]) or one "
                "pair ([text, text_pair]); send a batch as a list of lists: [[text], [text, text_pair], ...]",
                details={"path": "$.inputs"},
            )
        if texts:
            return [_sequence(texts)], False
        return [_sequence(s) for s in batch], True


class Prediction(msgspec.Struct):
    score: float
    label: str


def _sequence(texts: list[str]) -> tuple[str, str | None]:
    return texts[0], texts[1] if len(texts) > 1 else None


def predict_calls(
    req: PredictRequest,
    sequences: list[tuple[str, str | None]],
    model: str,
    request_id: str | None = None,
    *,
    auto_truncate: bool = False,
) -> list[tuple[list[int], ExtractCall]]:
    """The calls that classify `sequences`, each with the sequences' indices it holds: one call of
    the single texts and one of the pairs (a call's items are all texts or all pairs)."""
    check_direction(req.truncation_direction)
    truncate = auto_truncate if req.truncate is None else req.truncate
    singles = [i for i, (_, pair) in enumerate(sequences) if pair is None]
    pairs = [i for i, (_, pair) in enumerate(sequences) if pair is not None]
    return [
        (
            indices,
            ExtractCall(
                model=model,
                items=[sequences[i][0] for i in indices],
                text_pairs=[sequences[i][1] or "" for i in indices] if indices is pairs else None,
                raw_scores=req.raw_scores,
                truncate=truncate,
                request_id=request_id,
            ),
        )
        for indices in (singles, pairs)
        if indices
    ]


def predictions(
    num_sequences: int, held: list[list[int]], results: list[ExtractResult]
) -> tuple[list[list[Prediction]], list[int]]:
    """(each sequence's labels, best first, in request order; the indices of the sequences cut to
    fit) from the results of `predict_calls`' calls, `held[c]` the sequences call c held."""
    labels: list[list[Prediction]] = [[] for _ in range(num_sequences)]
    cut = []
    for indices, result in zip(held, results):
        for i, item in zip(indices, result.items):
            labels[i] = [Prediction(score=s.score, label=s.label) for s in item.labels or ()]
            if item.truncated:
                cut.append(i)
    return labels, sorted(cut)
