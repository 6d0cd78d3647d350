"""shoal's packed RoBERTa against transformers.RobertaModel and XLMRobertaModel on random-initialised
checkpoints: same encoder as BERT, positions numbered from the padding index, `roberta.` prefixes."""

from __future__ import annotations

import pytest
import torch
import transformers

from shoal.layers import AttentionMeta
from shoal.weights import build_model

PAD = 1
MAX_LENGTH = 128  # the longest sequence: max_position_embeddings - PAD - 1
MAX_POSITIONS = MAX_LENGTH + PAD + 1

SHAPES = {
    "roberta-2l-2h": (transformers.RobertaConfig, transformers.RobertaModel,
                      dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
                           type_vocab_size=1)),
    "roberta-3l-12h-gelu-tanh": (transformers.RobertaConfig, transformers.RobertaModel,
                                 dict(num_hidden_layers=3, num_attention_heads=12, hidden_size=384,
                                      intermediate_size=1536, type_vocab_size=1, hidden_act="gelu_new")),
    "xlm-roberta-2l-4h": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                          dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=128, intermediate_size=512,
                               type_vocab_size=1)),
    "xlm-roberta-4l-8h-2types": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                                 dict(num_hidden_layers=4, num_attention_heads=8, hidden_size=256,
                                      intermediate_size=320, type_vocab_size=2)),
}


def save_random_roberta(directory, shape: str):
    config_class, model_class, dims = SHAPES[shape]
    torch.manual_seed(0)
    config = config_class(vocab_size=1000, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD,
                          bos_token_id=0, eos_token_id=2, **dims)
    reference = model_class(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        # Non-trivial LayerNorm parameters, so a swapped weight and bias cannot pass; a non-zero
        # padding row, so a position off by one reads a different vector.
        for module in reference.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
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


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_roberta_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_roberta(tmp_path, shape)
    ours = build_model(tmp_path, None, "cpu")
    lengths = [1, MAX_LENGTH, 7, 2, 63, MAX_LENGTH, 30, 5]
    seqs, input_ids, position_ids, meta = packed(lengths)

    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    expected = reference_hidden(reference, seqs)

    got = torch.split(hidden, lengths)
    max_diff = max((g - e).abs().max().item() for g, e in zip(got, expected))
    assert max_diff <= 1e-4, f"hidden states differ by {max_diff}"


def test_a_roberta_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_roberta(tmp_path, "xlm-roberta-2l-4h")
    model = build_model(tmp_path, None, "cpu")
    lengths = [40, 3, MAX_LENGTH, 17, 1]
    seqs, input_ids, position_ids, meta = packed(lengths)
    with torch.inference_mode():
        batch = torch.split(model(input_ids, position_ids, meta), lengths)
        for i, s in enumerate(seqs):
            alone_meta = AttentionMeta.build(torch.tensor([0, len(s)], dtype=torch.int32), len(s))
            alone = model(s, torch.arange(len(s)), alone_meta)
            assert (alone - batch[i]).abs().max().item() <= 1e-5


def test_a_masked_lm_checkpoint_loads_through_its_roberta_prefix(tmp_path):
    """RobertaForMaskedLM stores `roberta.encoder...` and an `lm_head`: same hidden states, head ignored."""
    _, _, dims = SHAPES["roberta-2l-2h"]
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=1000, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD,
                                        **dims)
    reference = transformers.RobertaForMaskedLM(config).eval()
    reference.save_pretrained(tmp_path)
    ours = build_model(tmp_path, None, "cpu")
    seqs, input_ids, position_ids, meta = packed([9, 33, 1])
    with torch.inference_mode():
        hidden = torch.split(ours(input_ids, position_ids, meta), [9, 33, 1])
    expected = reference_hidden(reference.roberta, seqs)
    assert max((g - e).abs().max().item() for g, e in zip(hidden, expected)) <= 1e-4
