"""Token-classification head (NER): the checkpoint's `classifier` linear over every token's final
hidden state, as `BertForTokenClassification`, `DistilBertForTokenClassification`,
`RobertaForTokenClassification` and `DebertaV2ForTokenClassification` apply it (no pooler; their
dropout is a no-op at inference).

It works on packed states `[T, hidden]`; turning its logits into entity spans is
`shoal.spans.aggregate_entities` (numpy only); `run` returns each sequence's logits `[n, labels]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..head_info import TokenLabels
from ..weights import load_tensors, read_config


class TokenClassHead:
    output = "token_logits"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, id2label: dict[int, str]) -> None:
        self.weight = weight  # [labels, hidden]
        self.bias = bias  # [labels] or None
        self.id2label = id2label

    @property
    def num_labels(self) -> int:
        return int(self.weight.shape[0])

    def describe(self) -> TokenLabels:
        return TokenLabels(dict(self.id2label))

    @classmethod
    def build(cls, ctx) -> TokenClassHead:
        config = read_config(ctx.directory)
        raw = config.get("id2label")
        if not isinstance(raw, dict) or not raw:
            raise ModelLoadError(
                f"{ctx.directory}/config.json has no id2label for token classification", details={"file": "config.json"}
            )
        try:
            id2label = {int(k): str(v) for k, v in raw.items()}
        except ValueError:
            raise ModelLoadError(
                f"{ctx.directory}/config.json: id2label keys must be integers", details={"file": "config.json"}
            ) from None
        prefixes = getattr(ctx.model, "checkpoint_prefixes", ("bert.", "model."))
        weight = load_tensors(ctx.directory, ["classifier.weight"], prefixes=prefixes)["classifier.weight"]
        try:
            bias = load_tensors(ctx.directory, ["classifier.bias"], prefixes=prefixes)["classifier.bias"]
        except ModelLoadError:  # a bias-free classifier
            bias = None
        if weight.ndim != 2 or sorted(id2label) != list(range(weight.shape[0])):
            raise ModelLoadError(
                f"{ctx.directory}: classifier.weight {tuple(weight.shape)} does not match "
                f"the {len(id2label)} labels of config.json's id2label",
                details={"file": "config.json"},
            )
        return cls(weight.to(**ctx.to), None if bias is None else bias.to(**ctx.to), id2label)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[T, labels]` float32 logits, one row per packed token."""
        return F.linear(states, self.weight, self.bias).float()

    def run(self, hidden, specs) -> list:
        logits = self.logits(hidden.states).cpu().numpy()  # [T, labels]
        bounds = hidden.meta.cu_seqlens.tolist()
        return [logits[bounds[i] : bounds[i + 1]] if "token_logits" in s.outputs else None for i, s in enumerate(specs)]
