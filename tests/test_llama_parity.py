"""shoal's packed Llama / Qwen2 / Qwen3 decoder against transformers' LlamaModel, Qwen2Model and
Qwen3Model on random-initialised checkpoints: grouped-query and multi-head attention, biases,
per-head q/k norms, explicit head_dim and Llama 3.1 rope scaling."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import (
    assert_packing_invariant,
    attention_meta,
    max_abs_diff,
    min_pooled_cosine,
    packed_batch,
    packed_hidden_states,
    randomize_norms,
    reference_hidden_states,
)
from shoal.errors import ModelLoadError
from shoal.layers import PackedInputs
from shoal.weights import build_model

VOCAB = 512
LENGTHS = [1, 64, 7, 2, 33, 64, 5]  # mixed, from 1 token to the longest used

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaModel),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2Model),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3Model),
}
CASES = {
    "llama-gqa-2l-4h-2kv": (
        "llama",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128),
    ),
    "llama-mha-3l-8h-bias-theta500": (
        "llama",
        dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=8,
            hidden_size=128,
            intermediate_size=192,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        ),
    ),
    "llama-gqa-llama3-rope": (
        "llama",
        dict(
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            hidden_size=96,
            intermediate_size=160,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2-gqa-2l-4h-2kv": (
        "qwen2",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128),
    ),
    "qwen2-mha-3l-6h": (
        "qwen2",
        dict(
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=6,
            hidden_size=96,
            intermediate_size=224,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # head_dim 32 != hidden / heads (16): proves head_dim is read from the config.
    "qwen3-gqa-2l-4h-2kv-hd32": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=64,
            head_dim=32,
            intermediate_size=128,
        ),
    ),
    "qwen3-mha-3l-4h-hd24-bias": (
        "qwen3",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            hidden_size=80,
            head_dim=24,
            intermediate_size=96,
            attention_bias=True,
        ),
    ),
}


def save_random_decoder(directory, family: str, **shape) -> torch.nn.Module:
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    # initializer_range 0.1 (not 0.02): attention scores large enough that positions and causality matter.
    config = config_class(vocab_size=VOCAB, initializer_range=0.1, **shape)
    reference = model_class(config).eval()
    randomize_norms(reference, 0.2, all_biases=True)
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_packed_decoder_matches_transformers_on_mixed_lengths(tmp_path, case):
    family, shape = CASES[case]
    reference = save_random_decoder(tmp_path, family, **shape)
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB, first_id=0)

    hidden = packed_hidden_states(ours, batch)
    # Right-padded with an attention mask: under causal attention real tokens never see the pads.
    expected = reference_hidden_states(reference, batch)
    diff = max_abs_diff(hidden, expected)
    assert diff <= 1e-4, f"hidden states differ by {diff}"

    cosine = min_pooled_cosine(hidden, batch.meta, expected, "last")
    assert cosine >= 0.99999, f"last-token pooling cosine {cosine}"


def test_causal_attention_makes_a_prefix_independent_of_what_follows(tmp_path):
    family, shape = CASES["qwen3-gqa-2l-4h-2kv-hd32"]
    save_random_decoder(tmp_path, family, **shape)
    model = build_model(tmp_path, None, "cpu")
    batch = packed_batch([40], VOCAB, first_id=0)
    with torch.inference_mode():
        full = model(batch.inputs())
        prefix = model(PackedInputs(batch.input_ids[:25], batch.position_ids[:25], attention_meta([25])))
    assert (full[:25] - prefix).abs().max().item() <= 1e-5
    assert (full[25:] - full[24]).abs().max().item() > 1e-2  # later tokens do differ


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    family, shape = CASES["llama-gqa-2l-4h-2kv"]
    save_random_decoder(tmp_path, family, **shape)
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed_batch(LENGTHS, VOCAB, first_id=0), atol=1e-5, pooling="last")


@pytest.mark.parametrize(
    ("family", "extra", "message"),
    [
        (
            "llama",
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            "rope scaling type 'yarn'",
        ),
        ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "'linear'"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding-window"),
    ],
    ids=["yarn", "linear", "sliding-window"],
)
def test_an_unsupported_position_or_window_scheme_is_refused_by_name(tmp_path, family, extra, message):
    save_random_decoder(
        tmp_path, family, num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64, **extra
    )
    with pytest.raises(ModelLoadError, match=message):
        build_model(tmp_path, None, "cpu")


def test_a_legacy_config_with_rope_theta_and_rope_scaling_keys_is_read():
    from shoal.models.llama import LlamaConfig

    cfg = LlamaConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "intermediate_size": 8,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_llama3 == (32.0, 1.0, 4.0, 8192)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 1)
    with pytest.raises(ValueError, match="'dynamic'"):
        LlamaConfig.from_dict(
            {
                "model_type": "llama",
                "vocab_size": 10,
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "intermediate_size": 8,
                "rope_scaling": {"type": "dynamic", "factor": 2.0},
            }
        )
