"""`shoal tune`'s quality gate for int8 and bfloat16: a `quantize` or `dtype` candidate serves only
if each dense vector it gives for the workload's texts stays within a cosine bar of the card's own
(the reference, taken from the start's server: float32 where `dtype` is searched)."""

from __future__ import annotations

import math

import httpx

from ..catalog.card import Batching


def min_cosine(reference: list[list[float]], other: list[list[float]]) -> float:
    """The smallest cosine between paired vectors (1.0 for none; NaN if any is not finite)."""

    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        return dot / (math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)) or 1.0)

    values = [cos(a, b) for a, b in zip(reference, other, strict=True)]
    return float("nan") if not all(map(math.isfinite, values)) else min(values, default=1.0)


class QualityGate:
    """int8 and bfloat16 change outputs: a candidate whose `quantize` or `dtype` differs from the
    start's serves only if each of its dense vectors for `texts` keeps cosine >= `bar` to the
    start's (the reference, taken from the start's server, which `search` runs first)."""

    def __init__(self, model_id: str, texts: list[str], start: Batching, bar: float) -> None:
        self.model_id, self.texts, self.start, self.bar = model_id, texts, start, bar
        self.reference: list[list[float]] = []

    def check(self, url: str, batching: Batching) -> tuple[dict, str | None]:
        """(what was measured, why this candidate may not serve or None) for the server at `url`.
        The start always serves: without its vectors only the quantize candidates are refused."""
        if batching == self.start:
            if not self.reference:
                self.reference = _dense_vectors(url, self.model_id, self.texts) or []
            return {}, None
        if batching.quantize == self.start.quantize and batching.dtype == self.start.dtype:
            return {}, None
        if not self.reference:
            return {}, "quality gate: the card's own settings gave no vectors to compare with"
        vectors = _dense_vectors(url, self.model_id, self.texts)
        if vectors is None or len(vectors) != len(self.reference):
            return {}, f"quality gate: /v1/embeddings did not give {len(self.reference)} vectors"
        lowest = min_cosine(self.reference, vectors)
        if not math.isfinite(lowest):
            return {}, "quality gate: a vector is not finite"
        quality = dict(min_cosine=round(lowest, 6), texts=len(self.texts))
        if lowest < self.bar:
            return quality, f"quality gate: a vector's cosine to the card's is {lowest:.6f} < {self.bar:g}"
        return quality, None


def _dense_vectors(url: str, model_id: str, texts: list[str]) -> list[list[float]] | None:
    """The server's dense vectors for `texts` (OpenAI route), or None if it did not give them."""
    try:
        answer = httpx.post(f"{url}/v1/embeddings", json={"model": model_id, "input": texts}, timeout=600)
        answer.raise_for_status()
        rows = sorted(answer.json()["data"], key=lambda row: row["index"])
        return [[float(x) for x in row["embedding"]] for row in rows]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
