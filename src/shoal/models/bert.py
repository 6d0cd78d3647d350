"""BERT (and the MiniLM, BGE, E5 and GTE embedders built on it), serve-only and padding-free.

Post-LayerNorm encoder with absolute learned positions. Every tensor outside attention is packed:
`[T, hidden]` over the T real tokens of the batch; sequence boundaries reach attention only,
through `AttentionMeta`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers import AttentionMeta, FusedLinear, PackedInputs, activation, in_row_blocks, varlen_attention


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> BertConfig:
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with position_embedding_type={cfg['position_embedding_type']!r} is not supported")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in cfg.items() if k in names})


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.qkv = FusedLinear(h, (h, h, h))
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.view(T, self.num_heads, self.head_dim) for t in self.qkv.split(x))  # [T, H, D] each
        a = varlen_attention(q, k, v, meta).reshape(T, -1)  # [T, hidden]
        x = self.attn_norm(x + self.attn_out(a))
        return in_row_blocks(self.feed_forward, x, self.ffn_in.out_features, meta.row_block_bytes)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN and its residual and norm, per token: `[t, hidden]` -> `[t, hidden]`."""
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertModel(nn.Module):
    config_class = BertConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    # Names are matched after the "bert." / "model." prefixes are stripped.
    weight_map = [
        (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight", None),
        (r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight", None),
        (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1", None),
        (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"layers.\1.qkv.\2", 0),
        (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"layers.\1.qkv.\2", 1),
        (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"layers.\1.qkv.\2", 2),
        (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.ffn_in.\2", None),
        (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.ffn_out.\2", None),
        (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.ffn_norm.\2", None),
    ]
    # Checkpoint tensors a serve-only encoder does not use.
    ignored_weights = [r"pooler\..*", r"cls\..*", r".*position_ids"]
    # The masked-LM head, read only when a card asks for SPLADE output: checkpoint module names;
    # the decoder falls back to the tied word embeddings when the checkpoint omits it.
    mlm_head = {
        "dense": "cls.predictions.transform.dense",
        "norm": "cls.predictions.transform.LayerNorm",
        "decoder": "cls.predictions.decoder",
        "bias": "cls.predictions.bias",
        "tied": "word_embeddings.weight",
    }

    @staticmethod
    def classifier_layout(config: dict[str, Any]) -> tuple[str, list[tuple]]:
        """BertForSequenceClassification's head, as (pooling, steps) over checkpoint module names:
        the pooler (dense + tanh on [CLS]), then the classifier (read by heads/score.py)."""
        return "cls", [("linear", "pooler.dense"), ("act", "tanh"), ("linear", "classifier")]

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        # DistilBERT has no segments (type_vocab_size 0).
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h) if cfg.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    @property
    def max_positions(self) -> int:
        """The longest sequence the position table covers (the runner caps max_length by it)."""
        return self.config.max_position_embeddings

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        # position_ids index the position table; token_type_ids: segment A/B for sentence pairs.
        x = self.word_embeddings(inputs.input_ids) + self.position_embeddings(inputs.position_ids)  # [T, hidden]
        if self.token_type_embeddings is not None:
            if inputs.token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(inputs.token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, inputs.meta)
        return x  # [T, hidden]
