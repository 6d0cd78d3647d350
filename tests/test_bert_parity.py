"""shoal's packed BERT against transformers.BertModel on random-initialised checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from shoal.heads import pool
from shoal.layers import AttentionMeta
from shoal.weights import build_model

SHAPES = {
    "tiny-2l-2h": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64),
    "mini-4l-4h": dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128, intermediate_size=512),
    "wide-3l-12h": dict(num_hidden_layers=3, num_attention_heads=12, hidden_size=384, intermediate_size=1536),
    "gelu-tanh-1l-8h": dict(num_hidden_layers=1, num_attention_heads=8, hidden_size=256, intermediate_size=320,
                            hidden_act="gelu_new"),
}
MAX_POSITIONS = 128


def save_random_bert(directory, **shape) -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, **shape)
    reference = transformers.BertModel(config, add_pooling_layer=True).eval()
    # Non-trivial LayerNorm parameters, so a swapped weight and bias cannot pass.
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
    reference.save_pretrained(directory)
    return reference


def packed(lengths: list[int], vocab: int = 1000):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
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


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_packed_bert_matches_transformers_on_mixed_lengths(tmp_path, shape):
    reference = save_random_bert(tmp_path, **SHAPES[shape])
    ours = build_model(tmp_path, None, "cpu")
    lengths = [1, MAX_POSITIONS, 7, 2, 63, 128, 30, 5]
    seqs, input_ids, position_ids, meta = packed(lengths)

    with torch.inference_mode():
        hidden = ours(input_ids, position_ids, meta)
    expected = reference_hidden(reference, seqs)

    got = torch.split(hidden, lengths)
    max_diff = max((g - e).abs().max().item() for g, e in zip(got, expected))
    assert max_diff <= 1e-4, f"hidden states differ by {max_diff}"

    for method in ("cls", "mean", "last"):
        pooled = pool(hidden, meta, method)
        if method == "cls":
            ref = torch.stack([e[0] for e in expected])
        elif method == "last":
            ref = torch.stack([e[-1] for e in expected])
        else:
            ref = torch.stack([e.mean(0) for e in expected])
        cosine = torch.nn.functional.cosine_similarity(pooled, ref, dim=-1)
        assert cosine.min().item() >= 0.99999, f"{method} pooling cosine {cosine.min().item()}"


def test_a_sequence_alone_and_inside_a_mixed_batch_gives_the_same_output(tmp_path):
    save_random_bert(tmp_path, **SHAPES["mini-4l-4h"])
    model = build_model(tmp_path, None, "cpu")
    lengths = [40, 3, 128, 17, 1, 99]
    seqs, input_ids, position_ids, meta = packed(lengths)
    with torch.inference_mode():
        batch = pool(model(input_ids, position_ids, meta), meta, "mean")
        for i, s in enumerate(seqs):
            alone_meta = AttentionMeta.build(torch.tensor([0, len(s)], dtype=torch.int32), len(s))
            alone = pool(model(s, torch.arange(len(s)), alone_meta), alone_meta, "mean")[0]
            assert (alone - batch[i]).abs().max().item() <= 1e-5


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
