"""Finishing one pooled float32 vector for the wire: Matryoshka truncation, normalisation and
output dtype. numpy only, so torch-free code (a stand-in service, the SDK) computes exactly what
the engine's dense head does.
"""

from __future__ import annotations

import numpy as np

OUTPUT_DTYPES = ("float32", "float16", "int8", "binary")


def finish(vector: np.ndarray, *, dimensions: int | None, normalize: bool, output_dtype: str) -> np.ndarray:
    """Truncate (Matryoshka: before normalising), normalise, and cast one float32 vector.

    int8 scales each vector symmetrically so its largest component is ±127 (cosine similarity is
    kept; absolute scale is not). binary packs the sign bits, 8 dimensions a byte, big-endian bit
    order as numpy's packbits; the last byte is zero-padded.
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
    if output_dtype == "binary":
        return np.packbits(v > 0)
    raise ValueError(f"unknown output dtype {output_dtype!r}")
