"""shoal's packed BERT against transformers.BertModel on random-initialised checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import (
    assert_packing_invariant,
    max_abs_diff,
    min_pooled_cosine,
    packed_batch,
    packed_hidden_states,
    randomize_norms,
    reference_hidden_states,
)
from shoal.weights import build_model

SHAPES = {
    "tiny-2l-2h": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64),
    "mini-4l-4h": dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128, intermediate_size=512),
    "wide-3l-12h": dict(num_hidden_layers=3, num_attention_heads=12, hidden_size=384, intermediate_size=1536),
    "gelu-tanh-1l-8h": dict(
        num_hidden_layers=1, num_attention_heads=8, hidden_size=256, intermediate_size=320, hidden_act="gelu_new"
    ),
}
VOCAB = 1000
MAX_POSITIONS = 128


def save_random_bert(directory, **shape) -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, **shape
    )
    reference = transformers.BertModel(config, add_pooling_layer=True).eval()
    randomize_norms(reference, 0.1)
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_bert_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_bert(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch([1, MAX_POSITIONS, 7, 2, 63, 128, 30, 5], VOCAB)

    hidden = packed_hidden_states(ours, batch)
    expected = reference_hidden_states(reference, batch)
    diff = max_abs_diff(hidden, expected)
    assert diff <= 1e-4, f"hidden states differ by {diff}"

    for method in ("cls", "mean", "last"):
        cosine = min_pooled_cosine(hidden, batch.meta, expected, method)
        assert cosine >= 0.99999, f"{method} pooling cosine {cosine}"


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_bert(tmp_path, **SHAPES["mini-4l-4h"])
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed_batch([40, 3, 128, 17, 1, 99], VOCAB), atol=1e-5, pooling="mean")


def test_a_checkpoint_missing_a_tensor_is_refused_with_its_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from shoal.errors import ModelLoadError

    save_random_bert(tmp_path, **SHAPES["tiny-2l-2h"])
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["encoder.layer.1.attention.self.key.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.qkv.weight"):
        build_model(tmp_path, None, "cpu")


def test_a_pytorch_bin_checkpoint_loads_the_same_as_safetensors(tmp_path):
    reference = save_random_bert(tmp_path / "st", **SHAPES["tiny-2l-2h"])
    (tmp_path / "bin").mkdir()
    torch.save(reference.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    from_safetensors = build_model(tmp_path / "st", None, "cpu")
    from_bin = build_model(tmp_path / "bin", None, "cpu")
    for (name, a), (_, b) in zip(from_safetensors.named_parameters(), from_bin.named_parameters()):
        assert torch.equal(a, b), name
