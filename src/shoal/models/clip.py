"""CLIP (OpenAI's checkpoints and LAION's open_clip ones), serve-only and padding-free: a causal
text transformer and a ViT with a class token (vit.py), each projected into one space.

- text: token + learned positions, causal pre-LN layers, a final norm, the state at the end-of-text
  token (found as transformers does, below), `text_projection`.
- vision: a class token before the patch embeddings, learned positions, `pre_layrnorm`, the layers,
  `post_layernorm` on the class token, `visual_projection`.

Checkpoints load in two layouts (weights.py `LAYOUTS`): transformers' (config.json, CLIPModel's
tensor names) and open_clip's (open_clip_config.json, read by `config_from_open_clip`, and the
state dict of open_clip's `CLIP`: q/k/v fused in `in_proj_weight`, projections stored
`[width, embed]`). The weight map holds the names of both.

Embeddings come out projected, not normalized (`CLIPModel.get_text_features` /
`get_image_features`, open_clip's `encode_text` / `encode_image`); `logits` scores them as both
do: cosine times `exp(logit_scale)`.
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
# token is found as the original code (and open_clip's default `pool_type: argmax`) finds it: the
# largest id of the sequence.
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


# open_clip's CLIPVisionCfg / CLIPTextCfg defaults, for keys an open_clip_config.json leaves out.
_OPEN_CLIP_VISION: dict[str, Any] = dict(
    layers=12, width=768, head_width=64, mlp_ratio=4.0, patch_size=16, image_size=224
)
_OPEN_CLIP_TEXT: dict[str, Any] = dict(
    context_length=77, vocab_size=49408, width=512, heads=8, layers=12, mlp_ratio=4.0
)
# open_clip settings that change the computation and that this model does not implement, each with
# the values that leave it off (the first its default). Other keys (tokenizer, patch dropout, init,
# pos_embed_type: the table is in the checkpoint either way) do not change what it computes.
_OPEN_CLIP_BLOCK_OFF: dict[str, tuple[Any, ...]] = dict(
    block_type=(None, "default"),
    ls_init_value=(None,),
    qk_norm=(False,),
    scaled_cosine_attn=(False,),
    scale_heads=(False,),
    scale_attn_inner=(False,),
    scale_attn=(False,),
    scale_fc=(False,),
    act_kwargs=(None,),
)
_OPEN_CLIP_OFF: dict[str, dict[str, tuple[Any, ...]]] = {
    "model_cfg": dict(custom_text=(False,), init_logit_bias=(None,), multimodal_cfg=(None,)),
    "vision_cfg": dict(
        _OPEN_CLIP_BLOCK_OFF,
        timm_model_name=(None, ""),
        attentional_pool=(False,),
        no_ln_pre=(False,),
        pool_type=("tok",),
    ),
    "text_cfg": dict(
        _OPEN_CLIP_BLOCK_OFF,
        hf_model_name=(None, ""),
        embed_cls=(False,),
        no_causal_mask=(False,),
        pool_type=("argmax", "eos"),
        proj_type=("linear",),
        proj_bias=(False,),
    ),
}


def config_from_open_clip(config: dict[str, Any]) -> dict[str, Any]:
    """An open_clip_config.json (`model_cfg`, `preprocess_cfg`) as transformers' CLIP config.json
    would say it, for `ClipConfig.from_dict`. GELU is exact unless `quick_gelu` (open_clip's
    `-quickgelu` models: OpenAI's weights; LAION's are trained with exact GELU). Text pools at
    the largest id (`pool_type: argmax`, the legacy eos rule) or at the first `eos_id` (`eos`).
    A ValueError names any setting this model does not implement."""
    model = config.get("model_cfg")
    if not isinstance(model, dict) or "embed_dim" not in model:
        raise ValueError("no model_cfg with an embed_dim")
    vision = {**_OPEN_CLIP_VISION, **(model.get("vision_cfg") or {})}
    text = {**_OPEN_CLIP_TEXT, **(model.get("text_cfg") or {})}
    for where, settings in (("model_cfg", model), ("vision_cfg", vision), ("text_cfg", text)):
        for key, values in _OPEN_CLIP_OFF[where].items():
            if settings.get(key, values[0]) not in values:
                raise ValueError(f"{where}.{key} = {settings[key]!r}: shoal's CLIP does not implement it")
    if isinstance(vision["layers"], (list, tuple)):
        raise ValueError("vision_cfg.layers is a list (a ResNet image tower): shoal's CLIP is a ViT")
    if text.get("pool_type") == "eos" and text.get("eos_id", _LEGACY_EOS) == _LEGACY_EOS:
        raise ValueError(f"text_cfg pool_type 'eos' with eos_id {_LEGACY_EOS}: shoal reads eos id 2 as the largest id")
    act = "quick_gelu" if model.get("quick_gelu") else "gelu"

    def tower(cfg: dict[str, Any], heads: int) -> dict[str, Any]:
        norm = dict(cfg.get("norm_kwargs") or {})
        eps = norm.pop("eps", 1e-5)
        if norm:
            raise ValueError(f"norm_kwargs {sorted(norm)}: shoal's CLIP reads only eps")
        return dict(
            hidden_size=cfg["width"],
            intermediate_size=int(cfg["width"] * cfg["mlp_ratio"]),
            num_hidden_layers=cfg["layers"],
            num_attention_heads=heads,
            hidden_act=act,
            layer_norm_eps=eps,
        )

    eos = text["eos_id"] if text.get("pool_type") == "eos" else _LEGACY_EOS
    return dict(
        model_type="clip",
        projection_dim=model["embed_dim"],
        text_config=dict(
            tower(text, text["heads"]),
            vocab_size=text["vocab_size"],
            max_position_embeddings=text["context_length"],
            eos_token_id=eos,
        ),
        vision_config=dict(
            tower(vision, vision["width"] // vision["head_width"]),
            num_channels=3,
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
        ),
    )


def _open_clip_weights() -> list[tuple[str, str, int | None]]:
    """Weight-map rules for open_clip's `CLIP` state dict: resblocks of nn.MultiheadAttention, whose
    `in_proj_*` holds q, k, v in our FusedLinear's row order (so it fills `qkv` whole), `ln_1`,
    `ln_2`, `mlp.c_fc`, `mlp.c_proj`; then the embeddings, norms and projections (the last stored
    `[width, embed]`: `transposed_weights`)."""
    layer = [
        (r"attn\.in_proj_", "qkv"),
        (r"attn\.out_proj\.", "attn_out"),
        (r"ln_1\.", "attn_norm"),
        (r"ln_2\.", "mlp_norm"),
        (r"mlp\.c_fc\.", "fc1"),
        (r"mlp\.c_proj\.", "fc2"),
    ]
    rules: list[tuple[str, str, int | None]] = [
        (rf"{tower}\.resblocks\.(\d+)\.{name}(weight|bias)", rf"{ours}.layers.\1.{param}.\2", None)
        for tower, ours in ((r"transformer", "text"), (r"visual\.transformer", "vision"))
        for name, param in layer
    ]
    return [
        *rules,
        (r"token_embedding\.weight", "text.token_embedding.weight", None),
        (r"positional_embedding", "text.position_embedding.weight", None),
        (r"ln_final\.(weight|bias)", r"text.final_norm.\1", None),
        (r"text_projection", "text_projection.weight", None),
        (r"visual\.conv1\.weight", "vision.patch_embedding.weight", None),
        (r"visual\.class_embedding", "vision.class_embedding", None),
        (r"visual\.positional_embedding", "vision.position_embedding.weight", None),
        (r"visual\.ln_pre\.(weight|bias)", r"vision.pre_norm.\1", None),
        (r"visual\.ln_post\.(weight|bias)", r"vision_norm.\1", None),
        (r"visual\.proj", "visual_projection.weight", None),
    ]


def end_of_text_rows(input_ids: torch.Tensor, meta: AttentionMeta, eos_token_id: int) -> torch.Tensor:
    """`[n]` packed row of each sequence's end-of-text token: the first `eos_token_id`, or with a
    legacy config (eos 2) the first largest id; the first token when there is none (as transformers)."""
    key = input_ids if eos_token_id == _LEGACY_EOS else (input_ids == eos_token_id).long()  # [T]
    # Padding is 0, never above a real token's key, and argmax takes the first maximum.
    position = meta.pad(key).argmax(-1)  # [n]
    return meta.cu_seqlens[:-1].long() + position


class ClipModel(DualEncoder):
    config_class = ClipConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None), in
    # transformers' names and in open_clip's.
    weight_map = [
        *TextTransformer.weights("text_model", "text"),
        *VisionTransformer.weights("vision_model", "vision"),
        (r"vision_model\.post_layernorm\.(weight|bias)", r"vision_norm.\1", None),
        (r"text_projection\.weight", "text_projection.weight", None),
        (r"visual_projection\.weight", "visual_projection.weight", None),
        (r"logit_scale", "logit_scale", None),
        *_open_clip_weights(),
    ]
    # Position-id buffers older checkpoints saved.
    ignored_weights = [r".*position_ids"]
    # open_clip's projections, stored `[width, embed]` (`x @ proj`); our Linears hold `[embed, width]`.
    transposed_weights = [r"text_projection", r"visual\.proj"]

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
