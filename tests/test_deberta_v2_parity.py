"""shoal's packed DeBERTa-v2/v3 against transformers.DebertaV2Model on random-initialised checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import (
    assert_packing_invariant,
    max_abs_diff,
    packed_batch,
    packed_hidden_states,
    randomize_norms,
    reference_hidden_states,
)
from shoal.weights import build_model

VOCAB = 500
V3 = dict(  # DeBERTa-v3's attention settings; fewer buckets so sequences of ~100 reach the log-scale ones
    relative_attention=True,
    position_buckets=32,
    max_relative_positions=-1,
    max_position_embeddings=512,
    norm_rel_ebd="layer_norm",
    share_att_key=True,
    pos_att_type=["p2c", "c2p"],
    position_biased_input=False,
    type_vocab_size=0,
    hidden_act="gelu",
)
CONFIGS = {
    "v3-2l-4h-buckets32": dict(V3, num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128),
    "v3-3l-6h-buckets16": dict(
        V3,
        num_hidden_layers=3,
        num_attention_heads=6,
        hidden_size=192,
        intermediate_size=256,
        position_buckets=16,
        max_relative_positions=96,
    ),
    # DeBERTa-v2: unbucketed distances clamped at 48 (< the longest sequence), separate position
    # projections, absolute positions, segment embeddings, a factorised embedding.
    "v2-unshared-unbucketed": dict(
        relative_attention=True,
        position_buckets=-1,
        max_relative_positions=48,
        max_position_embeddings=128,
        norm_rel_ebd="none",
        share_att_key=False,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=True,
        type_vocab_size=2,
        embedding_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=64,
        intermediate_size=96,
        hidden_act="gelu_new",
    ),
    # DeBERTa-v2 xlarge style: the convolution branch after layer 0; c2p only, given in the legacy string form.
    "v2-conv-c2p-only": dict(
        relative_attention=True,
        position_buckets=32,
        max_relative_positions=128,
        max_position_embeddings=128,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        pos_att_type="c2p",
        position_biased_input=False,
        type_vocab_size=0,
        conv_kernel_size=3,
        conv_act="gelu",
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=32,
        intermediate_size=64,
    ),
}
LENGTHS = [1, 100, 7, 2, 63, 90, 30, 5]


def save_random_deberta(directory, **config) -> transformers.DebertaV2Model:
    torch.manual_seed(0)
    reference = transformers.DebertaV2Model(transformers.DebertaV2Config(vocab_size=VOCAB, **config)).eval()
    # Every bias too (linear and convolution), so a swapped weight, bias or q/k shard cannot pass.
    randomize_norms(reference, 0.1, all_biases=True)
    reference.save_pretrained(directory)
    return reference


@pytest.mark.parametrize("name", CONFIGS, ids=list(CONFIGS))
def test_packed_deberta_v2_matches_transformers_on_mixed_lengths(tmp_path, name):
    reference = save_random_deberta(tmp_path, **CONFIGS[name])
    ours = build_model(tmp_path, None, "cpu")
    batch = packed_batch(LENGTHS, VOCAB, token_types=True)
    with_token_types = reference.config.type_vocab_size > 0

    hidden = packed_hidden_states(ours, batch, with_token_types=with_token_types)
    expected = reference_hidden_states(reference, batch, with_token_types=with_token_types)
    diff = max_abs_diff(hidden, expected)
    assert diff <= 1e-4, f"{name}: hidden states differ by {diff}"


def test_log_buckets_match_transformers_beyond_the_longest_test_sequence():
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    from shoal.models.deberta_v2 import DebertaV2Config, relative_positions

    for buckets, max_rel in ((256, 512), (32, 512), (16, 96)):
        cfg = DebertaV2Config.from_dict(
            dict(
                vocab_size=10,
                hidden_size=8,
                num_hidden_layers=1,
                num_attention_heads=1,
                intermediate_size=8,
                relative_attention=True,
                position_buckets=buckets,
                max_relative_positions=max_rel,
            )
        )
        ours = relative_positions(512, cfg, torch.device("cpu"))
        offset = torch.arange(512)[:, None] - torch.arange(512)[None, :]
        assert torch.equal(ours, make_log_bucket_position(offset, buckets, max_rel).long())


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_deberta(tmp_path, **CONFIGS["v3-2l-4h-buckets32"])
    model = build_model(tmp_path, None, "cpu")
    assert_packing_invariant(model, packed_batch(LENGTHS, VOCAB), atol=1e-5)


def test_disentangled_attention_runs_through_the_attention_seam(tmp_path, monkeypatch):
    """Every layer's attention is one `varlen_attention` call with the c2p/p2c terms as its score
    bias: the seam, not the model file, picks the kernel."""
    from shoal.layers import attention
    from shoal.models.deberta_v2 import DisentangledBias

    calls = []
    real = attention.varlen_attention

    def recording(q, k, v, meta, **kw):
        calls.append(type(kw.get("bias")))
        return real(q, k, v, meta, **kw)

    save_random_deberta(tmp_path, **CONFIGS["v3-2l-4h-buckets32"])
    model = build_model(tmp_path, None, "cpu")
    monkeypatch.setattr("shoal.models.deberta_v2.varlen_attention", recording)
    packed_hidden_states(model, packed_batch(LENGTHS, VOCAB))
    assert calls == [DisentangledBias] * 2


def test_a_checkpoint_missing_the_relative_embeddings_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from shoal.errors import ModelLoadError

    save_random_deberta(tmp_path, **CONFIGS["v3-2l-4h-buckets32"])
    tensors = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith("embeddings.position_embeddings") for k in tensors)  # v3: no absolute positions
    del tensors["encoder.rel_embeddings.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="rel_embeddings.weight"):
        build_model(tmp_path, None, "cpu")


def test_a_task_model_checkpoint_loads_its_deberta_prefixed_encoder(tmp_path):
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=VOCAB, num_labels=3, **CONFIGS["v2-conv-c2p-only"])
    reference = transformers.DebertaV2ForTokenClassification(config).eval()  # "deberta.*" + "classifier.*"
    reference.save_pretrained(tmp_path)
    model = build_model(tmp_path, None, "cpu")
    batch = packed_batch([9, 40, 1], VOCAB)
    hidden = packed_hidden_states(model, batch)
    assert max_abs_diff(hidden, reference_hidden_states(reference.deberta, batch)) <= 1e-4
