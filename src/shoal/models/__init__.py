"""Architectures, keyed by the `model_type` of a checkpoint's config.json.

Importing this package does not import torch: entries name their module, loaded on first use.
Each model class offers `config_class.from_dict(config)`, a `weight_map` (checkpoint name
pattern -> parameter name, shard) and `forward(inputs: layers.PackedInputs) -> [T, hidden]`, its
attention through the one seam, `layers.varlen_attention`.
"""

from __future__ import annotations

import importlib
from typing import Any

ARCHITECTURES: dict[str, str] = {
    "bert": "shoal.models.bert:BertModel",
    "distilbert": "shoal.models.distilbert:DistilBertModel",
    "roberta": "shoal.models.roberta:RobertaModel",
    "xlm-roberta": "shoal.models.roberta:RobertaModel",
    "mpnet": "shoal.models.mpnet:MPNetModel",
    "modernbert": "shoal.models.modernbert:ModernBertModel",
    "nomic_bert": "shoal.models.nomic_bert:NomicBertModel",
    "llama": "shoal.models.llama:LlamaModel",
    "qwen2": "shoal.models.llama:LlamaModel",
    "qwen3": "shoal.models.llama:LlamaModel",
    "deberta-v2": "shoal.models.deberta_v2:DebertaV2Model",
    "clip": "shoal.models.clip:ClipModel",
    "siglip": "shoal.models.siglip:SiglipModel",
    "idefics3": "shoal.models.idefics3:Idefics3Model",
}


def model_class(architecture: str) -> Any:
    try:
        target = ARCHITECTURES[architecture]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"architecture {architecture!r} is not implemented; shoal has: {known}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
