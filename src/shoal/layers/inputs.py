"""What every model's forward takes: one padding-free batch, as tensors on the model's device.

`PackedInputs` is the model side of the engine's `Batch` (engine/types.py): the batch's sequences
packed back to back, T tokens in all, their boundaries in `meta` (read by attention only). Token
ids are one slot; other modalities add theirs to `features` by name (an image's patch pixels, say),
so a new modality is a new model file reading a new key, not a new forward signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .attention_meta import AttentionMeta


@dataclass(frozen=True)
class PackedInputs:
    """One packed batch: `model(inputs) -> [T, hidden]`.

    `features` holds inputs beside token ids, by slot name: `name` -> its rows `[R, ...]` (an
    image's patches: `[P, C * p * p]`), and `name + "_cu_rows"` -> `[n+1]` where each sequence's
    rows start (as `cu_seqlens` does for tokens; the engine's `Batch.features` slots, moved to the
    device by the runner). Empty for text. A model reads the slots it knows and ignores the rest.
    """

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for each sequence
    meta: AttentionMeta  # sequence boundaries: cu_seqlens [n+1], max_seqlen, length groups
    token_type_ids: torch.Tensor | None = None  # [T] int64 segment ids (sentence pairs); None: all 0
    features: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
