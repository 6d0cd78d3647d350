"""One loaded model on one device: tensors start here.

`forward` takes a padding-free `Batch` and each item's output spec and returns one numpy vector
per item. Only the engine's device thread calls it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..catalog import ModelCard, resolve_weights
from ..heads import finish, pool
from ..layers import AttentionMeta
from ..weights import build_model, estimate_bytes, read_config
from .tokenizer import TextTokenizer
from .types import Batch, EncodeSpec


class ModelRunner:
    def __init__(self, card: ModelCard, model: torch.nn.Module, tokenizer: TextTokenizer, device: str, num_bytes: int) -> None:
        self.card = card
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.num_bytes = num_bytes

    @classmethod
    def load(cls, card: ModelCard, device: str, allow_download: bool = True) -> "ModelRunner":
        directory = resolve_weights(card, allow_download=allow_download)
        return cls.from_dir(card, directory, device)

    @classmethod
    def from_dir(cls, card: ModelCard, directory: Path, device: str) -> "ModelRunner":
        config = read_config(directory)
        max_length = min(card.max_length, int(config.get("max_position_embeddings", card.max_length)))
        tokenizer = TextTokenizer.from_dir(directory, max_length)
        model = build_model(directory, card.architecture, device, card.dtype)
        return cls(card, model, tokenizer, device, estimate_bytes(directory, card.dtype))

    @staticmethod
    def estimate_bytes(card: ModelCard, allow_download: bool = True) -> int:
        return estimate_bytes(resolve_weights(card, allow_download=allow_download), card.dtype)

    @torch.inference_mode()
    def forward(self, batch: Batch, specs: list[EncodeSpec]) -> list[np.ndarray]:
        to = dict(device=self.device, non_blocking=True)
        input_ids = torch.from_numpy(batch.input_ids).to(**to)  # [T]
        position_ids = torch.from_numpy(batch.position_ids).to(**to)  # [T]
        cu_seqlens = torch.from_numpy(batch.cu_seqlens).to(**to)  # [n+1]
        meta = AttentionMeta.build(cu_seqlens, batch.max_seqlen)
        hidden = self.model(input_ids, position_ids, meta)  # [T, hidden]
        pooled = pool(hidden, meta, self.card.pooling).float().cpu().numpy()  # [n, hidden]
        return [
            finish(vector, dimensions=spec.dimensions, normalize=spec.normalize, output_dtype=spec.output_dtype)
            for vector, spec in zip(pooled, specs)
        ]

    def close(self) -> None:
        """Called on eviction. A batch already running keeps its reference until it finishes."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
