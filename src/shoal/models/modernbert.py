"""ModernBERT (and the gte-modernbert and modernbert-embed embedders built on it), serve-only and
padding-free.

Pre-LayerNorm encoder with rotary positions and a GeGLU MLP. Layers alternate between global
attention and local attention over a sliding window of `local_attention` tokens (each token sees
`local_attention // 2` tokens either side); the two kinds use different rotary bases. Layer 0 has
no attention norm: the embedding norm plays its part. Every tensor outside attention is packed
`[T, hidden]`; sequence boundaries reach attention only, through `AttentionMeta`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..layers import AttentionMeta, PackedInputs, Rotary, activation, apply_rotary, in_row_blocks, varlen_attention


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    global_layers: tuple[bool, ...]  # per layer: True for global attention, False for local
    local_attention: int = 128  # the whole local window, in tokens (half on each side)
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    hidden_activation: str = "gelu"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModernBertConfig:
        """Reads both config.json layouts: the original one (`global_attn_every_n_layers`,
        `global_rope_theta`, `local_rope_theta`) and transformers 5's (`layer_types`,
        `rope_parameters`)."""
        n_layers = cfg["num_hidden_layers"]
        if cfg.get("layer_types"):
            global_layers = tuple(kind == "full_attention" for kind in cfg["layer_types"])
        else:
            every = cfg.get("global_attn_every_n_layers", 3)
            global_layers = tuple(i % every == 0 for i in range(n_layers))
        rope = cfg.get("rope_parameters") or {}
        for kind in ("full_attention", "sliding_attention"):
            if rope.get(kind, {}).get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT with rope_type={rope[kind]['rope_type']!r} is not supported")
        if cfg.get("rope_scaling"):
            raise ValueError("ModernBERT with rope_scaling is not supported")
        global_theta = rope.get("full_attention", {}).get("rope_theta", cfg.get("global_rope_theta", 160_000.0))
        local_theta = rope.get("sliding_attention", {}).get("rope_theta", cfg.get("local_rope_theta", 10_000.0))
        if len(global_layers) != n_layers:
            raise ValueError(f"layer_types names {len(global_layers)} layers, num_hidden_layers is {n_layers}")
        fields = {k: v for k, v in cfg.items() if k in cls.__dataclass_fields__ and v is not None}
        fields.update(
            global_layers=global_layers,
            global_rope_theta=global_theta,
            # An explicit null local theta meant "use the global one" in the original code.
            local_rope_theta=global_theta if local_theta is None else local_theta,
        )
        return cls(**fields)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, layer_id: int) -> None:
        super().__init__()
        h, inner = cfg.hidden_size, cfg.intermediate_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.is_global = cfg.global_layers[layer_id]
        half = cfg.local_attention // 2
        self.window = None if self.is_global else (half, half)
        # Layer 0 reads the embedding norm's output directly.
        self.attn_norm = nn.Identity() if layer_id == 0 else nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        # The checkpoint stores q, k, v already fused (rows q | k | v), so a plain Linear holds them.
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp_in = nn.Linear(h, 2 * inner, bias=cfg.mlp_bias)  # rows: activated input | gate
        self.mlp_out = nn.Linear(inner, h, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = varlen_attention(q, k, v, meta, window=self.window).reshape(T, -1)  # [T, hidden]
        x = x + self.attn_out(a)
        return in_row_blocks(self.feed_forward, x, self.mlp_in.out_features, meta.row_block_bytes)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-norm GeGLU MLP and its residual, per token: `[t, hidden]` -> `[t, hidden]`."""
        up, gate = self.mlp_in(self.mlp_norm(x)).chunk(2, dim=-1)  # [t, inner] each
        return x + self.mlp_out(self.act(up) * gate)


class ModernBertModel(nn.Module):
    config_class = ModernBertConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    # Names are matched after the "model." prefix (ModernBertForMaskedLM's) is stripped.
    weight_map = [
        (r"embeddings\.tok_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.norm\.(weight|bias)", r"embed_norm.\1", None),
        (r"layers\.(\d+)\.attn_norm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"layers\.(\d+)\.attn\.Wqkv\.(weight|bias)", r"layers.\1.qkv.\2", None),
        (r"layers\.(\d+)\.attn\.Wo\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (r"layers\.(\d+)\.mlp_norm\.(weight|bias)", r"layers.\1.mlp_norm.\2", None),
        (r"layers\.(\d+)\.mlp\.Wi\.(weight|bias)", r"layers.\1.mlp_in.\2", None),
        (r"layers\.(\d+)\.mlp\.Wo\.(weight|bias)", r"layers.\1.mlp_out.\2", None),
        (r"final_norm\.(weight|bias)", r"final_norm.\1", None),
    ]
    # The masked-LM head and decoder, and classification heads, are not part of the encoder.
    ignored_weights = [r"head\..*", r"decoder\..*", r"classifier\..*"]
    checkpoint_prefixes = ("model.",)

    @staticmethod
    def classifier_layout(config: dict) -> tuple[str, list[tuple]]:
        """ModernBertForSequenceClassification: cls or mean pooling (`classifier_pooling`), then
        ModernBertPredictionHead (dense, classifier_activation, LayerNorm) and the classifier."""
        eps, norm_bias = config.get("norm_eps", 1e-5), config.get("norm_bias", False)
        return config.get("classifier_pooling", "cls"), [
            ("linear", "head.dense", {"bias": config.get("classifier_bias", False)}),
            ("act", config.get("classifier_activation", "gelu")),
            ("norm", "head.norm", {"eps": eps, "bias": norm_bias}),
            ("linear", "classifier"),
        ]

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        head_dim = h // cfg.num_attention_heads
        self.global_rotary = Rotary(head_dim, cfg.global_rope_theta)
        self.local_rotary = Rotary(head_dim, cfg.local_rope_theta)

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        # ModernBERT has no segment embeddings: token_type_ids are ignored.
        x = self.embed_norm(self.word_embeddings(inputs.input_ids))  # [T, hidden]
        # Two rotary tables per forward, one per layer kind, shared by all layers of that kind.
        tables = {
            True: self.global_rotary.cos_sin(inputs.position_ids, x.dtype),  # [T, 1, D] each
            False: self.local_rotary.cos_sin(inputs.position_ids, x.dtype),
        }
        for layer in cast("Iterable[ModernBertLayer]", self.layers):  # nn.ModuleList iterates as Module
            x = layer(x, *tables[layer.is_global], inputs.meta)
        return self.final_norm(x)  # [T, hidden]
