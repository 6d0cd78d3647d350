"""MPNet (all-mpnet-base-v2 and the sentence-transformers embedders built on it), serve-only and
padding-free.

BERT's post-LayerNorm layer plus a relative-position bias: the distance j - i between a query at
position i and a key at position j falls into one of 32 log-spaced buckets, and one learned table
`[buckets, heads]` (shared by all layers) turns buckets into an additive score bias. The bias is
computed once per forward for positions 0..L-1, in the model's dtype, and handed to attention as
`[H, L, L]` (a `PositionBias`): every length group reads its corner of it, no copy per sequence or
per layer.
Absolute positions are learned too, numbered from the padding index as in RoBERTa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import AttentionMeta, PackedInputs, PositionBias, in_row_blocks, varlen_attention
from .bert import BertConfig, BertLayer

# transformers' MPNet hard-codes these (not read from config.json): the padding index that
# absolute positions start after, and the bucketing of relative positions.
PADDING_IDX = 1
NUM_BUCKETS = 32
MAX_DISTANCE = 128


@dataclass(frozen=True)
class MPNetConfig(BertConfig):
    """BERT's shape fields (MPNet has no token types) plus the size of the relative-bias table."""

    relative_attention_num_buckets: int = NUM_BUCKETS


class MPNetLayer(BertLayer):
    """BERT's layer (q/k/v, output, two post-LayerNorms, GELU FFN) with a score bias in attention."""

    def forward(  # type: ignore[override]  # BERT's forward plus the bias
        self, x: torch.Tensor, meta: AttentionMeta, bias: PositionBias
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.view(T, self.num_heads, self.head_dim) for t in self.qkv.split(x))  # [T, H, D] each
        a = varlen_attention(q, k, v, meta, bias=bias).reshape(T, -1)  # [T, hidden]
        x = self.attn_norm(x + self.attn_out(a))
        return in_row_blocks(self.feed_forward, x, self.ffn_in.out_features, meta.row_block_bytes)


def relative_position_bucket(relative: torch.Tensor) -> torch.Tensor:
    """Bucket of each key-minus-query offset, as transformers' MPNetEncoder computes it (T5-style).

    Half the buckets for each direction; within a half, offsets below 8 get their own bucket and
    larger ones share log-spaced buckets up to MAX_DISTANCE.
    """
    n = -relative  # i - j
    half = NUM_BUCKETS // 2
    bucket = (n < 0).long() * half  # keys after the query use the upper half
    n = n.abs()
    max_exact = half // 2
    # log(0) = -inf at n == 0 is discarded by the `where` below.
    log_ratio = torch.log(n.float() / max_exact) / math.log(MAX_DISTANCE / max_exact)
    large = (max_exact + (log_ratio * (half - max_exact)).long()).clamp(max=half - 1)
    return bucket + torch.where(n < max_exact, n, large)


class MPNetModel(nn.Module):
    config_class = MPNetConfig
    checkpoint_prefixes = ("mpnet.", "model.")
    weight_map = [
        (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight", None),
        (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1", None),
        (r"encoder\.relative_attention_bias\.weight", "relative_attention_bias.weight", None),
        (r"encoder\.layer\.(\d+)\.attention\.attn\.q\.(weight|bias)", r"layers.\1.qkv.\2", 0),
        (r"encoder\.layer\.(\d+)\.attention\.attn\.k\.(weight|bias)", r"layers.\1.qkv.\2", 1),
        (r"encoder\.layer\.(\d+)\.attention\.attn\.v\.(weight|bias)", r"layers.\1.qkv.\2", 2),
        (r"encoder\.layer\.(\d+)\.attention\.attn\.o\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (r"encoder\.layer\.(\d+)\.attention\.LayerNorm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.ffn_in.\2", None),
        (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.ffn_out.\2", None),
        (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.ffn_norm.\2", None),
    ]
    ignored_weights = [r"pooler\..*", r"lm_head\..*", r".*position_ids"]

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        if cfg.relative_attention_num_buckets < NUM_BUCKETS:
            raise ValueError(
                f"MPNet buckets relative positions into {NUM_BUCKETS}; "
                f"relative_attention_num_buckets={cfg.relative_attention_num_buckets} is too few"
            )
        h = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_attention_heads)
        self.layers = nn.ModuleList(MPNetLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def position_bias(self, max_seqlen: int) -> torch.Tensor:
        """Score bias `[H, L, L]` for queries and keys at positions 0..L-1 of any sequence."""
        L, table = max_seqlen, self.relative_attention_bias
        offsets = torch.arange(1 - L, L, device=table.weight.device)  # [2L - 1]: key j minus query i
        per_offset = table(relative_position_bucket(offsets)).T  # [H, 2L - 1]
        # Row i holds offsets -i..L-1-i: the window of L offsets starting at index L-1-i.
        return per_offset.unfold(1, L, 1).flip(1)  # [H, L, L], [h, i, j] = per_offset[h, L-1 + j-i]

    @property
    def max_positions(self) -> int:  # positions start after the padding index
        return self.config.max_position_embeddings - PADDING_IDX - 1

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        # MPNet has no segments: token_type_ids are ignored.
        positions = inputs.position_ids + (PADDING_IDX + 1)  # [T]
        x = self.embed_norm(self.word_embeddings(inputs.input_ids) + self.position_embeddings(positions))  # [T, hidden]
        meta = inputs.meta
        bias = PositionBias(self.position_bias(meta.max_seqlen).to(x.dtype))  # [H, L, L], shared by all layers
        for layer in self.layers:
            x = layer(x, meta, bias)
        return x  # [T, hidden]
