"""`AsyncClient`: encode, score and extract on a shoal server over one pooled HTTP connection.

Requests are the wire's own Structs (`shoal.wire.native`), sent in msgpack (arrays and image files
as raw bytes) or JSON (image files in base64); answers come back as numpy arrays and small records
(`shoal.sdk.results`). Images are `shoal.sdk.Image`s (`shoal.sdk.images`), read when their
request is built. `deadline_s` bounds one method call, retries and chunks included: each
request tells the server what is left of it (`options.timeout_s`), so the server drops work the
caller no longer waits for.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import quote

from .. import wire
from ..calls import ExtractedItem
from . import bulk, results
from .http import Http
from .images import Image, ImageSource, image_of
from .results import Encoded, Ranking

if TYPE_CHECKING:
    import httpx
    from typing_extensions import Self

ItemT = TypeVar("ItemT", wire.EncodeItem, wire.ScoreItem, wire.native.ExtractItem)


class AsyncClient:
    """A client of one shoal server. Use it as `async with AsyncClient(url) as client:` or call
    `aclose()`; one instance is safe to share between tasks of one event loop.

    `timeout_s` bounds each HTTP request, `deadline_s` (None: no bound) each method call with its
    retries and chunks; `max_retries` bounds the retries of each request (`shoal.sdk.http` says which
    answers are retried). Errors raise as `shoal.errors` classes (`Overloaded`, `UnknownModel`, ...);
    transport failures that outlast the retries raise as httpx's own errors. `transport` replaces
    httpx's network transport (an `httpx.MockTransport` in tests).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        deadline_s: float | None = None,
        format: str = "msgpack",
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.deadline_s = deadline_s
        self._http = Http(
            base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            format=format,
            transport=transport,
            headers=headers,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- verbs -----------------------------------------------------------------------------------

    async def encode(
        self,
        model: str,
        texts: Sequence[str] | None = None,
        *,
        images: Iterable[ImageSource] | None = None,
        adapter: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        output_dtype: wire.OutputDtype | None = None,
        is_query: bool | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        outputs: Sequence[wire.OutputKind] | None = None,
        sparse_top_k: int | None = None,
        return_tokens: bool = False,
        batch_size: int | None = None,
        concurrency: int = 4,
        show_progress: bool = False,
    ) -> Encoded:
        """Vectors for `texts`, or for `images`, one row each in the order sent (`docs/api.md`,
        `POST /v1/encode`, says what each option does; None: the server's default).

        `images` are for a model whose card reads them (CLIP, SigLIP): file paths, the files' bytes,
        binary file objects, PIL images or uint8 arrays, bare or as `Image`s (`shoal.sdk.Image`
        says how each is sent), or one `[n, H, W, C]` uint8 array of n images. One call encodes
        texts or images: both at once is a ValueError (encode each in its own call; each call's
        rows keep its order).

        More than `batch_size` items (default 256) go as several requests, `concurrency` at once; a
        request of images also ends before 4 MiB of image files (`bulk.IMAGE_BYTES_PER_REQUEST`),
        and each image is read only when its request is built. `show_progress` draws a tqdm bar of
        the items done.
        """
        inputs, unit = _inputs("encode", texts, images)
        deadline = self._deadline()
        dtype: wire.OutputDtype = output_dtype or "float32"

        async def send(chunk: list[str | Image]) -> wire.EncodeResponse:
            payloads = await _payloads(chunk)

            def body(timeout_s: float | None) -> wire.EncodeRequest:
                options = wire.EncodeOptions(
                    normalize=normalize,
                    dimensions=dimensions,
                    output_dtype=dtype,
                    is_query=is_query,
                    prompt_name=prompt_name,
                    truncate=True if truncate is None else truncate,
                    outputs=list(outputs) if outputs else None,
                    sparse_top_k=sparse_top_k,
                    return_tokens=return_tokens,
                    timeout_s=timeout_s,
                )
                items = [_item(wire.EncodeItem, payload) for payload in payloads]
                return wire.EncodeRequest(model=model, items=items, options=options, adapter=adapter)

            return await self._http.post("/v1/encode", body, wire.EncodeResponse, deadline)

        chunks = _chunks(inputs, unit, batch_size)
        answers = await bulk.map_chunks(
            chunks, send, concurrency=concurrency, show_progress=show_progress, desc="encode", unit=unit
        )
        return results.encoded(answers, dtype)

    async def score(
        self,
        model: str,
        query: str | Image,
        documents: Sequence[str | Image],
        *,
        top_k: int | None = None,
        adapter: str | None = None,
        raw_scores: bool | None = None,
        truncate: bool | None = None,
        max_tokens_per_doc: int | None = None,
        window_overlap_tokens: int | None = None,
        instruction: str | None = None,
    ) -> Ranking:
        """`documents` ranked for `query`: `Scored(index, score)` best first, cut to `top_k`.
        Cross-encoders and LLM rerankers score pairs; an embedder scores by cosine (`POST /v1/score`).

        The query and each document are a text (`str`) or an `Image` (`Image("cat.png")`: a bare
        `str` is always a text), for a model whose card reads images (CLIP, SigLIP score by cosine).
        """
        inputs = _score_inputs(query, documents)
        deadline = self._deadline()
        query_payload, *document_payloads = await _payloads(inputs)
        wire_query = query_payload if isinstance(query_payload, str) else wire.ScoreQuery(image=query_payload)

        def body(timeout_s: float | None) -> wire.ScoreRequest:
            options = wire.ScoreOptions(
                raw_scores=bool(raw_scores),
                truncate=True if truncate is None else truncate,
                max_tokens_per_doc=max_tokens_per_doc,
                window_overlap_tokens=window_overlap_tokens,
                instruction=instruction,
                timeout_s=timeout_s,
            )
            items = [_item(wire.ScoreItem, payload) for payload in document_payloads]
            return wire.ScoreRequest(
                model=model, query=wire_query, items=items, top_k=top_k, options=options, adapter=adapter
            )

        return results.ranking(await self._http.post("/v1/score", body, wire.ScoreResponse, deadline))

    async def extract(
        self,
        model: str,
        texts: Sequence[str] | None = None,
        labels: Sequence[str] = (),
        *,
        images: Iterable[ImageSource] | None = None,
        threshold: float | None = None,
        adapter: str | None = None,
        flat_ner: bool | None = None,
        multi_label: bool | None = None,
        max_span_width: int | None = None,
        hypothesis_template: str | None = None,
        aggregation: str | None = None,
        top_k: int | None = None,
        raw_scores: bool | None = None,
        function_to_apply: wire.native.ClassifyFunction | None = None,
        truncate: bool | None = None,
        text_pairs: Sequence[str] | None = None,
        schema: dict[str, Any] | None = None,
        batch_size: int | None = None,
        concurrency: int = 4,
        show_progress: bool = False,
    ) -> list[ExtractedItem]:
        """Each text's `entities` (span and token-class NER: text, label, score, start, end in
        characters) or `labels` (zero-shot classification, best first), in the order sent;
        chunked like `encode`. `labels`: the entity types or classes (`POST /v1/extract`).

        `images` are for a card whose extract kind is `image_labels` (CLIP, SigLIP zero-shot image
        classification): each image's `labels`, best first. They are `encode`'s image sources, sent
        and chunked as `encode` sends them; texts and images in one call are a ValueError.

        A text classifier (extract kind `classify`) scores its own labels for each text (`labels`,
        if given, keeps only those): `top_k` best, `raw_scores` (the logits), `truncate=False` (an
        over-long text is refused), `function_to_apply` (softmax, sigmoid or none in place of the
        model's), and `text_pairs` (one second text per text, for a pair
        classifier). A GLiNER2 model (kind `gliner2`) takes the entity types as `labels` and its
        `schema`'s relations and classification tasks (`ExtractCall.schema` says its form); each
        item's `relations` holds each relation type's instances (head, tail) and `classifications`
        the tasks' labels by task."""
        inputs, unit = _inputs("extract", texts, images)
        deadline = self._deadline()
        chunks = _chunks(inputs, unit, batch_size)
        pairs_of: dict[int, list[str]] = {}
        if text_pairs is not None:
            if len(text_pairs) != len(inputs):
                raise ValueError(f"text_pairs has {len(text_pairs)} texts for {len(inputs)} texts")
            pair_chunks = bulk.chunks_of(list(text_pairs), batch_size)  # texts are cut by count alone, alike
            pairs_of = {id(chunk): pairs for chunk, pairs in zip(chunks, pair_chunks)}

        async def send(chunk: list[str | Image]) -> wire.ExtractResponse:
            payloads = await _payloads(chunk)

            def body(timeout_s: float | None) -> wire.ExtractRequest:
                options = wire.native.ExtractOptions(
                    threshold=threshold,
                    flat_ner=flat_ner,
                    multi_label=multi_label,
                    max_span_width=max_span_width,
                    hypothesis_template=hypothesis_template,
                    aggregation=aggregation,
                    top_k=top_k,
                    raw_scores=raw_scores,
                    function_to_apply=function_to_apply,
                    truncate=truncate,
                    timeout_s=timeout_s,
                )
                return wire.ExtractRequest(
                    model=model,
                    items=[_item(wire.native.ExtractItem, payload) for payload in payloads],
                    labels=list(labels),
                    text_pairs=pairs_of.get(id(chunk)),
                    schema=schema,
                    options=options,
                    adapter=adapter,
                )

            return await self._http.post("/v1/extract", body, wire.ExtractResponse, deadline)

        answers = await bulk.map_chunks(
            chunks, send, concurrency=concurrency, show_progress=show_progress, desc="extract", unit=unit
        )
        return results.extracted(answers)

    async def models(self) -> list[wire.ModelEntry]:
        """Every model the server serves to this caller (`GET /v1/models`), loaded or not."""
        listed = cast(wire.ModelList, await self._http.get("/v1/models", self._deadline()))  # as the server sent it
        return listed["data"]

    async def model(self, model_id: str) -> wire.ModelEntry:
        """One model's entry (`GET /v1/models/{id}`): tasks, outputs, dimensions, residency, adapters."""
        entry = await self._http.get(f"/v1/models/{quote(model_id, safe='/')}", self._deadline())
        return cast(wire.ModelEntry, entry)  # as the server sent it: not checked field by field

    def _deadline(self) -> float | None:
        return None if self.deadline_s is None else time.monotonic() + self.deadline_s


def _texts(texts: Sequence[str]) -> Sequence[str]:
    if isinstance(texts, str):  # iterating a str would send one request item per character
        raise TypeError("texts must be a sequence of strings, not one str: pass [text]")
    return texts


def _inputs(
    verb: str, texts: Sequence[str] | None, images: Iterable[ImageSource] | None
) -> tuple[list[str | Image], str]:
    """An encode or extract call's inputs, each a text or an `Image`, and the unit its progress counts."""
    if texts is not None and images is not None:
        raise ValueError(
            f"{verb} takes texts or images, not both in one call: {verb} each in its own call "
            "(each call's answers keep the order sent)"
        )
    if images is None:
        if texts is None:
            raise TypeError(f"{verb} needs texts (a list of strings) or images=[...]")
        return list(_texts(texts)), "text"
    one = (str, bytes, bytearray, memoryview, os.PathLike, io.IOBase, Image)  # an image, not a sequence of them
    if isinstance(images, one) or getattr(images, "ndim", 4) != 4 or not isinstance(images, Iterable):
        raise TypeError(f"images must be a sequence of images, not one {type(images).__name__}: pass [image]")
    return [_image_at(f"images[{i}]", source) for i, source in enumerate(images)], "image"


def _score_inputs(query: str | Image, documents: Sequence[str | Image]) -> list[str | Image]:
    """`[query, *documents]`, each a text or an `Image`; anything else a TypeError naming it."""
    if isinstance(documents, str):
        raise TypeError("documents must be a sequence, not one str: pass [document]")
    inputs: list[str | Image] = []
    for name, value in [("query", query), *((f"documents[{i}]", d) for i, d in enumerate(documents))]:
        if not isinstance(value, (str, Image)):
            raise TypeError(
                f"{name} is {type(value).__name__}: score takes a text (str) or an image wrapped in "
                "shoal.sdk.Image (Image(path), Image(file_bytes), ...)"
            )
        inputs.append(value)
    return inputs


def _image_at(name: str, source: ImageSource) -> Image:
    try:
        return image_of(source)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _chunks(inputs: list[str | Image], unit: str, batch_size: int | None) -> list[list[str | Image]]:
    """`batch_size` inputs a request; a request of images also ends before 4 MiB of files."""
    if unit == "image":
        return bulk.chunks_of(inputs, batch_size, max_chunk_bytes=bulk.IMAGE_BYTES_PER_REQUEST, num_bytes=_num_bytes)
    return bulk.chunks_of(inputs, batch_size)


def _num_bytes(value: str | Image) -> int:
    return value.num_bytes() if isinstance(value, Image) else len(value)


async def _payloads(inputs: list[str | Image]) -> list[str | bytes]:
    """Texts as they are, images read into their files' bytes: in a worker thread when there are
    any, since reading a file and writing a PNG block."""

    def read() -> list[str | bytes]:
        return [value if isinstance(value, str) else value.read() for value in inputs]

    return await asyncio.to_thread(read) if any(isinstance(value, Image) for value in inputs) else read()


def _item(item_type: Callable[..., ItemT], payload: str | bytes) -> ItemT:
    """A request item (`wire.EncodeItem`, `ScoreItem`, `ExtractItem`): a text, or an image file's bytes."""
    return item_type(text=payload) if isinstance(payload, str) else item_type(image=payload)
