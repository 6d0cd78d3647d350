"""shoal's packed MPNet against transformers.MPNetModel on random-initialised checkpoints: BERT's layer,
a bucketed relative-position bias shared by all layers, positions numbered from the padding index."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import (
    PackedBatch,
    assert_packing_invariant,
    max_abs_diff,
    packed_batch,
    packed_hidden_states,
    randomize_norms,
    reference_hidden_states,
)
from shoal.models.mpnet import relative_position_bucket
from shoal.weights import build_model

VOCAB = 1000
PAD = 1  # transformers' MPNet hard-codes it
# Past MAX_DISTANCE (128) all far offsets share a bucket: the longest sequence reaches it.
MAX_LENGTH = 160
MAX_POSITIONS = MAX_LENGTH + PAD + 1

SHAPES = {
    "tiny-2l-2h": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64),
    "mini-3l-12h": dict(
        num_hidden_layers=3, num_attention_heads=12, hidden_size=192, intermediate_size=768, layer_norm_eps=1e-5
    ),
    "gelu-tanh-2l-8h": dict(
        num_hidden_layers=2, num_attention_heads=8, hidden_size=128, intermediate_size=320, hidden_act="gelu_new"
    ),
}


def save_random_mpnet(directory, **shape) -> transformers.MPNetModel:
    torch.manual_seed(0)
    config = transformers.MPNetConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, **shape)
    reference = transformers.MPNetModel(config, add_pooling_layer=True).eval()
    randomize_norms(reference, 0.1)
    with torch.no_grad():
        # A bias table large enough that a wrong bucket or a transposed [L, L] changes the output
        # visibly; a non-zero padding row, so a position off by one reads a different vector.
        reference.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
        reference.embeddings.position_embeddings.weight.normal_(0.0, 0.5)
    reference.save_pretrained(directory)
    return reference


def packed(lengths: list[int]) -> PackedBatch:
    # Ids from PAD + 1 up: the reference numbers positions by skipping pad ids, which real text lacks.
    return packed_batch(lengths, VOCAB, first_id=PAD + 1)


def test_relative_position_buckets_equal_transformers_for_every_offset_up_to_the_longest():
    positions = torch.arange(MAX_LENGTH)
    relative = positions[None, :] - positions[:, None]
    expected = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(relative)
    got = relative_position_bucket(relative)
    assert torch.equal(got, expected)
    # Every bucket is in use but 16: offset 0 counts as "before" (bucket 0), so the "after" half
    # starts at +1 (bucket 17). Near and far offsets in both directions are exercised.
    assert got.unique().tolist() == [b for b in range(32) if b != 16]


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_mpnet_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_mpnet(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed([1, MAX_LENGTH, 7, 2, 63, 130, 30, 5])

    # The reference is right-padded with the pad id, as a tokenizer pads; it derives positions from it.
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch, pad_id=PAD))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_an_mpnet_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_mpnet(tmp_path, **SHAPES["tiny-2l-2h"])
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed([40, 3, MAX_LENGTH, 17, 1]), atol=1e-5)
