"""Sparse (lexical) heads: one weight per vocabulary entry, over packed encoder output.

- `SpladeHead`: the architecture's masked-LM head, log(1 + relu(logits)), max over the sequence.
- `TokenWeightsHead`: relu(linear(hidden)) per token, max per token id (BGE-M3's lexical weights).

Both zero the vocabulary entries the card skips (`Sparse.skips_special_tokens`, `skip_tokens`), as
the model's reference does: OpenSearch's neural sparse models zero every special token, BGE-M3
its [CLS], [SEP]/EOS, [PAD] and [UNK] entries (not <mask>).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..calls import SparseVector
from ..errors import ModelLoadError
from ..layers import AttentionMeta, activation
from ..weights import load_tensors


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
    assert out is not None  # a batch has tokens
    return out


def token_weights(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    meta: AttentionMeta,
    weight,
    bias,
    vocab_size: int,
    skip_ids: torch.Tensor,
) -> torch.Tensor:
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


class _SparseHead:
    output = "sparse"

    def __init__(self, tokenizer, default_top_k: int | None) -> None:
        self.tokenizer = tokenizer
        self.default_top_k = default_top_k

    def weights(self, hidden) -> torch.Tensor:  # [n, V]
        raise NotImplementedError

    def workspace_bytes(self, num_tokens: int, max_items: int = 256) -> int:
        """Scratch of one batch: the `[n, V]` float weights (engine/measure.py)."""
        return max_items * self.tokenizer.vocab_size * 4

    def run(self, hidden, specs) -> list[SparseVector | None]:
        rows = self.weights(hidden).float().cpu().numpy()
        out: list[SparseVector | None] = []
        for row, spec in zip(rows, specs):
            if "sparse" not in spec.outputs:
                out.append(None)
                continue
            indices, values = sparse_entries(row, spec.sparse_top_k or self.default_top_k)
            tokens = [self.tokenizer.token(i) for i in indices] if spec.return_tokens else None
            out.append(SparseVector(indices, values, tokens))
        return out


class SpladeHead(_SparseHead):
    def __init__(self, mlm: MaskedLMHead, skip_ids, tokenizer, default_top_k: int | None) -> None:
        super().__init__(tokenizer, default_top_k)
        self.mlm, self.skip_ids = mlm, skip_ids  # skip_ids [s]

    @classmethod
    def build(cls, ctx) -> SpladeHead:
        return cls(
            _mlm_head(ctx.model, ctx.directory, ctx.to), _skip_ids(ctx), ctx.tokenizer, ctx.card.sparse_spec.top_k
        )

    def workspace_bytes(self, num_tokens: int, max_items: int = 256) -> int:
        """Also the chunk of `[t, V]` logits `splade` holds, twice (the logits and their log1p)."""
        return (
            super().workspace_bytes(num_tokens, max_items) + 2 * min(num_tokens, 2048) * self.tokenizer.vocab_size * 4
        )

    def weights(self, hidden) -> torch.Tensor:
        out = splade(hidden.states, hidden.meta, self.mlm)  # [n, V]
        out[:, self.skip_ids] = 0.0
        return out


class TokenWeightsHead(_SparseHead):
    def __init__(self, weight, bias, skip_ids, tokenizer, default_top_k: int | None) -> None:
        super().__init__(tokenizer, default_top_k)
        self.weight, self.bias, self.skip_ids = weight, bias, skip_ids  # [1, h], [1] | None, [s]

    @classmethod
    def build(cls, ctx) -> TokenWeightsHead:
        spec = ctx.card.sparse_spec
        t = load_tensors(ctx.directory, [n for n in (spec.weight, spec.bias) if n], spec.file)
        return cls(
            t[spec.weight].to(**ctx.to),
            t[spec.bias].to(**ctx.to) if spec.bias else None,
            _skip_ids(ctx),
            ctx.tokenizer,
            spec.top_k,
        )

    def weights(self, hidden) -> torch.Tensor:
        return token_weights(
            hidden.states,
            hidden.input_ids,
            hidden.meta,
            self.weight,
            self.bias,
            self.tokenizer.vocab_size,
            self.skip_ids,
        )


def _skip_ids(ctx) -> torch.Tensor:
    """`[s]` ids of the vocabulary entries the card zeroes (a named token missing from the
    vocabulary fails the load)."""
    spec = ctx.card.sparse_spec
    skip = set(ctx.tokenizer.special_ids()) if spec.skips_special_tokens else set()
    skip.update(ctx.tokenizer.token_id(token) for token in spec.skip_tokens)
    return torch.tensor(sorted(skip), dtype=torch.long, device=ctx.to["device"])


def _mlm_head(model: torch.nn.Module, directory, to: dict) -> MaskedLMHead:
    names = getattr(model, "mlm_head", None)
    if names is None:
        raise ModelLoadError(f"{type(model).__name__} has no masked-LM head for SPLADE output")
    required = [
        f"{names['dense']}.weight",
        f"{names['dense']}.bias",
        f"{names['norm']}.weight",
        f"{names['norm']}.bias",
        names["bias"],
    ]
    t = load_tensors(directory, required)
    try:
        decoder = load_tensors(directory, [f"{names['decoder']}.weight"])[f"{names['decoder']}.weight"]
    except ModelLoadError:  # tied: the checkpoint stores the matrix once, as the word embeddings
        decoder = model.get_parameter(names["tied"])
    cfg: Any = model.config  # the architecture's config dataclass
    return MaskedLMHead(
        t[required[0]].to(**to),
        t[required[1]].to(**to),
        t[required[2]].to(**to),
        t[required[3]].to(**to),
        decoder.to(**to),
        t[required[4]].to(**to),
        activation(cfg.hidden_act),
        cfg.layer_norm_eps,
    )
