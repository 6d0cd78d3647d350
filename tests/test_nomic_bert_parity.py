"""shoal's packed NomicBERT against transformers.NomicBertModel on random-initialised checkpoints.

The reference is the upstream one: transformers (5.x) ships NomicBERT natively
(`transformers/models/nomic_bert/`), and its `save_pretrained` writes the tensor names of nomic's
own checkpoints (`emb_ln`, `encoder.layers.N.attn.Wqkv`, `mlp.fc11`/`fc12`/`fc2`, `norm1`/`norm2`),
through its conversion mapping. So these tests load exactly the names published checkpoints carry.
transformers writes config.json in its own layout (`hidden_size`, `rope_parameters`); published
nomic checkpoints use nomic's GPT-2-style layout (`n_embd`, `rotary_emb_base`...), which one test
below writes by hand, with the keys and defaults of nomic's `configuration_hf_nomic_bert.py`.
"""

from __future__ import annotations

import json

import pytest
import transformers

from parity import (
    assert_packing_invariant,
    max_abs_diff,
    packed_batch,
    packed_hidden_states,
    random_eager_reference,
    reference_hidden_states,
)
from shoal.errors import ModelLoadError
from shoal.weights import build_model

VOCAB = 1024
SHAPES = {
    "tiny-2l-2h": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64),
    "mini-4l-4h-theta-10000": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_size=128,
        intermediate_size=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    "wide-3l-12h": dict(num_hidden_layers=3, num_attention_heads=12, hidden_size=384, intermediate_size=512),
    "head-dim-24-2l-4h": dict(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=96, head_dim=24
    ),
}
LENGTHS = [1, 128, 7, 2, 63, 100, 30, 5]


def save_random_nomic_bert(directory, **shape) -> transformers.NomicBertModel:
    reference = random_eager_reference(transformers.NomicBertModel, nomic_bert_config(**shape))
    reference.save_pretrained(directory)
    return reference


def nomic_bert_config(**shape) -> transformers.NomicBertConfig:
    return transformers.NomicBertConfig(vocab_size=VOCAB, max_position_embeddings=256, **shape)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_nomic_bert_matches_transformers_on_mixed_lengths_and_token_types(tmp_path, shape):
    reference = save_random_nomic_bert(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB, token_types=True)
    hidden = packed_hidden_states(ours, batch, with_token_types=True)
    diff = max_abs_diff(hidden, reference_hidden_states(reference, batch, with_token_types=True))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def nomic_layout_config(**overrides) -> dict:
    """config.json as nomic-embed-text checkpoints write it (GPT-2-style keys), for the
    "mini-4l-4h-theta-10000" shape. n_inner 200 and vocab_size 1000 are rounded up by nomic's code
    (MLP width to a multiple of 256, vocabulary to pad_vocab_size_multiple) to the saved 256 and 1024."""
    config = dict(
        model_type="nomic_bert",
        architectures=["NomicBertModel"],
        n_embd=128,
        n_head=4,
        n_layer=4,
        n_inner=200,
        n_positions=256,
        vocab_size=1000,
        pad_vocab_size_multiple=64,
        type_vocab_size=2,
        layer_norm_epsilon=1e-12,
        activation_function="swiglu",
        prenorm=False,
        parallel_block=False,
        rotary_emb_fraction=1.0,
        rotary_emb_base=10_000,
        rotary_emb_interleaved=False,
        rotary_emb_scale_base=None,
        rotary_scaling_factor=None,
        qkv_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        use_rms_norm=False,
        causal=False,
    )
    config.update(overrides)
    return config


def test_nomic_config_layout_loads_the_same_model_with_nomics_size_rounding(tmp_path):
    reference = save_random_nomic_bert(tmp_path, **SHAPES["mini-4l-4h-theta-10000"])
    (tmp_path / "config.json").write_text(json.dumps(nomic_layout_config()))
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB)
    hidden = packed_hidden_states(ours, batch)  # no token types: segment 0 for all
    diff = max_abs_diff(hidden, reference_hidden_states(reference, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_a_nomic_config_that_omits_the_rotary_base_and_scaling_gets_nomics_defaults(tmp_path):
    """nomic's config class defaults `rotary_emb_base` to 10,000 and `rotary_scaling_factor` to
    none (plain rotary): the model equals the theta-10000 reference."""
    reference = save_random_nomic_bert(tmp_path, **SHAPES["mini-4l-4h-theta-10000"])
    config = nomic_layout_config()
    del config["rotary_emb_base"], config["rotary_scaling_factor"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


@pytest.mark.parametrize(
    "key, value",
    [
        ("prenorm", True),
        ("qkv_proj_bias", True),
        ("mlp_fc1_bias", True),
        ("rotary_emb_fraction", 0.5),
        ("rotary_emb_interleaved", True),
        ("rotary_scaling_factor", 2.0),
        ("activation_function", "gelu"),
        ("use_rms_norm", True),
    ],
)
def test_nomic_variants_shoal_does_not_implement_are_refused_by_name(tmp_path, key, value):
    (tmp_path / "config.json").write_text(json.dumps(nomic_layout_config(**{key: value})))
    with pytest.raises(ModelLoadError, match=key):
        build_model(tmp_path, None, "cpu")


def test_a_nomic_config_that_omits_the_bias_flags_is_refused_because_nomic_defaults_them_on(tmp_path):
    config = nomic_layout_config()
    del config["qkv_proj_bias"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="qkv_proj_bias=True"):
        build_model(tmp_path, None, "cpu")


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_nomic_bert(tmp_path, **SHAPES["tiny-2l-2h"])
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed_batch(LENGTHS, VOCAB), atol=1e-5)


def test_a_masked_lm_checkpoint_loads_its_encoder_and_ignores_the_head(tmp_path):
    reference = random_eager_reference(transformers.NomicBertForMaskedLM, nomic_bert_config(**SHAPES["tiny-2l-2h"]))
    reference.save_pretrained(tmp_path)  # tensors under "nomic_bert.", head under "cls."
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference.nomic_bert, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"
