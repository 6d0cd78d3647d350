"""DistilBERT (the distilled sparse encoders such as OpenSearch's v2/v3-distill and SPLADE
DistilBERT variants), serve-only and padding-free.

The layer is BERT's post-LayerNorm block tensor for tensor, so this file only renames: config keys
(`dim`, `n_layers`, `hidden_dim`...), checkpoint tensors (`q_lin`, `sa_layer_norm`, `ffn.lin1`...),
no segment embeddings, and the masked-LM head (`vocab_transform`, `vocab_layer_norm`,
`vocab_projector`) for SPLADE output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .bert import BertConfig, BertModel


@dataclass(frozen=True)
class DistilBertConfig(BertConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DistilBertConfig:
        # Sinusoidal position tables are stored in the checkpoint like learned ones; nothing to do.
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["dim"],
            num_hidden_layers=cfg["n_layers"],
            num_attention_heads=cfg["n_heads"],
            intermediate_size=cfg["hidden_dim"],
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            hidden_act=cfg.get("activation", "gelu"),
            type_vocab_size=0,
            layer_norm_eps=1e-12,  # fixed in DistilBERT, not read from config.json
        )


class DistilBertModel(BertModel):
    config_class = DistilBertConfig
    checkpoint_prefixes = ("distilbert.",)
    weight_map = [
        (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight", None),
        (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1", None),
        (r"transformer\.layer\.(\d+)\.attention\.q_lin\.(weight|bias)", r"layers.\1.qkv.\2", 0),
        (r"transformer\.layer\.(\d+)\.attention\.k_lin\.(weight|bias)", r"layers.\1.qkv.\2", 1),
        (r"transformer\.layer\.(\d+)\.attention\.v_lin\.(weight|bias)", r"layers.\1.qkv.\2", 2),
        (r"transformer\.layer\.(\d+)\.attention\.out_lin\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (r"transformer\.layer\.(\d+)\.sa_layer_norm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"transformer\.layer\.(\d+)\.ffn\.lin1\.(weight|bias)", r"layers.\1.ffn_in.\2", None),
        (r"transformer\.layer\.(\d+)\.ffn\.lin2\.(weight|bias)", r"layers.\1.ffn_out.\2", None),
        (r"transformer\.layer\.(\d+)\.output_layer_norm\.(weight|bias)", r"layers.\1.ffn_norm.\2", None),
    ]
    ignored_weights = [r"vocab_.*", r"pre_classifier\..*", r"classifier\..*", r"qa_outputs\..*", r".*position_ids"]

    @staticmethod
    def classifier_layout(config: dict) -> tuple[str, list[tuple]]:
        """DistilBertForSequenceClassification: pre_classifier + ReLU on [CLS], then the classifier."""
        return "cls", [("linear", "pre_classifier"), ("act", "relu"), ("linear", "classifier")]

    mlm_head = {
        "dense": "vocab_transform",
        "norm": "vocab_layer_norm",
        "decoder": "vocab_projector",
        "bias": "vocab_projector.bias",
        "tied": "word_embeddings.weight",
    }
