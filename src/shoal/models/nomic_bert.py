"""NomicBERT (nomic-embed-text v1 / v1.5), serve-only and padding-free.

A BERT-like post-LayerNorm encoder with rotary positions instead of learned ones (rotate-half
layout over the whole head), a fused q/k/v projection, a SwiGLU MLP and no biases in the linear
layers. Every tensor outside attention is packed `[T, hidden]`; sequence boundaries reach attention
only, through `AttentionMeta`.

Checkpoints name tensors as nomic's own code does (`emb_ln`, `encoder.layers.N.attn.Wqkv`,
`mlp.fc11`...); transformers' NomicBERT writes the same names. config.json comes in two layouts:
nomic's GPT-2-style keys (`n_embd`, `n_head`, `rotary_emb_base`...) or transformers' (`hidden_size`,
`rope_parameters`...). Variants that nomic's code allows but no published embedder uses (prenorm,
biases, partial or interleaved rotary, NTK scaling, RMSNorm) are refused, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers import (
    AttentionMeta,
    FusedLinear,
    PackedInputs,
    Rotary,
    activation,
    apply_rotary,
    in_row_blocks,
    varlen_attention,
)

# nomic-layout keys shoal implements one value of: key -> (that value, the default nomic's config
# class gives when config.json leaves the key out). Other values are refused.
_NOMIC_FIXED = {
    "activation_function": ("swiglu", "gelu_new"),
    "prenorm": (False, False),
    "parallel_block": (False, False),
    "rotary_emb_fraction": (1.0, 0.0),  # 0 means learned absolute positions instead of rotary
    "rotary_emb_interleaved": (False, False),
    "rotary_emb_scale_base": (None, None),
    "rotary_scaling_factor": (None, None),  # any truthy value selects dynamic NTK rotary in nomic's code
    "qkv_proj_bias": (False, True),
    "mlp_fc1_bias": (False, True),
    "mlp_fc2_bias": (False, True),
    "use_rms_norm": (False, False),
    "norm_mlp": (False, False),
}


# nomic's config class's `rotary_emb_base` when config.json leaves it out (transformers' port of the
# model defaults its `rope_theta` to 1000 instead; each layout keeps its own default).
NOMIC_ROTARY_BASE = 10_000.0


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class NomicBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    head_dim: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    rope_theta: float = 1000.0
    hidden_act: str = "silu"  # applied to the gate of the gated MLP

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> NomicBertConfig:
        return cls._from_nomic(cfg) if "n_embd" in cfg else cls._from_transformers(cfg)

    @classmethod
    def _from_nomic(cls, cfg: dict[str, Any]) -> NomicBertConfig:
        for key, (supported, default) in _NOMIC_FIXED.items():
            if cfg.get(key, default) != supported:
                raise ValueError(
                    f"NomicBERT with {key}={cfg.get(key, default)!r} is not supported "
                    f"(shoal implements {key}={supported!r})"
                )
        if cfg.get("type_vocab_size", 2) < 1:
            raise ValueError("NomicBERT without token type embeddings (type_vocab_size < 1) is not supported")
        h, heads = cfg["n_embd"], cfg["n_head"]
        # As nomic's code sizes them: the gated MLP rounds its width up to a multiple of 256, the
        # vocabulary is padded to `pad_vocab_size_multiple`.
        inner = _round_up(cfg.get("n_inner") or int(8 * h / 3), 256)
        vocab = _round_up(cfg["vocab_size"], cfg.get("pad_vocab_size_multiple", 1))
        return cls(
            vocab_size=vocab,
            hidden_size=h,
            num_hidden_layers=cfg["n_layer"],
            num_attention_heads=heads,
            intermediate_size=inner,
            head_dim=h // heads,
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            rope_theta=cfg.get("rotary_emb_base", NOMIC_ROTARY_BASE),
            hidden_act="silu",
        )

    @classmethod
    def _from_transformers(cls, cfg: dict[str, Any]) -> NomicBertConfig:
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"NomicBERT with rope_type={rope['rope_type']!r} is not supported")
        fields = {k: v for k, v in cfg.items() if k in cls.__dataclass_fields__ and v is not None}
        fields.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        fields["rope_theta"] = rope.get("rope_theta", 1000.0)
        return cls(**fields)


class NomicBertLayer(nn.Module):
    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        h, inner = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        width = self.num_heads * self.head_dim
        # nomic's checkpoint stores q, k, v fused (rows q | k | v: loaded whole); transformers' port
        # names them apart (q_proj...), as its PEFT adapters do: the shards route those.
        self.qkv = FusedLinear(h, (width, width, width), bias=False)
        self.attn_out = nn.Linear(width, h, bias=False)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.gate_up = FusedLinear(h, (inner, inner), bias=False)  # shards: fc12 (gate) | fc11 (up)
        self.mlp_out = nn.Linear(inner, h, bias=False)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = varlen_attention(q, k, v, meta).reshape(T, -1)  # [T, H * D]
        x = self.attn_norm(x + self.attn_out(a))
        return in_row_blocks(self.feed_forward, x, self.gate_up.out_features, meta.row_block_bytes)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU FFN and its residual and norm, per token: `[t, hidden]` -> `[t, hidden]`."""
        gate, up = self.gate_up.split(x)  # [t, inner] each
        return self.mlp_norm(x + self.mlp_out(self.act(gate) * up))


