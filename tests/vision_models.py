"""Random-weight CLIP and SigLIP checkpoints for the vision tests: small tower shapes, and every
parameter drawn so that a swapped, skipped or misread tensor changes the outputs."""

from __future__ import annotations

import torch

VOCAB = 99
MAX_TEXT = 24
IMAGE, PATCH, CHANNELS = 32, 8, 3  # 16 patches an image
TEXT_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=MAX_TEXT,
)
VISION_SHAPE = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE,
    patch_size=PATCH,
    num_channels=CHANNELS,
)
LEGACY_EOS, EOS = 2, 5  # CLIP's two end-of-text rules: the largest id (eos 2), or the first eos id
PAD = 1
ATOL = 1e-4


def randomize(model: torch.nn.Module) -> None:
    """Every parameter drawn from one seeded generator, at unit-variance activations, norms away
    from 1 and 0 and every bias nonzero, so a swapped, skipped or misread tensor cannot pass."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("logit_scale"):
                p.fill_(2.3)
            elif name.endswith("logit_bias"):
                p.fill_(-1.5)
            elif "norm" in name:  # every LayerNorm (layer_norm1, pre_layrnorm, head.layernorm...)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):  # Linears, the patch conv, MultiheadAttention's in_proj_bias
                p.copy_(0.1 * noise)
            elif "embedding" in name and p.dim() <= 2 or name.endswith("probe"):  # tables, class token
                p.copy_(noise)
            else:  # Linear, conv and in_proj weights: [out, fan_in...]
                p.copy_(noise * p[0].numel() ** -0.5)


def save_random(model_class, config, directory) -> torch.nn.Module:
    torch.manual_seed(0)
    reference = model_class(config).eval()
    reference.set_attn_implementation("eager")
    randomize(reference)
    reference.save_pretrained(directory)
    return reference
