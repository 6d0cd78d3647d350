"""What CLIP and SigLIP share: a dual encoder of a text transformer and a vision transformer (ViT).

Both towers are stacks of the same pre-LayerNorm layer (`x + attn(ln1(x))`, then `x + mlp(ln2(x))`,
q/k/v/out and the MLP with biases), over packed tokens `[T, hidden]`; sequence boundaries reach
attention only, through `AttentionMeta`. The text tower embeds token ids plus learned absolute
positions; the vision tower embeds patches (a Conv2d with stride = kernel = patch, done as one
matmul over the patch rows the preprocessor cut), optionally behind a class token, plus learned
positions at the one resolution the checkpoint was trained at.

`DualEncoder.forward` routes each sequence of a batch to a tower: a sequence with rows in the
"pixels" feature slot is an image (its token count is the tower's tokens per image; its input ids
are placeholders), any other is a text. A batch of both runs each tower on its own sub-batch, with
its own `AttentionMeta`, and returns one embedding per sequence, in batch order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..layers import AttentionMeta, FusedLinear, PackedInputs, activation, in_row_blocks, varlen_attention

_Tower = TypeVar("_Tower", bound="TowerConfig")

PIXELS = "pixels"  # the feature slot of patch rows: [P, C * p * p]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU (`hidden_act: quick_gelu`): x * sigmoid(1.702 x),
    computed as silu(1.702 x) / 1.702 in one new tensor (silu is one vectorised kernel; the naive
    form makes three passes and three tensors of the widest activation)."""
    y = x * 1.702
    return F.silu(y, inplace=True).mul_(1 / 1.702)


def tower_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return quick_gelu if name == "quick_gelu" else activation(name)


def _square(value: Any, name: str) -> int:
    """An `image_size` / `patch_size` as one int; configs may write a square as a pair."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"non-square {name} {value} is not supported")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class TowerConfig:
    """One tower's transformer: what every layer reads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_dict(cls: type[_Tower], cfg: dict[str, Any], defaults: dict[str, Any]) -> _Tower:
        """The tower from a config.json sub-dict, the architecture's `defaults` (transformers' config
        defaults, which published config.json files often leave out) filling what it omits."""
        merged = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in merged.items() if k in names}
        for key in ("image_size", "patch_size"):
            if key in kwargs:
                kwargs[key] = _square(kwargs[key], key)
        return cls(**kwargs)


@dataclass(frozen=True)
class TextTowerConfig(TowerConfig):
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: int | None = None
    projection_size: int | None = None  # SigLIP's text head; CLIP projects both towers alike


@dataclass(frozen=True)
class VisionTowerConfig(TowerConfig):
    num_channels: int
    image_size: int
    patch_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class DualEncoderConfig:
    text: TextTowerConfig
    vision: VisionTowerConfig

    # The widest tower's sizes, for whoever estimates a batch's workspace from `model.config`.
    @property
    def hidden_size(self) -> int:
        return max(self.text.hidden_size, self.vision.hidden_size)

    @property
    def intermediate_size(self) -> int:
        return max(self.text.intermediate_size, self.vision.intermediate_size)

    @property
    def num_attention_heads(self) -> int:
        return max(self.text.num_attention_heads, self.vision.num_attention_heads)


def tower_dicts(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json's text and vision sub-dicts (older CLIP configs also carry `*_config_dict`, whose
    values win, as transformers reads them)."""
    text = {**(cfg.get("text_config") or {}), **(cfg.get("text_config_dict") or {})}
    vision = {**(cfg.get("vision_config") or {}), **(cfg.get("vision_config_dict") or {})}
    return text, vision


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TowerConfig, causal: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.causal = causal
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.qkv = FusedLinear(h, (h, h, h))
        self.attn_out = nn.Linear(h, h)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)
        self.act = tower_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.view(T, self.num_heads, self.head_dim) for t in self.qkv.split(self.attn_norm(x)))  # [T, H, D]
        a = varlen_attention(q, k, v, meta, causal=self.causal).reshape(T, -1)  # [T, hidden]
        x = x + self.attn_out(a)
        return in_row_blocks(self.feed_forward, x, self.fc1.out_features, meta.row_block_bytes)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-norm MLP and its residual, per token: `[t, hidden]` -> `[t, hidden]`."""
        return x + self.fc2(self.act(self.fc1(self.mlp_norm(x))))


