"""SigLIP (and the fixed-resolution SigLIP 2 checkpoints, which share its `model_type`),
serve-only and padding-free: a bidirectional text transformer and a ViT without a class token
(vit.py), each ending in its own head.

- text: token + learned positions, pre-LN layers attending both ways, a final norm, the state of
  each sequence's last token, the `head` linear. SigLIP was trained on texts padded to 64 tokens
  that attend to their padding: its processor pads so (`padding="max_length"`), and an embedding
  equals the reference only for the same padded ids.
- vision: patch embeddings + learned positions, the layers, `post_layernorm`, then attention
  pooling (`AttentionPooling`: one learned query, the probe, attending over the image's tokens).

Embeddings come out as `SiglipModel.get_text_features` / `get_image_features` give them, not
normalized; `logits` scores them as `SiglipModel` does: cosine times `exp(logit_scale)` plus
`logit_bias`, whose sigmoid is the match probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import AttentionMeta
from .vit import (
    DualEncoder,
    DualEncoderConfig,
    TextTowerConfig,
    TextTransformer,
    VisionTowerConfig,
    VisionTransformer,
    tower_activation,
    tower_dicts,
)

# transformers' SiglipTextConfig / SiglipVisionConfig defaults, for keys a config.json leaves out
# (google/siglip-* configs give little more than the sizes).
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=16,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)


@dataclass(frozen=True)
class SiglipConfig(DualEncoderConfig):
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SiglipConfig:
        text, vision = tower_dicts(cfg)
        if not vision.get("vision_use_head", True):
            raise ValueError(
                "SigLIP without the vision attention-pooling head (vision_use_head: false) is not supported"
            )
        # The text head projects to `projection_size`, by default the text width.
        text_defaults = {**_TEXT_DEFAULTS, "projection_size": text.get("hidden_size", _TEXT_DEFAULTS["hidden_size"])}
        out = cls(TextTowerConfig.from_dict(text, text_defaults), VisionTowerConfig.from_dict(vision, _VISION_DEFAULTS))
        if out.text.projection_size != out.vision.hidden_size:
            raise ValueError(
                f"SigLIP whose text head ({out.text.projection_size}) and image embeddings "
                f"({out.vision.hidden_size}) differ in width is not supported"
            )
        return out


class AttentionPooling(nn.Module):
    """SigLIP's vision head (transformers' `SiglipMultiheadAttentionPoolingHead`): a learned query
    attends over each image's tokens (torch `MultiheadAttention`'s projections, q | k | v stacked
    in `in_proj`), then a pre-norm MLP with its residual: `[n, L, hidden]` -> `[n, hidden]`."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.probe = nn.Parameter(torch.empty(1, 1, h))
        # One Linear as the checkpoint stores it; its q rows are wasted on the image tokens, one
        # [hidden, hidden] product per token, a small share of the layers' work.
        self.in_proj = nn.Linear(h, 3 * h)
        self.out_proj = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act = tower_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, h = x.shape
        H = self.num_heads
        D = h // H
        q = self.in_proj(self.probe.view(1, h))[:, :h].view(H, 1, D)  # [H, 1, D], the same for every image
        k, v = self.in_proj(x.flatten(0, 1))[:, h:].view(n, L, 2, H, D).unbind(2)  # [n, L, H, D] each
        scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * D**-0.5  # [n, H, 1, L]
        a = torch.matmul(scores.softmax(-1), v.transpose(1, 2))  # [n, H, 1, D]
        a = self.out_proj(a.reshape(n, h))  # [n, hidden]
        return a + self.fc2(self.act(self.fc1(self.norm(a))))


class SiglipModel(DualEncoder):
    config_class = SiglipConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    weight_map = [
        *TextTransformer.weights("text_model", "text"),
        (r"text_model\.head\.(weight|bias)", r"text_head.\1", None),
        *VisionTransformer.weights("vision_model", "vision"),
        (r"vision_model\.post_layernorm\.(weight|bias)", r"vision_norm.\1", None),
        (r"vision_model\.head\.probe", "pool.probe", None),
        (r"vision_model\.head\.attention\.in_proj_(weight|bias)", r"pool.in_proj.\1", None),
        (r"vision_model\.head\.attention\.out_proj\.(weight|bias)", r"pool.out_proj.\1", None),
        (r"vision_model\.head\.layernorm\.(weight|bias)", r"pool.norm.\1", None),
        (r"vision_model\.head\.mlp\.(fc1|fc2)\.(weight|bias)", r"pool.\1.\2", None),
        (r"logit_(scale|bias)", r"logit_\1", None),
    ]
    ignored_weights = [r".*position_ids"]
    # Texts are padded with the pad token to the text tower's length, as SiglipProcessor pads them
    # (`padding="max_length"`), and the last position (a pad, for a short text) is pooled; the pads
    # are no token's keys, as transformers applies the attention mask its tokenizer gives. The
    # engine's tokenizer pads for it.
    pads_texts = True

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.config = cfg
        self.text = TextTransformer(cfg.text, causal=False)
        assert cfg.text.projection_size is not None  # from_dict fills it
        self.text_head = nn.Linear(cfg.text.hidden_size, cfg.text.projection_size)
        self.vision = VisionTransformer(cfg.vision, class_token=False, patch_bias=True, pre_norm=False)
        self.vision_norm = nn.LayerNorm(cfg.vision.hidden_size, eps=cfg.vision.layer_norm_eps)
        self.pool = AttentionPooling(cfg.vision)
        # As checkpoints store them: logits = cos * exp(logit_scale) + logit_bias, both [1].
        self.logit_scale = nn.Parameter(torch.empty(1))
        self.logit_bias = nn.Parameter(torch.empty(1))

    def embed_texts(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.text(input_ids, position_ids, meta)  # [T, hidden]
        last = meta.cu_seqlens[1:].long() - 1  # [n] each sequence's last token
        return self.text_head(x[last])  # [n, projection_size]

    def embed_images(self, pixels: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.vision_norm(self.vision(pixels, meta))  # [n, P, hidden]
        return self.pool(x)  # [n, hidden]

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`[na, nb]` scores of embeddings `a` `[na, dim]` against `b` `[nb, dim]` (texts against
        images: SiglipModel's `logits_per_text`); each one's sigmoid is a match probability."""
        cosine = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
        return cosine * self.logit_scale.exp() + self.logit_bias
