"""One loaded model on one device: tensors start here.

`forward` takes a padding-free `Batch` and each item's spec, runs the encoder once, and computes
only the outputs some item asked for (dense, sparse, multivector). Only the engine's device thread
calls it.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch

from ..catalog import ModelCard, resolve_weights
from ..errors import ModelLoadError
from ..heads import MaskedLMHead, finish, pool, sparse_entries, splade, token_weights
from ..layers import AttentionMeta, activation
from ..weights import build_model, estimate_bytes, load_tensors
from .tokenizer import TextTokenizer
from .types import Batch, EncodeSpec, ItemResult, SparseVector


class ModelRunner:
    def __init__(self, card: ModelCard, model: torch.nn.Module, tokenizer: TextTokenizer, device: str,
                 num_bytes: int, directory: Path | None = None) -> None:
        self.card = card
        self.model = model
        self.device = torch.device(device)
        self.num_bytes = num_bytes
        # Queries and documents differ only for late-interaction cards (markers, augmentation).
        self.tokenizer = self.document_tokenizer = self.query_tokenizer = tokenizer
        self._mlm: MaskedLMHead | None = None
        self._sparse_linear: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._projection: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if directory is not None:
            self._build_heads(directory)

    @classmethod
    def load(cls, card: ModelCard, device: str, allow_download: bool = True) -> "ModelRunner":
        directory = resolve_weights(card, allow_download=allow_download)
        return cls.from_dir(card, directory, device)

    @classmethod
    def from_dir(cls, card: ModelCard, directory: Path, device: str) -> "ModelRunner":
        model = build_model(directory, card.architecture, device, card.dtype)
        # Models with a learned position table cannot take more tokens than it has rows.
        max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
        tokenizer = TextTokenizer.from_dir(directory, max_length)
        return cls(card, model, tokenizer, device, estimate_bytes(directory, card.dtype), directory)

    @staticmethod
    def estimate_bytes(card: ModelCard, allow_download: bool = True) -> int:
        return estimate_bytes(resolve_weights(card, allow_download=allow_download), card.dtype)

    # --- heads ----------------------------------------------------------------------------------

    def _build_heads(self, directory: Path) -> None:
        card, dtype = self.card, next(self.model.parameters()).dtype
        to = dict(device=self.device, dtype=dtype)
        self._skip_ids = torch.tensor(self.tokenizer.special_ids(), dtype=torch.long, device=self.device)
        if "sparse" in card.outputs and card.sparse_spec.kind == "splade":
            self._mlm = _mlm_head(self.model, directory, to)
        if "sparse" in card.outputs and card.sparse_spec.kind == "token_weights":
            spec = card.sparse_spec
            t = load_tensors(directory, [n for n in (spec.weight, spec.bias) if n], spec.file)
            self._sparse_linear = (t[spec.weight].to(**to), t[spec.bias].to(**to) if spec.bias else None)
        mv = card.multivector
        if "multivector" in card.outputs and mv is not None:
            t = load_tensors(directory, [n for n in (mv.weight, mv.bias) if n], mv.file)
            self._projection = (t[mv.weight].to(**to), t[mv.bias].to(**to) if mv.bias else None)
            base = self.tokenizer
            if mv.query_marker or mv.query_length:
                length = min(mv.query_length or base.max_length, base.max_length)
                self.query_tokenizer = base.variant(length, marker=mv.query_marker,
                                                    expand_to=mv.query_length, expand_token=mv.mask_token)
            if mv.document_marker:
                self.document_tokenizer = base.variant(base.max_length, marker=mv.document_marker)
            self._punctuation_ids = torch.tensor(base.token_ids(string.punctuation), device=self.device)

    # --- forward --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: Batch, specs: list[EncodeSpec]) -> list[ItemResult]:
        to = dict(device=self.device, non_blocking=True)
        input_ids = torch.from_numpy(batch.input_ids).to(**to)  # [T]
        position_ids = torch.from_numpy(batch.position_ids).to(**to)  # [T]
        cu_seqlens = torch.from_numpy(batch.cu_seqlens).to(**to)  # [n+1]
        meta = AttentionMeta.build(cu_seqlens, batch.max_seqlen)
        hidden = self.model(input_ids, position_ids, meta)  # [T, hidden]

        wanted = {name for spec in specs for name in spec.outputs}
        dense = pool(hidden, meta, self.card.pooling).float().cpu().numpy() if "dense" in wanted else None  # [n, h]
        sparse = self._sparse(hidden, input_ids, meta) if "sparse" in wanted else None  # [n, V]
        multivector = self._multivector(hidden, input_ids, meta, specs) if "multivector" in wanted else None

        results = []
        for i, spec in enumerate(specs):
            results.append(ItemResult(
                dense=finish(dense[i], dimensions=spec.dimensions, normalize=spec.normalize,
                             output_dtype=spec.output_dtype) if "dense" in spec.outputs else None,
                sparse=self._sparse_item(sparse[i], spec) if "sparse" in spec.outputs else None,
                multivector=multivector[i] if "multivector" in spec.outputs else None,
            ))
        return results

    def _sparse(self, hidden, input_ids, meta) -> np.ndarray:
        if self._mlm is not None:
            weights = splade(hidden, meta, self._mlm)
        else:
            weight, bias = self._sparse_linear
            skip = self._skip_ids if self.card.sparse_spec.skip_special_tokens else self._skip_ids[:0]
            weights = token_weights(hidden, input_ids, meta, weight, bias, self.tokenizer.vocab_size, skip)
        return weights.float().cpu().numpy()

    def _sparse_item(self, row: np.ndarray, spec: EncodeSpec) -> SparseVector:
        indices, values = sparse_entries(row, spec.sparse_top_k or self.card.sparse_spec.top_k)
        tokens = [self.tokenizer.token(i) for i in indices] if spec.return_tokens else None
        return SparseVector(indices, values, tokens)

    def _multivector(self, hidden, input_ids, meta, specs) -> list[np.ndarray]:
        mv = self.card.multivector
        weight, bias = self._projection
        vectors = torch.nn.functional.linear(hidden, weight, bias)  # [T, dim]
        if mv.normalize:
            vectors = torch.nn.functional.normalize(vectors.float(), dim=-1)
        keep = torch.ones_like(input_ids, dtype=torch.bool)  # [T]
        if mv.skip_first:
            keep &= meta.pos_in_seq > 0
        if mv.skip_punctuation:
            is_document = torch.tensor([not s.is_query for s in specs], device=self.device)[meta.seq_index]
            keep &= ~(is_document & torch.isin(input_ids, self._punctuation_ids))
        vectors, keep = vectors.float().cpu().numpy(), keep.cpu().numpy()
        bounds = meta.cu_seqlens.tolist()
        return [vectors[a:b][keep[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]

    def close(self) -> None:
        """Called on eviction. A batch already running keeps its reference until it finishes."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _mlm_head(model: torch.nn.Module, directory: Path, to: dict) -> MaskedLMHead:
    names = getattr(model, "mlm_head", None)
    if names is None:
        raise ValueError(f"{type(model).__name__} has no masked-LM head for SPLADE output")
    required = [f"{names['dense']}.weight", f"{names['dense']}.bias", f"{names['norm']}.weight",
                f"{names['norm']}.bias", names["bias"]]
    t = load_tensors(directory, required)
    try:
        decoder = load_tensors(directory, [f"{names['decoder']}.weight"])[f"{names['decoder']}.weight"]
    except ModelLoadError:  # tied: the checkpoint stores the matrix once, as the word embeddings
        decoder = model.get_parameter(names["tied"])
    cfg = model.config
    return MaskedLMHead(
        t[required[0]].to(**to), t[required[1]].to(**to), t[required[2]].to(**to), t[required[3]].to(**to),
        decoder.to(**to), t[required[4]].to(**to),
        activation(cfg.hidden_act), cfg.layer_norm_eps,
    )