def layer_weights(tower: str, ours: str) -> list[tuple[str, str, int | None]]:
    """Weight-map rules for checkpoint tower `tower` ("text_model", "vision_model") -> our `ours`."""
    src, dst = rf"{tower}\.encoder\.layers\.(\d+)\.", rf"{ours}.layers.\1."
    parts: list[tuple[str, str, int | None]] = [
        (r"self_attn\.q_proj", "qkv", 0),
        (r"self_attn\.k_proj", "qkv", 1),
        (r"self_attn\.v_proj", "qkv", 2),
        (r"self_attn\.out_proj", "attn_out", None),
        (r"layer_norm1", "attn_norm", None),
        (r"layer_norm2", "mlp_norm", None),
        (r"mlp\.fc1", "fc1", None),
        (r"mlp\.fc2", "fc2", None),
    ]
    return [(rf"{src}{name}\.(weight|bias)", rf"{dst}{param}.\2", shard) for name, param, shard in parts]


class TextTransformer(nn.Module):
    """Token + learned position embeddings, the layers, a final norm: ids `[T]` -> `[T, hidden]`."""

    def __init__(self, cfg: TextTowerConfig, causal: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.token_embedding = nn.Embedding(cfg.vocab_size, h)
        self.position_embedding = nn.Embedding(cfg.max_position_embeddings, h)
        self.layers = nn.ModuleList(EncoderLayer(cfg, causal) for _ in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    @staticmethod
    def weights(tower: str, ours: str) -> list[tuple[str, str, int | None]]:
        return [
            (rf"{tower}\.embeddings\.token_embedding\.weight", f"{ours}.token_embedding.weight", None),
            (rf"{tower}\.embeddings\.position_embedding\.weight", f"{ours}.position_embedding.weight", None),
            (rf"{tower}\.final_layer_norm\.(weight|bias)", rf"{ours}.final_norm.\1", None),
            *layer_weights(tower, ours),
        ]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = self.token_embedding(input_ids) + self.position_embedding(position_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, meta)
        return self.final_norm(x)


class PatchEmbedding(nn.Module):
    """The checkpoint's patch Conv2d (stride = kernel = patch), as one matmul over patch rows: each
    row `[C * p * p]` is one patch flattened in the conv weight's (channel, row, col) order."""

    def __init__(self, cfg: VisionTowerConfig, bias: bool) -> None:
        super().__init__()
        p = cfg.patch_size
        self.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_channels, p, p))  # [hidden, C, p, p]
        self.bias = nn.Parameter(torch.empty(cfg.hidden_size)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.linear(pixels.to(self.weight.dtype), self.weight.flatten(1), self.bias)  # [P, hidden]


class VisionTransformer(nn.Module):
    """Patch embeddings (behind a class token when `class_token`) + learned positions, an optional
    pre-norm, the layers: patch rows `[n * P, C * p * p]` -> `[n, L, hidden]`, L tokens an image."""

    def __init__(self, cfg: VisionTowerConfig, *, class_token: bool, patch_bias: bool, pre_norm: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.patch_embedding = PatchEmbedding(cfg, patch_bias)
        self.class_embedding = nn.Parameter(torch.empty(h)) if class_token else None
        self.tokens_per_image = cfg.num_patches + int(class_token)
        self.position_embedding = nn.Embedding(self.tokens_per_image, h)
        self.pre_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if pre_norm else None
        self.layers = nn.ModuleList(EncoderLayer(cfg, causal=False) for _ in range(cfg.num_hidden_layers))

    @staticmethod
    def weights(tower: str, ours: str) -> list[tuple[str, str, int | None]]:
        return [
            (rf"{tower}\.embeddings\.patch_embedding\.(weight|bias)", rf"{ours}.patch_embedding.\1", None),
            (rf"{tower}\.embeddings\.class_embedding", f"{ours}.class_embedding", None),
            (rf"{tower}\.embeddings\.position_embedding\.weight", f"{ours}.position_embedding.weight", None),
            (rf"{tower}\.pre_layrnorm\.(weight|bias)", rf"{ours}.pre_norm.\1", None),
            *layer_weights(tower, ours),
        ]

    def forward(self, pixels: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        n, P = meta.num_seqs, self.config.num_patches
        x = self.patch_embedding(pixels).view(n, P, -1)  # [n, P, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)  # [n, P + 1, hidden]
        x = (x + self.position_embedding.weight).flatten(0, 1)  # [n * L, hidden]
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x, meta)
        return x.view(n, self.tokens_per_image, -1)  # [n, L, hidden]


def _sub_batch(meta: AttentionMeta, seqs: list[int]) -> tuple[torch.Tensor, AttentionMeta]:
    """The tokens `[Ts]` of sequences `seqs` (indices into the packed batch) and their own meta."""
    bounds, device = meta.bounds, meta.cu_seqlens.device
    lengths = [bounds[i + 1] - bounds[i] for i in seqs]
    tokens = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in seqs])
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    key_lengths = None if meta.key_lengths is None else meta.key_lengths[torch.tensor(seqs, device=device)]
    sub = AttentionMeta.build(
        cu_seqlens, max(lengths), key_lengths, each=meta.each, row_block_bytes=meta.row_block_bytes
    )
    return torch.from_numpy(tokens).to(device), sub


