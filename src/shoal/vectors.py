"""Vector arithmetic shared by the engine and torch-free code (a stand-in service, the SDK): finishing
one pooled float32 vector for the wire (Matryoshka truncation, normalisation, output dtype) and
late-interaction (MaxSim) scoring. numpy only, so both sides compute exactly the same thing.
"""

from __future__ import annotations

import numpy as np

OUTPUT_DTYPES = ("float32", "float16", "int8", "binary", "ubinary")


def finish(vector: np.ndarray, *, dimensions: int | None, normalize: bool, output_dtype: str) -> np.ndarray:
    """Truncate (Matryoshka: before normalising), normalise, and cast one float32 vector.

    int8 scales each vector symmetrically so its largest component is ±127 (cosine similarity is
    kept; absolute scale is not). ubinary packs the sign bits (> 0), 8 dimensions a byte,
    big-endian bit order as numpy's packbits, the last byte zero-padded, as uint8; binary is
    ubinary - 128 as int8. Both mean what sentence-transformers' `quantize_embeddings` precisions
    of the same names mean (and Cohere's embedding types).
    """
    v = vector[:dimensions] if dimensions else vector
    if normalize:
        norm = float(np.linalg.norm(v))
        v = v / max(norm, 1e-12)
    if output_dtype == "float32":
        return np.ascontiguousarray(v, dtype=np.float32)
    if output_dtype == "float16":
        return v.astype(np.float16)
    if output_dtype == "int8":
        peak = float(np.abs(v).max()) or 1.0
        return np.clip(np.rint(v * (127.0 / peak)), -127, 127).astype(np.int8)
    if output_dtype == "ubinary":
        return np.packbits(v > 0)
    if output_dtype == "binary":
        return (np.packbits(v > 0).astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown output dtype {output_dtype!r}")


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Late-interaction (ColBERT) relevance: for each query vector the largest dot product with any
    document vector, summed over the query. `query` `[q, d]`, `document` `[t, d]`; an empty document
    scores 0. Vectors are used as given (ColBERT's are unit length, so dot products are cosines)."""
    if query.ndim != 2 or document.ndim != 2 or query.shape[1] != document.shape[1]:
        raise ValueError(f"maxsim takes [q, d] and [t, d] arrays, got {query.shape} and {document.shape}")
    if query.shape[0] == 0 or document.shape[0] == 0:
        return 0.0
    similarities = query.astype(np.float32, copy=False) @ document.astype(np.float32, copy=False).T  # [q, t]
    return float(similarities.max(axis=1).sum(dtype=np.float64))
