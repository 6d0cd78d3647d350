"""shoal's packed MPNet against transformers.MPNetModel on random-initialised checkpoints: BERT's layer,
a bucketed relative-position bias shared by all layers, positions numbered from the padding index."""

from __future__ import annotations

import pytest
import torch
import transformers

from shoal.layers import AttentionMeta
from shoal.models.mpnet import relative_position_bucket
from shoal.weights import build_model

PAD = 1  # transformers' MPNet hard-codes it
# Past MAX_DISTANCE (128) all far offsets share a bucket: the longest sequence reaches it.
MAX_LENGTH = 160
MAX_POSITIONS = MAX_LENGTH + PAD + 1

SHAPES = {
    "tiny-2l-2h": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64),
    "mini-3l-12h": dict(num_hidden_layers=3, num_attention_heads=12, hidden_size=192, intermediate_size=768,
                        layer_norm_eps=1e-5),
    "gelu-tanh-2l-8h": dict(num_hidden_layers=2, num_attention_heads=8, hidden_size=128, intermediate_size=320,
                            hidden_act="gelu_new"),
}


def save_random_mpnet(directory, **shape) -> transformers.MPNetModel:
    torch.manual_seed(0)
    config = transformers.MPNetConfig(vocab_size=1000, max_position_embeddings=MAX_POSITIONS, **shape)
    reference = transformers.MPNetModel(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        # Non-trivial LayerNorm parameters, so a swapped weight and bias cannot pass; a bias table
        # large enough that a wrong bucket or a transposed [L, L] changes the output visibly.
        for module in reference.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
        reference.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
        reference.embeddings.position_embeddings.weight.normal_(0.0, 0.5)
    reference.save_pretrained(directory)
    return reference


def packed(lengths: list[int], vocab: int = 1000):
    g = torch.Generator().manual_seed(1)
    # Ids from PAD + 1 up: the reference numbers positions by skipping pad ids, which real text lacks.
    seqs = [torch.randint(PAD + 1, vocab, (n,), generator=g) for n in lengths]
    input_ids = torch.cat(seqs)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return seqs, input_ids, position_ids, AttentionMeta.build(cu, max(lengths))


def reference_hidden(reference, seqs) -> list[torch.Tensor]:
    """Right-padded with the pad id, as a tokenizer pads; the reference derives positions from it."""
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


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
    lengths = [1, MAX_LENGTH, 7, 2, 63, 130, 30, 5]
    seqs, input_ids, position_ids, meta = packed(lengths)

    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    expected = reference_hidden(reference, seqs)

    got = torch.split(hidden, lengths)
    max_diff = max((g - e).abs().max().item() for g, e in zip(got, expected))
    assert max_diff <= 1e-4, f"hidden states differ by {max_diff}"


def test_an_mpnet_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_mpnet(tmp_path, **SHAPES["tiny-2l-2h"])
    model = build_model(tmp_path, None, "cpu")
    lengths = [40, 3, MAX_LENGTH, 17, 1]
    seqs, input_ids, position_ids, meta = packed(lengths)
    with torch.inference_mode():
        batch = torch.split(model(input_ids, position_ids, meta), lengths)
        for i, s in enumerate(seqs):
            alone_meta = AttentionMeta.build(torch.tensor([0, len(s)], dtype=torch.int32), len(s))
            alone = model(s, torch.arange(len(s)), alone_meta)
            assert (alone - batch[i]).abs().max().item() <= 1e-5
