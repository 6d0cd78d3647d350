"""Heads over packed encoder output: pooling, then per-item Matryoshka truncation, normalisation and
output dtype.

Pooling works on `[T, hidden]` with the batch's `AttentionMeta`; post-processing works on numpy
vectors, one per item, since each request may ask for different dimensions and dtypes.
"""

from __future__ import annotations

import numpy as np
import torch

from .layers import AttentionMeta


def pool(hidden: torch.Tensor, meta: AttentionMeta, method: str) -> torch.Tensor:
    """`[T, hidden]` -> `[n, hidden]`, one vector per sequence."""
    starts, ends = meta.cu_seqlens[:-1].long(), meta.cu_seqlens[1:].long()
    if method == "cls":
        return hidden[starts]
    if method == "last":
        return hidden[ends - 1]
    if method == "mean":
        sums = hidden.new_zeros(meta.num_seqs, hidden.shape[1]).index_add_(0, meta.seq_index, hidden)
        return sums / (ends - starts).to(hidden.dtype)[:, None]
    raise ValueError(f"unknown pooling {method!r}")


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


# --- sparse and multi-vector heads --------------------------------------------------------------


class MaskedLMHead(torch.nn.Module):
    """An encoder's masked-LM head: dense -> activation -> LayerNorm -> vocabulary logits.

    The decoder weight is the word-embedding matrix when the checkpoint ties them.
    """

    def __init__(self, dense_weight, dense_bias, norm_weight, norm_bias, decoder_weight, decoder_bias, act, eps: float):
        super().__init__()
        self.dense_weight, self.dense_bias = dense_weight, dense_bias  # [h, h], [h]
        self.norm_weight, self.norm_bias = norm_weight, norm_bias  # [h], [h]
        self.decoder_weight, self.decoder_bias = decoder_weight, decoder_bias  # [V, h], [V]
        self.act, self.eps = act, eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [t, h] -> [t, V]
        x = self.act(torch.nn.functional.linear(hidden, self.dense_weight, self.dense_bias))
        x = torch.nn.functional.layer_norm(x, x.shape[-1:], self.norm_weight, self.norm_bias, self.eps)
        return torch.nn.functional.linear(x, self.decoder_weight, self.decoder_bias)


def splade(hidden: torch.Tensor, meta: AttentionMeta, mlm: MaskedLMHead, chunk_tokens: int = 2048) -> torch.Tensor:
    """SPLADE term weights: max over each sequence of log(1 + relu(logits)). `[T, h]` -> `[n, V]`.

    Logits are computed `chunk_tokens` rows at a time so a large batch never holds `[T, V]`.
    """
    out: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        weights = torch.log1p(torch.relu(mlm(hidden[start : start + chunk_tokens])))  # [t, V]
        if out is None:
            out = weights.new_zeros(meta.num_seqs, weights.shape[1])
        index = meta.seq_index[start : start + chunk_tokens, None].expand_as(weights)
        out.scatter_reduce_(0, index, weights, reduce="amax")  # weights >= 0, so zeros are neutral
    return out


def token_weights(hidden: torch.Tensor, input_ids: torch.Tensor, meta: AttentionMeta, weight, bias, vocab_size: int,
                  skip_ids: torch.Tensor) -> torch.Tensor:
    """BGE-M3-style sparse weights: relu(linear(h)) per token, max per token id. `[T, h]` -> `[n, V]`."""
    w = torch.relu(torch.nn.functional.linear(hidden, weight, bias)).squeeze(-1)  # [T]
    w = w.masked_fill(torch.isin(input_ids, skip_ids), 0.0)
    out = w.new_zeros(meta.num_seqs, vocab_size)
    flat = meta.seq_index * vocab_size + input_ids  # [T] index into [n * V]
    out.view(-1).scatter_reduce_(0, flat, w, reduce="amax")
    return out


def sparse_entries(weights: np.ndarray, top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Non-zero entries of one `[V]` row, heaviest first, at most `top_k`: (indices int32, values float32)."""
    indices = np.flatnonzero(weights > 0)
    values = weights[indices]
    order = np.argsort(-values, kind="stable")
    if top_k is not None:
        order = order[:top_k]
    return indices[order].astype(np.int32), values[order].astype(np.float32)
