"""CLIP (OpenAI's checkpoints and the LAION/open_clip ones transformers converts), serve-only and
padding-free: a causal text transformer and a ViT with a class token (vit.py), each projected into
one space.

- text: token + learned positions, causal pre-LN layers, a final norm, the state at the end-of-text
  token (found as transformers does, below), `text_projection`.
- vision: a class token before the patch embeddings, learned positions, `pre_layrnorm`, the layers,
  `post_layernorm` on the class token, `visual_projection`.

Embeddings come out projected, not normalized (`CLIPModel.get_text_features` /
`get_image_features`); `logits` scores them as `CLIPModel` does: cosine times `exp(logit_scale)`.
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
    tower_dicts,
)

# transformers' CLIPTextConfig / CLIPVisionConfig defaults, for keys a config.json leaves out.
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=8,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    eos_token_id=49407,
)
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)

# Configs written before transformers fixed CLIP's eos_token_id say 2; for those, the end-of-text
# token is found as the original code found it: the largest id of the sequence.
_LEGACY_EOS = 2


@dataclass(frozen=True)
class ClipConfig(DualEncoderConfig):
    projection_dim: int = 512

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ClipConfig:
        text, vision = tower_dicts(cfg)
        text_cfg = TextTowerConfig.from_dict(text, _TEXT_DEFAULTS)
        if not isinstance(text_cfg.eos_token_id, int):
            raise ValueError(f"CLIP with eos_token_id {text_cfg.eos_token_id!r} (not one id) is not supported")
        return cls(text_cfg, VisionTowerConfig.from_dict(vision, _VISION_DEFAULTS), cfg.get("projection_dim") or 512)


def end_of_text_rows(input_ids: torch.Tensor, meta: AttentionMeta, eos_token_id: int) -> torch.Tensor:
    """`[n]` packed row of each sequence's end-of-text token: the first `eos_token_id`, or with a
    legacy config (eos 2) the first largest id; the first token when there is none (as transformers)."""
    key = input_ids if eos_token_id == _LEGACY_EOS else (input_ids == eos_token_id).long()  # [T]
    # Padding is 0, never above a real token's key, and argmax takes the first maximum.
    position = meta.pad(key).argmax(-1)  # [n]
    return meta.cu_seqlens[:-1].long() + position


class ClipModel(DualEncoder):
    config_class = ClipConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    weight_map = [
        *TextTransformer.weights("text_model", "text"),
        *VisionTransformer.weights("vision_model", "vision"),
        (r"vision_model\.post_layernorm\.(weight|bias)", r"vision_norm.\1", None),
        (r"text_projection\.weight", "text_projection.weight", None),
        (r"visual_projection\.weight", "visual_projection.weight", None),
        (r"logit_scale", "logit_scale", None),
    ]
    # Position-id buffers older checkpoints saved.
    ignored_weights = [r".*position_ids"]

    def __init__(self, cfg: ClipConfig) -> None:
        super().__init__()
        self.config = cfg
        self.text = TextTransformer(cfg.text, causal=True)
        self.vision = VisionTransformer(cfg.vision, class_token=True, patch_bias=False, pre_norm=True)
        self.vision_norm = nn.LayerNorm(cfg.vision.hidden_size, eps=cfg.vision.layer_norm_eps)
        self.text_projection = nn.Linear(cfg.text.hidden_size, cfg.projection_dim, bias=False)
        self.visual_projection = nn.Linear(cfg.vision.hidden_size, cfg.projection_dim, bias=False)
        # log of the cosine's scale, as checkpoints store it: logits = cos * exp(logit_scale)
        self.logit_scale = nn.Parameter(torch.empty(()))

    def embed_texts(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.text(input_ids, position_ids, meta)  # [T, hidden]
        assert self.config.text.eos_token_id is not None  # from_dict refuses configs without one
        rows = end_of_text_rows(input_ids, meta, self.config.text.eos_token_id)  # [n]
        return self.text_projection(x[rows])  # [n, projection_dim]

    def embed_images(self, pixels: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.vision(pixels, meta)  # [n, L, hidden]
        return self.visual_projection(self.vision_norm(x[:, 0]))  # [n, projection_dim]

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`[na, nb]` scores of embeddings `a` `[na, dim]` against `b` `[nb, dim]` (texts against
        images: CLIPModel's `logits_per_text`); a softmax over them gives CLIP's label probabilities."""
        cosine = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
        return cosine * self.logit_scale.exp()