class DualEncoder(nn.Module):
    """A text tower and a vision tower, each ending in one embedding per sequence (`embed_texts`,
    `embed_images`, defined by the architecture); `forward` routes a batch's sequences to them."""

    text: TextTransformer
    vision: VisionTransformer

    @property
    def max_positions(self) -> int:
        """The longest text the position table covers. An image's sequence is `tokens_per_image`
        long, whatever this says."""
        return self.text.position_embedding.num_embeddings

    @property
    def tokens_per_image(self) -> int:
        """Tokens (and cu_seqlens length) of an image's sequence: its patches, plus a class token
        where the architecture has one."""
        return self.vision.tokens_per_image

    def embed_texts(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        raise NotImplementedError

    def embed_images(self, pixels: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """One embedding per sequence, `[n, dim]`, projected, not normalized."""
        meta = inputs.meta
        cu_rows = inputs.features.get(f"{PIXELS}_cu_rows")
        rows = [0] * (meta.num_seqs + 1) if cu_rows is None else cu_rows.tolist()
        images = [i for i in range(meta.num_seqs) if rows[i + 1] > rows[i]]
        texts = [i for i in range(meta.num_seqs) if rows[i + 1] == rows[i]]
        if images:
            self._check_images(inputs.features[PIXELS], rows, images, meta.bounds)
        if not texts:
            return self.embed_images(inputs.features[PIXELS], meta)
        if not images:
            return self.embed_texts(inputs.input_ids, inputs.position_ids, meta)
        _, image_meta = _sub_batch(meta, images)
        text_tokens, text_meta = _sub_batch(meta, texts)
        image_embeds = self.embed_images(inputs.features[PIXELS], image_meta)  # [ni, dim]
        text_embeds = self.embed_texts(inputs.input_ids[text_tokens], inputs.position_ids[text_tokens], text_meta)
        out = image_embeds.new_empty(meta.num_seqs, image_embeds.shape[1])  # [n, dim]
        device = out.device
        out.index_copy_(0, torch.tensor(images, device=device), image_embeds)
        out.index_copy_(0, torch.tensor(texts, device=device), text_embeds)
        return out

    def _check_images(self, pixels: torch.Tensor, rows: list[int], images: list[int], bounds: list[int]) -> None:
        """Every image must have the patch count and token count of the checkpoint's resolution:
        its position table has no other (no interpolation)."""
        cfg = self.vision.config
        width = cfg.num_channels * cfg.patch_size**2
        if pixels.dim() != 2 or pixels.shape[1] != width or pixels.shape[0] != rows[-1]:
            raise ValueError(
                f"pixels must be [{rows[-1]}, {width}] (patch rows of {cfg.num_channels} x {cfg.patch_size} x "
                f"{cfg.patch_size}), not {list(pixels.shape)}"
            )
        for i in images:
            patches, tokens = rows[i + 1] - rows[i], bounds[i + 1] - bounds[i]
            if patches != cfg.num_patches or tokens != self.tokens_per_image:
                raise ValueError(
                    f"sequence {i} is an image of {patches} patches in {tokens} tokens; this model takes "
                    f"{cfg.image_size}x{cfg.image_size} images: {cfg.num_patches} patches of {cfg.patch_size}x"
                    f"{cfg.patch_size} in {self.tokens_per_image} tokens"
                )
