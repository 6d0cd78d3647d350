"""One loaded model on one device: tensors start here (the torch backend).

`forward` takes a padding-free `Batch` and each sequence's spec, runs the encoder once, and lets
each head that some sequence asked for turn the hidden states into per-sequence outputs. Only the
device thread calls it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..calls import EncodedItem
from ..catalog import ModelCard, resolve_weights
from ..heads import BuildContext, Hidden, build_heads
from ..layers import AttentionMeta
from ..weights import build_model, estimate_bytes
from .tokenizer import TextTokenizer
from .types import Batch, EncodeSpec, ExtractSpec, ScoreSpec


class ModelRunner:
    def __init__(self, card: ModelCard, model: torch.nn.Module, tokenizer: TextTokenizer, device: str,
                 num_bytes: int, directory: Path | None = None) -> None:
        self.card = card
        self.model = model
        self.device = torch.device(device)
        self.num_bytes = num_bytes
        self.tokenizer = self.document_tokenizer = self.query_tokenizer = tokenizer
        dtype = next(model.parameters()).dtype
        self.heads = build_heads(BuildContext(card, model, directory, tokenizer, dict(device=self.device, dtype=dtype)))
        for head in self.heads.values():  # late-interaction heads mark queries and documents
            if hasattr(head, "tokenizers"):
                self.query_tokenizer, self.document_tokenizer = head.tokenizers()

    @classmethod
    def load(cls, card: ModelCard, device: str, allow_download: bool = True) -> "ModelRunner":
        directory = resolve_weights(card, allow_download=allow_download)
        return cls.from_dir(card, directory, device, allow_download)

    @classmethod
    def from_dir(cls, card: ModelCard, directory: Path, device: str, allow_download: bool = True) -> "ModelRunner":
        if card.extract is not None and card.extract.kind == "gliner":
            from .gliner_files import load_gliner_backbone

            model, tokenizer = load_gliner_backbone(card, directory, device, allow_download)
            return cls(card, model, tokenizer, device, estimate_bytes(directory, card.dtype), directory)
        model = build_model(directory, card.architecture, device, card.dtype)
        # Models with a learned position table cannot take more tokens than it has rows.
        max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
        tokenizer = TextTokenizer.from_dir(directory, max_length)
        return cls(card, model, tokenizer, device, estimate_bytes(directory, card.dtype), directory)

    @staticmethod
    def estimate_bytes(card: ModelCard, allow_download: bool = True) -> int:
        return estimate_bytes(resolve_weights(card, allow_download=allow_download), card.dtype)

    @torch.inference_mode()
    def forward(self, batch: Batch, specs: list[EncodeSpec | ScoreSpec | ExtractSpec]) -> list:
        to = dict(device=self.device, non_blocking=True)
        input_ids = torch.from_numpy(batch.input_ids).to(**to)  # [T]
        position_ids = torch.from_numpy(batch.position_ids).to(**to)  # [T]
        cu_seqlens = torch.from_numpy(batch.cu_seqlens).to(**to)  # [n+1]
        key_lengths = None if batch.key_lengths is None else torch.from_numpy(batch.key_lengths).to(**to)  # [n]
        meta = AttentionMeta.build(cu_seqlens, batch.max_seqlen, key_lengths)
        token_type_ids = None if batch.token_type_ids is None else torch.from_numpy(batch.token_type_ids).to(**to)
        states = self.model(input_ids, position_ids, meta, token_type_ids)  # [T, hidden]
        hidden = Hidden(states, input_ids, meta)

        wanted = {name for spec in specs for name in spec.outputs}
        per_head = {name: head.run(hidden, specs) for name, head in self.heads.items() if name in wanted}
        none = [None] * len(specs)
        return [EncodedItem(dense=per_head.get("dense", none)[i], sparse=per_head.get("sparse", none)[i],
                            multivector=per_head.get("multivector", none)[i]) if isinstance(spec, EncodeSpec)
                else per_head[spec.outputs[0]][i] for i, spec in enumerate(specs)]

    def close(self) -> None:
        """Called on eviction. A batch already running keeps its reference until it finishes."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
