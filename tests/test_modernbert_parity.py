"""shoal's packed ModernBERT against transformers.ModernBertModel on random-initialised checkpoints.

The configs use a local window of 16 tokens and sequences up to 64, so local layers really cut
attention short (a test below shows that dropping the window breaks parity).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.initialization import no_init_weights

from shoal.layers import AttentionMeta
from shoal.weights import build_model

VOCAB = 1000
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
SHAPES = {
    "tiny-4l-2h-global-every-2": dict(num_hidden_layers=4, num_attention_heads=2, hidden_size=32, intermediate_size=48,
                                      global_attn_every_n_layers=2, local_attention=16,
                                      global_rope_theta=5_000.0, local_rope_theta=100.0),
    "mini-5l-4h-global-every-3-biases": dict(num_hidden_layers=5, num_attention_heads=4, hidden_size=64,
                                             intermediate_size=96, global_attn_every_n_layers=3, local_attention=16,
                                             attention_bias=True, mlp_bias=True, norm_bias=True),
    "wide-3l-8h-gelu-tanh": dict(num_hidden_layers=3, num_attention_heads=8, hidden_size=256, intermediate_size=384,
                                 global_attn_every_n_layers=2, local_attention=24,
                                 hidden_activation="gelu_pytorch_tanh"),
}
LENGTHS = [1, 64, 7, 2, 40, 17, 64, 9]


def randomise(model: torch.nn.Module) -> None:
    """Fill every parameter: unit-variance activations, so attention is sharp enough that the
    local window matters, and norm weights and biases away from 1 and 0, so a swapped or skipped
    tensor cannot pass."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * module.in_features**-0.5)
            elif isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=g))
            if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


def random_reference(model_class=transformers.ModernBertModel, **shape):
    config = transformers.ModernBertConfig(vocab_size=VOCAB, max_position_embeddings=128, **SPECIAL_TOKENS, **shape)
    with no_init_weights():  # transformers' truncated-normal init is slow on CPU, and randomise overwrites it
        reference = model_class(config).eval()
    # Eager attention (explicit softmax over an additive mask): a different kernel from the packed
    # SDPA path shoal takes on CPU.
    reference.set_attn_implementation("eager")
    randomise(reference)
    return reference


def save_random_modernbert(directory, **shape) -> transformers.ModernBertModel:
    reference = random_reference(**shape)
    reference.save_pretrained(directory)
    return reference


def packed(lengths: list[int]):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    input_ids = torch.cat(seqs)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return seqs, input_ids, position_ids, AttentionMeta.build(cu, max(lengths))


def reference_hidden(reference, seqs) -> list[torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


def max_diff(hidden: torch.Tensor, expected: list[torch.Tensor]) -> float:
    got = torch.split(hidden, [len(e) for e in expected])
    return max((g - e).abs().max().item() for g, e in zip(got, expected))


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_modernbert_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_modernbert(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    seqs, input_ids, position_ids, meta = packed(LENGTHS)
    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    diff = max_diff(hidden, reference_hidden(reference, seqs))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_parity_fails_without_the_local_window_so_the_window_is_exercised(tmp_path):
    reference = save_random_modernbert(tmp_path, **SHAPES["tiny-4l-2h-global-every-2"])
    ours = build_model(tmp_path, None, "cpu")
    for layer in ours.layers:
        layer.window = None  # every layer global: wrong for the local ones
    seqs, input_ids, position_ids, meta = packed(LENGTHS)
    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    expected = reference_hidden(reference, seqs)
    short = [i for i, n in enumerate(LENGTHS) if n <= 16 // 2 + 1]  # the window covers them whole
    long = [i for i, n in enumerate(LENGTHS) if n > 16]
    got = torch.split(hidden, LENGTHS)
    assert max((got[i] - expected[i]).abs().max().item() for i in short) <= 1e-4
    assert min((got[i] - expected[i]).abs().max().item() for i in long) > 1e-1


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
    seqs, input_ids, position_ids, meta = packed(LENGTHS)
    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    diff = max_diff(hidden, reference_hidden(reference, seqs))
    assert diff <= 1e-4, f"hidden states differ by {diff}"


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_modernbert(tmp_path, **SHAPES["mini-5l-4h-global-every-3-biases"])
    model = build_model(tmp_path, None, "cpu")
    seqs, input_ids, position_ids, meta = packed(LENGTHS)
    with torch.inference_mode():
        batch = torch.split(model(input_ids, position_ids, meta), LENGTHS)
        for i, s in enumerate(seqs):
            alone_meta = AttentionMeta.build(torch.tensor([0, len(s)], dtype=torch.int32), len(s))
            alone = model(s, torch.arange(len(s)), alone_meta)
            assert (alone - batch[i]).abs().max().item() <= 1e-5


def test_a_masked_lm_checkpoint_loads_its_encoder_and_ignores_the_head(tmp_path):
    reference = random_reference(transformers.ModernBertForMaskedLM, **SHAPES["tiny-4l-2h-global-every-2"])
    reference.save_pretrained(tmp_path)
    ours = build_model(tmp_path, None, "cpu")
    seqs, input_ids, position_ids, meta = packed(LENGTHS)
    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    diff = max_diff(hidden, reference_hidden(reference.model, seqs))
    assert diff <= 1e-4, f"hidden states differ by {diff}"
