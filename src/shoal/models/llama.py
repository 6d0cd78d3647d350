"""Llama, Qwen2 and Qwen3 decoders used as embedders, serve-only and padding-free.

Pre-RMSNorm decoder with rotary positions, grouped-query causal attention and a SwiGLU MLP; the
output is the final-normed hidden state of every token (no LM head). The three families differ
only in data read from config.json:

- llama: q/k/v/o biases when `attention_bias`, MLP biases when `mlp_bias`.
- qwen2: q/k/v always have biases, o never does.
- qwen3: per-head RMSNorm on q and k before rotary (`q_norm`, `k_norm`), explicit `head_dim`.

Every tensor outside attention is packed `[T, hidden]`; sequence boundaries reach attention only,
through `AttentionMeta`, where causality is applied inside each sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers import (
    AttentionMeta,
    FusedLinear,
    PackedInputs,
    RMSNorm,
    Rotary,
    activation,
    apply_rotary,
    in_row_blocks,
    varlen_attention,
)

_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama 3.1 frequency rescaling: (factor, low_freq_factor, high_freq_factor, original_max_positions).
    rope_llama3: tuple[float, float, float, int] | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # The LM head is the embeddings; false: the checkpoint's own lm_head.weight (generate/forward.py lm_head_of).
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        model_type = cfg.get("model_type", "llama")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
            raise ValueError(f"{model_type} with sliding-window attention layers is not supported")
        heads = cfg["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if any(isinstance(v, dict) for v in rope.values()):
            raise ValueError(f"{model_type} with per-layer-type rope parameters is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"{model_type} with rope scaling type {rope_type!r} is not supported; "
                f"shoal has: {', '.join(_ROPE_TYPES)}"
            )
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{model_type} with partial_rotary_factor != 1 is not supported")
        llama3 = None
        if rope_type == "llama3":
            original: Any = rope.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(original),
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            hidden_act=cfg.get("hidden_act", "silu"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            rope_llama3=llama3,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            out_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


class Llama3Rotary(Rotary):
    """Rotary whose low frequencies are divided by `factor`, blended smoothly into the untouched high
    frequencies, as Llama 3.1 extends its context ("rope_type": "llama3")."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_positions: int,
    ) -> None:
        super().__init__(head_dim, base)
        self.factor, self.low, self.high = factor, low_freq_factor, high_freq_factor
        self.original = original_max_positions

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        inv_freq = super().inv_freq(device)  # [D / 2]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > self.original / self.low, inv_freq / self.factor, inv_freq)
        smooth = (self.original / wavelen - self.low) / (self.high - self.low)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= self.original / self.high) & (wavelen <= self.original / self.low)
        return torch.where(medium, blended, scaled)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.attn_norm = RMSNorm(h, eps=cfg.rms_norm_eps)
        self.qkv = FusedLinear(h, (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d), bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn_out = nn.Linear(self.num_heads * d, h, bias=cfg.out_bias)
        self.mlp_norm = RMSNorm(h, eps=cfg.rms_norm_eps)
        self.gate_up = FusedLinear(h, (cfg.intermediate_size, cfg.intermediate_size), bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        a = varlen_attention(q, k, v, meta, causal=True)
        return in_row_blocks(self.feed_forward, self.attended(x, a), self.gate_up.out_features, meta.row_block_bytes)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `[T, H, D]`, keys and values `[T, Hkv, D]` of tokens `x` `[T, hidden]`, rotated at
        their positions (generate/forward.py attends them over its KV cache instead)."""
        T = x.shape[0]
        q, k, v = self.qkv.split(self.attn_norm(x))
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head, before rotary
            assert self.k_norm is not None  # both or neither (cfg.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attended(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The residual after attention: `x` plus the out projection of `a` `[T, H, D]`."""
        return x + self.attn_out(a.reshape(x.shape[0], -1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-norm SwiGLU MLP and its residual, per token: `[t, hidden]` -> `[t, hidden]`."""
        gate, up = self.gate_up.split(self.mlp_norm(x))  # [t, intermediate] each
        return x + self.down(self.act(gate) * up)


class LlamaModel(nn.Module):
    config_class = LlamaConfig
    # Checkpoint tensor name -> (our parameter name, shard index in a FusedLinear or None).
    # Names are matched after the "model." prefix is stripped.
    weight_map = [
        (r"embed_tokens\.weight", "embed_tokens.weight", None),
        (r"norm\.weight", "norm.weight", None),
        (r"layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight", None),
        (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"layers.\1.qkv.\2", 0),
        (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"layers.\1.qkv.\2", 1),
        (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"layers.\1.qkv.\2", 2),
        (r"layers\.(\d+)\.self_attn\.q_norm\.weight", r"layers.\1.q_norm.weight", None),
        (r"layers\.(\d+)\.self_attn\.k_norm\.weight", r"layers.\1.k_norm.weight", None),
        (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"layers.\1.attn_out.\2", None),
        (r"layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight", None),
        (r"layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", r"layers.\1.gate_up.\2", 0),
        (r"layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", r"layers.\1.gate_up.\2", 1),
        (r"layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", r"layers.\1.down.\2", None),
    ]
    # The LM head (often tied to the embeddings) and rotary tables older checkpoints saved.
    ignored_weights = [r"lm_head\..*", r".*rotary_emb\.inv_freq"]

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # Holds no tensors: cos/sin are computed in forward, so building on the meta device is safe.
        self.rotary = (
            Llama3Rotary(cfg.head_dim, cfg.rope_theta, *cfg.rope_llama3)
            if cfg.rope_llama3
            else Rotary(cfg.head_dim, cfg.rope_theta)
        )

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        # Decoders have no segments: token_type_ids are ignored.
        return self.decode(self.embed_tokens(inputs.input_ids), inputs.position_ids, inputs.meta)

    def decode(self, x: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """The layers and the final norm over input embeddings `x` `[T, hidden]` (a vision-language
        model puts its image features among the token embeddings first)."""
        cos, sin = self.rotary.cos_sin(position_ids, x.dtype)  # [T, 1, D] each
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)  # [T, hidden]
