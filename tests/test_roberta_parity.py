"""shoal's packed RoBERTa against transformers.RobertaModel and XLMRobertaModel on random-initialised
checkpoints: same encoder as BERT, positions numbered from the padding index, `roberta.` prefixes."""

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
from shoal.weights import build_model

VOCAB = 1000
PAD = 1
MAX_LENGTH = 128  # the longest sequence: max_position_embeddings - PAD - 1
MAX_POSITIONS = MAX_LENGTH + PAD + 1

SHAPES = {
    "roberta-2l-2h": (
        transformers.RobertaConfig,
        transformers.RobertaModel,
        dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64, type_vocab_size=1),
    ),
    "roberta-3l-12h-gelu-tanh": (
        transformers.RobertaConfig,
        transformers.RobertaModel,
        dict(
            num_hidden_layers=3,
            num_attention_heads=12,
            hidden_size=384,
            intermediate_size=1536,
            type_vocab_size=1,
            hidden_act="gelu_new",
        ),
    ),
    "xlm-roberta-2l-4h": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=128, intermediate_size=512, type_vocab_size=1),
    ),
    "xlm-roberta-4l-8h-2types": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        dict(num_hidden_layers=4, num_attention_heads=8, hidden_size=256, intermediate_size=320, type_vocab_size=2),
    ),
}


def save_random_roberta(directory, shape: str):
    config_class, model_class, dims = SHAPES[shape]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        **dims,
    )
    reference = model_class(config, add_pooling_layer=True).eval()
    randomize_norms(reference, 0.1)
    with torch.no_grad():
        # A non-zero padding row, so a position off by one reads a different vector.
        reference.embeddings.position_embeddings.weight.normal_(0.0, 0.5)
    reference.save_pretrained(directory)
    return reference


def packed(lengths: list[int]) -> PackedBatch:
    # Ids from PAD + 1 up: the reference numbers positions by skipping pad ids, which real text lacks.
    return packed_batch(lengths, VOCAB, first_id=PAD + 1)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_roberta_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_roberta(tmp_path, shape)
    ours = build_model(tmp_path, None, "cpu")
    batch = packed([1, MAX_LENGTH, 7, 2, 63, MAX_LENGTH, 30, 5])

    # The reference is right-padded with the pad id, as a tokenizer pads; it derives positions from it.
    diff = max_abs_diff(packed_hidden_states(ours, batch), reference_hidden_states(reference, batch, pad_id=PAD))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_a_roberta_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_roberta(tmp_path, "xlm-roberta-2l-4h")
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed([40, 3, MAX_LENGTH, 17, 1]), atol=1e-5)


def test_a_masked_lm_checkpoint_loads_through_its_roberta_prefix(tmp_path):
    """RobertaForMaskedLM stores `roberta.encoder...` and an `lm_head`: same hidden states, head ignored."""
    _, _, dims = SHAPES["roberta-2l-2h"]
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD, **dims
    )
    reference = transformers.RobertaForMaskedLM(config).eval()
    reference.save_pretrained(tmp_path)
    ours = build_model(tmp_path, None, "cpu")
    batch = packed([9, 33, 1])
    hidden = packed_hidden_states(ours, batch)
    assert max_abs_diff(hidden, reference_hidden_states(reference.roberta, batch, pad_id=PAD)) <= 1e-4
