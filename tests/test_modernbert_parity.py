"""shoal's packed ModernBERT against transformers.ModernBertModel on random-initialised checkpoints.

The configs use a local window of 16 tokens and sequences up to 64, so local layers really cut
attention short (a test below shows that dropping the window breaks parity).
"""

from __future__ import annotations

import json

import pytest
import transformers

from parity import (
    PackedBatch,
    assert_packing_invariant,
    max_abs_diff,
    packed_batch,
    packed_hidden_states,
    per_sequence_abs_diff,
    random_eager_reference,
    reference_hidden_states,
)
from shoal.weights import build_model

VOCAB = 1000
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
SHAPES = {
    "tiny-4l-2h-global-every-2": dict(
        num_hidden_layers=4,
        num_attention_heads=2,
        hidden_size=32,
        intermediate_size=48,
        global_attn_every_n_layers=2,
        local_attention=16,
        global_rope_theta=5_000.0,
        local_rope_theta=100.0,
    ),
    "mini-5l-4h-global-every-3-biases": dict(
        num_hidden_layers=5,
        num_attention_heads=4,
        hidden_size=64,
        intermediate_size=96,
        global_attn_every_n_layers=3,
        local_attention=16,
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
    ),
    "wide-3l-8h-gelu-tanh": dict(
        num_hidden_layers=3,
        num_attention_heads=8,
        hidden_size=256,
        intermediate_size=384,
        global_attn_every_n_layers=2,
        local_attention=24,
        hidden_activation="gelu_pytorch_tanh",
    ),
}
LENGTHS = [1, 64, 7, 2, 40, 17, 64, 9]


def save_random_modernbert(directory, **shape) -> transformers.ModernBertModel:
    reference = random_eager_reference(transformers.ModernBertModel, modernbert_config(**shape))
    reference.save_pretrained(directory)
    return reference


def modernbert_config(**shape) -> transformers.ModernBertConfig:
    return transformers.ModernBertConfig(vocab_size=VOCAB, max_position_embeddings=128, **SPECIAL_TOKENS, **shape)


def packed(lengths: list[int]) -> PackedBatch:
    return packed_batch(lengths, VOCAB, first_id=3)  # above the special tokens


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_modernbert_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_modernbert(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed(LENGTHS)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_parity_fails_without_the_local_window_so_the_window_is_exercised(tmp_path):
    reference = save_random_modernbert(tmp_path, **SHAPES["tiny-4l-2h-global-every-2"])
    ours = build_model(tmp_path, None, "cpu")
    for layer in ours.layers:
        layer.window = None  # every layer global: wrong for the local ones
    batch = packed(LENGTHS)
    diffs = per_sequence_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch))
    short = [i for i, n in enumerate(LENGTHS) if n <= 16 // 2 + 1]  # the window covers them whole
    long = [i for i, n in enumerate(LENGTHS) if n > 16]
    assert max(diffs[i] for i in short) <= 1e-4
    assert min(diffs[i] for i in long) > 1e-1


def test_original_config_layout_loads_the_same_model(tmp_path):
    """Hub checkpoints predate transformers 5: `global_attn_every_n_layers` and the two rope
    thetas, without `layer_types` / `rope_parameters`."""
    reference = save_random_modernbert(tmp_path, **SHAPES["tiny-4l-2h-global-every-2"])
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(global_attn_every_n_layers=2, global_rope_theta=5_000.0, local_rope_theta=100.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = build_model(tmp_path, None, "cpu")
    assert [layer.window for layer in ours.layers] == [None, (8, 8), None, (8, 8)]
    batch = packed(LENGTHS)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_modernbert(tmp_path, **SHAPES["mini-5l-4h-global-every-3-biases"])
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed(LENGTHS), atol=1e-5)


def test_a_masked_lm_checkpoint_loads_its_encoder_and_ignores_the_head(tmp_path):
    config = modernbert_config(**SHAPES["tiny-4l-2h-global-every-2"])
    reference = random_eager_reference(transformers.ModernBertForMaskedLM, config)
    reference.save_pretrained(tmp_path)
    ours = build_model(tmp_path, None, "cpu")
    batch = packed(LENGTHS)
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference.model, batch))
    assert diff <= 1e-4, f"hidden states differ by {diff}"
