"""Idefics3 (SmolVLM, and ColSmol / ColIdefics3 page retrievers built on it), serve-only and
padding-free: a SigLIP vision tower without its pooling head, a pixel-shuffle connector, and a
Llama decoder (llama.py) whose `<image>` token embeddings are replaced by the image features.

    tiles' patch rows [n * P, C*p*p] ─▶ vision tower (vit.py) ─▶ post_layernorm ─▶ [n, P, dv]
        ─▶ pixel shuffle (s x s neighbouring patches into one token)  [n, P / s², dv * s²]
        ─▶ modality projection (no bias)                               [n * P / s², dt]
    token ids [T] ─▶ embeddings, each `<image>` position taking the next image feature in order
        ─▶ decoder layers, final norm ─▶ [T, dt], every token's state

An image reaches the model already cut into tiles of the vision tower's resolution (the
preprocessor splits a page into a grid of tiles and adds the whole page downscaled as one more),
each tile's patches in the "pixels" feature slot of its sequence, and its prompt's `<image>` ids
(`image_seq_len = P / s²` per tile) among the sequence's ids. Every tile is full size, so each
patch has its own position (transformers' bucketed positions are the identity for a full tile).
The vision tower runs a few tiles at a time (`TILE_BLOCK_PATCHES`), so a batch of many pages
never holds every tile's activations at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers import AttentionMeta, PackedInputs
from .llama import LlamaConfig, LlamaModel
from .vit import PIXELS, VisionTowerConfig, VisionTransformer

# transformers' Idefics3VisionConfig defaults, for keys a config.json leaves out.
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
# Patches the vision tower takes in one pass: its activations stay bounded however many pages a
# batch holds (16 tiles of 32x32 patches).
TILE_BLOCK_PATCHES = 16 * 1024


@dataclass(frozen=True)
class Idefics3Config:
    vision: VisionTowerConfig
    text: LlamaConfig
    scale_factor: int
    image_token_id: int

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Idefics3Config:
        vision = VisionTowerConfig.from_dict(cfg.get("vision_config") or {}, _VISION_DEFAULTS)
        # Idefics3Config builds its text config with rms_norm_eps 1e-5 unless it says otherwise.
        text_dict = {"model_type": "llama", "rms_norm_eps": 1e-5, **(cfg.get("text_config") or {})}
        if text_dict["model_type"] != "llama":
            raise ValueError(f"idefics3 with a {text_dict['model_type']!r} text model is not supported (llama is)")
        scale = int(cfg.get("scale_factor", 2))
        side = vision.image_size // vision.patch_size
        if side % scale:
            raise ValueError(f"idefics3: a tile of {side}x{side} patches does not shuffle by scale_factor {scale}")
        return cls(vision, LlamaConfig.from_dict(text_dict), scale, int(cfg.get("image_token_id", 128257)))

    @property
    def image_seq_len(self) -> int:
        """Tokens one tile becomes in the decoder."""
        return self.vision.num_patches // self.scale_factor**2

    # The widest part's sizes, for whoever estimates a batch's workspace from `model.config`.
    @property
    def hidden_size(self) -> int:
        return max(self.text.hidden_size, self.vision.hidden_size)

    @property
    def intermediate_size(self) -> int:
        return max(self.text.intermediate_size, self.vision.intermediate_size)

    @property
    def num_attention_heads(self) -> int:
        return max(self.text.num_attention_heads, self.vision.num_attention_heads)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """`[n, P, d]` patch states of square tiles -> `[n, P / s², d * s²]`, each output token the
    states of `s` x `s` neighbouring patches side by side, in Idefics3Connector's order."""
    n, P, d = x.shape
    side = int(P**0.5)
    x = x.reshape(n, side, side // s, d * s)  # [n, row, col block, s patches of a row]
    x = x.transpose(1, 2).reshape(n, side // s, side // s, d * s * s)  # [n, col block, row block, ...]
    return x.transpose(1, 2).reshape(n, P // (s * s), d * s * s)


class Idefics3Model(nn.Module):
    # Not captured as a CUDA graph (engine/graphs.py): it counts its image slots on the host.
    graphable = False
    config_class = Idefics3Config
    # Checkpoint tensor name (after "model.") -> (our parameter name, shard index or None).
    weight_map = [
        *VisionTransformer.weights("vision_model", "vision"),
        (r"vision_model\.post_layernorm\.(weight|bias)", r"vision_norm.\1", None),
        (r"connector\.modality_projection\.proj\.weight", "projection.weight", None),
        *((rf"text_model\.{pattern}", f"text.{target}", shard) for pattern, target, shard in LlamaModel.weight_map),
    ]
    # A ColIdefics3's `linear` (its late-interaction head reads it) and a generator's LM head.
    ignored_weights = [r"linear\.(weight|bias)", r"lm_head\..*", r".*rotary_emb\.inv_freq"]

    def __init__(self, cfg: Idefics3Config) -> None:
        super().__init__()
        self.config = cfg
        self.vision = VisionTransformer(cfg.vision, class_token=False, patch_bias=True, pre_norm=False)
        self.vision_norm = nn.LayerNorm(cfg.vision.hidden_size, eps=cfg.vision.layer_norm_eps)
        self.projection = nn.Linear(cfg.vision.hidden_size * cfg.scale_factor**2, cfg.text.hidden_size, bias=False)
        self.text = LlamaModel(cfg.text)

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def image_features(self, pixels: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Tiles' patch rows `[n * P, C*p*p]` -> `[n * image_seq_len, text hidden]`, tile by tile."""
        P = self.config.vision.num_patches
        if pixels.dim() != 2 or pixels.shape[0] % P:
            raise ValueError(f"pixels must be whole tiles of {P} patch rows, not {list(pixels.shape)}")
        per_block = max(1, TILE_BLOCK_PATCHES // P)
        out = []
        for start in range(0, pixels.shape[0] // P, per_block):
            block = pixels[start * P : (start + per_block) * P]  # [b * P, C*p*p]
            n = block.shape[0] // P
            cu = torch.tensor(list(itertools.accumulate([0] + [P] * n)), dtype=torch.int32, device=pixels.device)
            tiles = AttentionMeta.build(cu, P, each=meta.each, row_block_bytes=meta.row_block_bytes)
            states = self.vision_norm(self.vision(block, tiles))  # [b, P, dv]
            out.append(self.projection(pixel_shuffle(states, self.config.scale_factor)).flatten(0, 1))
        return torch.cat(out)

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        x = self.text.embed_tokens(inputs.input_ids)  # [T, hidden]
        pixels = inputs.features.get(PIXELS)
        slots = inputs.input_ids == self.image_token_id  # [T]
        num_slots = int(slots.sum())
        if pixels is not None and pixels.shape[0]:
            features = self.image_features(pixels, inputs.meta)  # [tiles * image_seq_len, hidden]
            if features.shape[0] != num_slots:
                raise ValueError(
                    f"the batch's images make {features.shape[0]} image features for {num_slots} <image> tokens"
                )
            x = x.masked_scatter(slots[:, None], features.to(x.dtype))
        elif num_slots:
            raise ValueError(f"{num_slots} <image> tokens and no image in the batch")
        return self.text.decode(x, inputs.position_ids, inputs.meta)