class NomicBertModel(nn.Module):
    config_class = NomicBertConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    weight_map = [
        (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight", None),
        (r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight", None),
        (r"emb_ln\.(weight|bias)", r"embed_norm.\1", None),
        (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.weight", r"layers.\1.qkv.weight", None),
        (r"encoder\.layers\.(\d+)\.attn\.out_proj\.weight", r"layers.\1.attn_out.weight", None),
        (r"encoder\.layers\.(\d+)\.norm1\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"encoder\.layers\.(\d+)\.mlp\.fc12\.weight", r"layers.\1.gate_up.weight", 0),
        (r"encoder\.layers\.(\d+)\.mlp\.fc11\.weight", r"layers.\1.gate_up.weight", 1),
        (r"encoder\.layers\.(\d+)\.mlp\.fc2\.weight", r"layers.\1.mlp_out.weight", None),
        (r"encoder\.layers\.(\d+)\.norm2\.(weight|bias)", r"layers.\1.mlp_norm.\2", None),
        # transformers' module names (its conversion mapping renames the above on load; PEFT adapters
        # trained on transformers' NomicBertModel name these).
        (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1", None),
        (r"layers\.(\d+)\.self_attn\.q_proj\.weight", r"layers.\1.qkv.weight", 0),
        (r"layers\.(\d+)\.self_attn\.k_proj\.weight", r"layers.\1.qkv.weight", 1),
        (r"layers\.(\d+)\.self_attn\.v_proj\.weight", r"layers.\1.qkv.weight", 2),
        (r"layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attn_out.weight", None),
        (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2", None),
        (r"layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.gate_up.weight", 0),
        (r"layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.gate_up.weight", 1),
        (r"layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.mlp_out.weight", None),
        (r"layers\.(\d+)\.post_mlp_layernorm\.(weight|bias)", r"layers.\1.mlp_norm.\2", None),
    ]
    # Masked-LM and pooler heads are not part of the encoder.
    ignored_weights = [r"cls\..*", r"pooler\..*"]
    # nomic's pretraining wrapper uses "bert.", transformers' task heads "nomic_bert.".
    checkpoint_prefixes = ("nomic_bert.", "bert.", "model.")

    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        x = self.word_embeddings(inputs.input_ids)  # [T, hidden]
        if inputs.token_type_ids is None:  # segment A/B for sentence pairs
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(inputs.token_type_ids)
        x = self.embed_norm(x)
        cos, sin = self.rotary.cos_sin(inputs.position_ids, x.dtype)  # [T, 1, D] each, shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin, inputs.meta)
        return x  # [T, hidden]
