"""What the machine could do: FLOPs per token (text) or per image (a vision tower) from a model's
config.json, and the fp32 GEMM peak measured here, so a throughput can be read as a share of the
bound the hardware sets.

FLOPs per token counts the matmuls of the transformer layers (2 FLOPs per multiply-add): the
projections (q, k, v, output; two matrices for a plain MLP, three for a gated one) and attention's
two products over the token's own sequence (QK^T and AV: 4 x seq_len x heads x head_dim).
Embeddings, norms, activations and heads are left out, and local attention (ModernBERT's) is counted
as global: an approximation, good to ~10 % for the encoders shoal serves. FLOPs per image are the
vision tower's layers counted the same way over the image's tokens, plus the patch embedding (a
matmul over each patch's pixels) and CLIP's projection to the embedding.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Architectures whose MLP is gated (gate and up projections, then down).
_GATED = {"llama", "qwen2", "qwen3", "modernbert", "nomic_bert"}
_KEYS = {
    "hidden": ("hidden_size", "d_model", "dim", "n_embd"),
    "layers": ("num_hidden_layers", "n_layers", "n_layer"),
    "intermediate": ("intermediate_size", "hidden_dim", "n_inner"),
    "heads": ("num_attention_heads", "n_heads", "n_head"),
}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    gated: bool

    head_dim: int = 0  # 0: hidden // heads

    def flops_per_token(self, mean_seq_len: float) -> float:
        """Forward FLOPs for one token of a sequence `mean_seq_len` long (use sum(len^2)/sum(len)
        over a batch: attention costs each token its own sequence's length)."""
        head_dim = self.head_dim or self.hidden // self.heads
        q_dim, kv_dim = self.heads * head_dim, self.kv_heads * head_dim
        projections = 2 * self.hidden * q_dim + 2 * self.hidden * kv_dim  # q and output; k and v
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        return self.layers * (2.0 * (projections + mlp) + 4.0 * mean_seq_len * q_dim)


def shape_of(model_dir: Path, architecture: str) -> Shape:
    config = json.loads((Path(model_dir) / "config.json").read_text())

    def key(name: str) -> int:
        for k in _KEYS[name]:
            if config.get(k):
                return int(config[k])
        raise KeyError(f"{model_dir}/config.json has none of {_KEYS[name]}")

    heads = key("heads")
    intermediate = (
        config.get("intermediate_size") or config.get("hidden_dim") or config.get("n_inner") or 4 * key("hidden")
    )
    return Shape(
        key("hidden"),
        key("layers"),
        int(intermediate),
        heads,
        int(config.get("num_key_value_heads") or heads),
        architecture in _GATED,
        int(config.get("head_dim") or 0),
    )


def vision_flops_per_image(model_dir: Path, tokens_per_image: int) -> float:
    """Forward FLOPs of the vision tower of `model_dir`'s config.json (`vision_config`) for one image
    of `tokens_per_image` tokens (the card's `image_tokens`: the patches, and a class token where
    the model has one). SigLIP's attention-pooling head is left out (about a sixth of one layer)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # Older CLIP configs also carry `vision_config_dict`, whose values win, as transformers reads them.
    vision = {**(config.get("vision_config") or {}), **(config.get("vision_config_dict") or {})}

    def key(name: str) -> int:
        value = vision.get(name)
        if isinstance(value, (list, tuple)):  # a square written as a pair
            value = value[0]
        if not value:
            raise KeyError(f"{model_dir}/config.json has no vision_config.{name}")
        return int(value)

    hidden, patch = key("hidden_size"), key("patch_size")
    shape = Shape(
        hidden,
        key("num_hidden_layers"),
        key("intermediate_size"),
        key("num_attention_heads"),
        key("num_attention_heads"),
        gated=False,
    )
    num_patches = (key("image_size") // patch) ** 2
    patch_embedding = 2.0 * num_patches * int(vision.get("num_channels") or 3) * patch * patch * hidden
    projection = 2.0 * hidden * int(config.get("projection_dim") or 0)
    return tokens_per_image * shape.flops_per_token(tokens_per_image) + patch_embedding + projection


def effective_seq_len(lengths: list[int]) -> float:
    """sum(len^2) / sum(len): the sequence length the mean token attends over."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / total if total else 0.0


def fp32_gemm_peak(size: int = 2048, repeats: int = 5, threads: int | None = None) -> tuple[float, int]:
    """(FLOP/s, threads): the best of `repeats` fp32 size^3 matmuls, with torch's threads (default:
    torch's own count, as `shoal serve` uses)."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up: thread pool and caches
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2.0 * size**3 / best, torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None
