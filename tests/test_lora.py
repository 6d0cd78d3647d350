"""PEFT LoRA adapters served per sequence, never merged: shoal against peft run here, on random
BERT, XLM-R, ModernBERT, Qwen3 and DeBERTa-v3 backbones, through `ModelRunner.add_adapter` and
`forward`.

References are peft's own forward (the unmerged `PeftModel`) and `merge_and_unload()` on padded
inputs; a batch mixing adapters and the bare base is compared with each sequence run alone, and its
base sequences with the same batch run without adapters, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_models import (
    BACKBONES,
    card,
    random_sequences,
    reference_outputs,
    runner_vectors,
    save_adapter,
    save_backbone,
)
from parity import attention_meta, max_abs_diff
from shoal.engine.lora import read_adapter
from shoal.engine.runner import ModelRunner
from shoal.errors import InferenceFailed, ModelLoadError
from shoal.layers import LoraRouting, PackedInputs
from shoal.weights import build_model

LENGTHS = [1, 40, 7, 2, 23, 64, 5]
CPU = torch.device("cpu")


def pooled(states: list[torch.Tensor]) -> np.ndarray:
    """Mean pooling of per-sequence `[n_i, hidden]` reference states: `[n, hidden]`, as the card pools."""
    return torch.stack([s.mean(0) for s in states]).numpy()


@pytest.mark.parametrize("name", BACKBONES, ids=list(BACKBONES))
def test_adapted_outputs_equal_peft_per_token_and_through_the_runner(tmp_path, name):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    reference = save_backbone(base_dir, name)
    tuned = save_adapter(
        reference, adapter_dir, seed=3, r=4, lora_alpha=8, target_modules=list(BACKBONES[name].targets)
    )
    seqs = random_sequences(name, LENGTHS)
    expected = reference_outputs(tuned, name, seqs)  # peft's forward: base output + B(A(x)) * scale
    merged = reference_outputs(tuned.merge_and_unload(), name, seqs)

    # Per token: shoal's packed model under the adapter's routing, every sequence adapted.
    model = build_model(base_dir, None, "cpu")
    adapter = read_adapter("tuned", adapter_dir, model, device="cpu", dtype=torch.float32, drop_head_targets=True)
    cu_seqlens = np.cumsum([0, *LENGTHS]).astype(np.int32)
    routing = LoraRouting.build(cu_seqlens, np.zeros(len(seqs), np.int32), {0: adapter.factors}, CPU)
    ids = torch.from_numpy(np.concatenate(seqs))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.inference_mode(), routing.applied(model):
        hidden = model(
            PackedInputs(ids, positions, attention_meta(LENGTHS, row_block_bytes=0))
        )  # [T, hidden], whole as the runner runs adapters
    assert max_abs_diff(hidden, expected) <= 1e-4
    assert max_abs_diff(hidden, merged) <= 1e-4
    with torch.inference_mode():  # the adapter really moves the states, so the check above could fail
        assert max_abs_diff(model(PackedInputs(ids, positions, attention_meta(LENGTHS))), expected) > 0.1

    # Through the runner: add_adapter, then a batch whose sequences name its slot.
    runner = ModelRunner.from_dir(card(name, base_dir), base_dir, "cpu")
    slot = runner.add_adapter("tuned", adapter_dir)
    got = runner_vectors(runner, seqs, [slot] * len(seqs))
    assert np.abs(got - pooled(expected)).max() <= 1e-4


def test_rslora_rank_and_alpha_patterns_scale_each_module_as_peft_does(tmp_path):
    reference = save_backbone(tmp_path / "base", "bert")
    # "output.dense" matches both attention.output.dense and the layer's output.dense, as in peft.
    tuned = save_adapter(
        reference,
        tmp_path / "adapter",
        seed=5,
        safe_serialization=False,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        rank_pattern={"query": 2, "output.dense": 4},
        alpha_pattern={"value": 3, "intermediate.dense": 40},
        target_modules=["query", "key", "value", "dense"],
    )
    assert (tmp_path / "adapter" / "adapter_model.bin").is_file()  # the torch-pickle format
    runner = ModelRunner.from_dir(card("bert", tmp_path / "base"), tmp_path / "base", "cpu")
    slot = runner.add_adapter("rs", tmp_path / "adapter")
    seqs = random_sequences("bert", LENGTHS)
    got = runner_vectors(runner, seqs, [slot] * len(seqs))
    assert np.abs(got - pooled(reference_outputs(tuned, "bert", seqs))).max() <= 1e-4


# --- several adapters in one batch ---------------------------------------------------------------

ADAPTERS = {  # name -> (seed, LoraConfig arguments); each targets a different set of shards
    "all": (11, dict(r=4, lora_alpha=4, target_modules=["query", "key", "value", "dense"])),
    "q-and-v": (12, dict(r=8, lora_alpha=16, target_modules=["query", "value"])),
    "k-and-ffn": (13, dict(r=2, lora_alpha=8, target_modules=["key", "intermediate.dense"])),
}
MIXED_LENGTHS = [9, 30, 3, 17, 1, 44, 12, 6, 25, 2]


@pytest.fixture(scope="module")
def bert_runner(tmp_path_factory):
    """A BERT runner with the three ADAPTERS installed (slots 0, 1, 2), their folders and peft models."""
    root = tmp_path_factory.mktemp("lora-bert")
    reference = save_backbone(root / "base", "bert")
    tuned = {name: save_adapter(reference, root / name, seed, **lora) for name, (seed, lora) in ADAPTERS.items()}
    runner = ModelRunner.from_dir(card("bert", root / "base"), root / "base", "cpu")
    slots = {name: runner.add_adapter(name, root / name) for name in ADAPTERS}
    assert list(slots.values()) == [0, 1, 2]
    return runner, root, reference, tuned


@pytest.mark.parametrize(
    "slots",
    [
        [1, -1, 0, 2, -1, 0, 1, 2, -1, 0],  # interleaved: gathered rows
        [-1, 0, 0, 1, 1, 2, -1, -1, -1, -1],  # adapted tokens in slot order: a slice
        [0, -1, 0, 0, -1, -1, 0, -1, 0, 0],
    ],  # one adapter, gathered: no zeroed rows
    ids=["interleaved", "contiguous", "one-adapter-interleaved"],
)
def test_a_batch_mixing_three_adapters_and_the_base_gives_each_sequence_its_own_output(bert_runner, slots):
    runner, *_ = bert_runner
    seqs = random_sequences("bert", MIXED_LENGTHS, seed=4)
    mixed = runner_vectors(runner, seqs, slots)
    alone = np.concatenate([runner_vectors(runner, [s], None if slot < 0 else [slot]) for s, slot in zip(seqs, slots)])
    assert np.abs(mixed - alone).max() <= 1e-5
    base = runner_vectors(runner, seqs, None)
    is_base = np.asarray(slots) < 0
    assert np.array_equal(mixed[is_base], base[is_base])  # bit for bit: base rows are never written
    assert np.abs(mixed[~is_base] - base[~is_base]).max(axis=1).min() > 1e-2  # every adapted one moved


def test_each_adapter_in_a_mixed_batch_equals_peft(bert_runner):
    runner, _, _, tuned = bert_runner
    seqs = random_sequences("bert", MIXED_LENGTHS, seed=6)
    slots = [i % 4 - 1 for i in range(len(seqs))]  # base, all, q-and-v, k-and-ffn, base, ...
    got = runner_vectors(runner, seqs, slots)
    for slot, name in enumerate(ADAPTERS):
        mine = [i for i, s in enumerate(slots) if s == slot]
        want = pooled(reference_outputs(tuned[name], "bert", [seqs[i] for i in mine]))
        assert np.abs(got[mine] - want).max() <= 1e-4, name


def test_cpu_row_blocks_run_the_ffn_in_blocks_but_never_under_adapters(bert_runner, monkeypatch):
    """On a CPU the runner runs each FFN a block of rows at a time (layers/rows.py); an adapter's
    hooks route a Linear's rows by batch position in one call, so adapted batches run whole."""
    runner, _, _, tuned = bert_runner
    seqs = random_sequences("bert", MIXED_LENGTHS, seed=6)  # 149 tokens
    whole = runner_vectors(runner, seqs, None)
    calls = []
    handle = runner.model.layers[0].ffn_in.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    try:
        monkeypatch.setattr(runner, "row_block_bytes", 1)  # the smallest blocks: 64 rows
        blocked = runner_vectors(runner, seqs, None)
        assert calls == [64, 64, 21]
        assert np.abs(blocked - whole).max() <= 1e-5
        calls.clear()
        slots = [i % 4 - 1 for i in range(len(seqs))]  # "k-and-ffn" (slot 2) targets the FFN's Linears
        got = runner_vectors(runner, seqs, slots)
        assert calls == [sum(MIXED_LENGTHS)]
    finally:
        handle.remove()
    for slot, name in enumerate(ADAPTERS):
        mine = [i for i, s in enumerate(slots) if s == slot]
        want = pooled(reference_outputs(tuned[name], "bert", [seqs[i] for i in mine]))
        assert np.abs(got[mine] - want).max() <= 1e-4, name


def test_no_hook_outlives_a_forward_with_adapters(bert_runner):
    runner, *_ = bert_runner
    runner_vectors(runner, random_sequences("bert", [5, 8]), [0, 2])
    assert not any(module._forward_hooks for module in runner.model.modules())


def test_slots_are_reused_after_removal_and_bytes_are_the_stacked_factors(bert_runner, tmp_path):
    _, root, *_ = bert_runner
    runner = ModelRunner.from_dir(card("bert", root / "base"), root / "base", "cpu")
    assert (runner.add_adapter("a", root / "all"), runner.add_adapter("b", root / "q-and-v")) == (0, 1)
    assert runner.adapter_names == ("a", "b")
    # "all" at r=4 on h=64, intermediate 128, 2 layers, float32: q|k|v stacked (A [12, 64], B^T [12, 192]),
    # attn_out, ffn_in and ffn_out each A [4, in] and B^T [4, out].
    r, h, inner = 4, 64, 128
    per_layer = 3 * r * h + 3 * r * 3 * h + (r * h + r * h) + (r * h + r * inner) + (r * inner + r * h)
    assert runner.adapter_bytes("a") == 2 * per_layer * 4
    runner.remove_adapter("a")
    assert runner.adapter_slot("a") is None and runner.adapter_names == ("b",)
    assert runner.add_adapter("c", root / "k-and-ffn") == 0
    with pytest.raises(ModelLoadError, match="already installed"):
        runner.add_adapter("c", root / "all")
    runner.remove_adapter("c")
    with pytest.raises(InferenceFailed, match=r"slots \[0\]"):
        runner_vectors(runner, random_sequences("bert", [4]), [0])


def test_adapters_installed_while_forwards_run_leave_those_forwards_unchanged(bert_runner, tmp_path):
    _, root, *_ = bert_runner
    runner = ModelRunner.from_dir(card("bert", root / "base"), root / "base", "cpu")
    slot = runner.add_adapter("first", root / "all")
    seqs = random_sequences("bert", [12, 30, 7])
    expected = runner_vectors(runner, seqs, [slot, -1, slot])
    loader = threading.Thread(target=lambda: [runner.add_adapter(f"more-{i}", root / "q-and-v") for i in range(6)])
    loader.start()
    results = []
    while loader.is_alive() or not results:
        results.append(runner_vectors(runner, seqs, [slot, -1, slot]))
    loader.join()
    assert len(runner.adapter_names) == 7
    assert all(np.array_equal(r, expected) for r in results)


# --- refusals ------------------------------------------------------------------------------------


def test_a_dora_adapter_is_refused(bert_runner, tmp_path):
    runner, _, reference, _ = bert_runner
    save_adapter(reference, tmp_path, 1, r=4, target_modules=["query"], use_dora=True)
    with pytest.raises(ModelLoadError, match=r"DoRA \(use_dora\)"):
        runner.add_adapter("dora", tmp_path)


def test_an_adapter_with_modules_to_save_is_refused(bert_runner, tmp_path):
    runner, _, reference, _ = bert_runner
    save_adapter(reference, tmp_path, 1, r=4, target_modules=["query"], modules_to_save=["pooler"])
    with pytest.raises(ModelLoadError, match="modules_to_save replaces whole modules"):
        runner.add_adapter("saved", tmp_path)


def test_an_adapter_training_biases_is_refused(bert_runner, tmp_path):
    runner, _, reference, _ = bert_runner
    save_adapter(reference, tmp_path, 1, r=4, target_modules=["query"], bias="all")
    with pytest.raises(ModelLoadError, match="bias='all'"):
        runner.add_adapter("biased", tmp_path)


def copy_with_renamed_module(source, destination, old: str, new: str) -> str:
    """The adapter folder `source` copied with one module's tensors renamed; returns the new A name."""
    shutil.copytree(source, destination)
    path = destination / "adapter_model.safetensors"
    tensors = {key.replace(old, new): t for key, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return next(key for key in tensors if new in key and "lora_A" in key)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("encoder.layer.1.attention.self.query", "encoder.layer.1.attention.self.quarry"),  # routes nowhere
        ("encoder.layer.0.attention.self.key", "embeddings.LayerNorm"),  # routes to a LayerNorm
    ],
    ids=["unknown-module", "not-a-linear"],
)
def test_an_adapter_targeting_what_is_not_an_encoder_linear_is_refused_by_tensor_name(bert_runner, tmp_path, old, new):
    runner, root, *_ = bert_runner
    tensor = copy_with_renamed_module(root / "all", tmp_path / "renamed", old, new)
    with pytest.raises(ModelLoadError, match="not Linears of this model's encoder") as caught:
        runner.add_adapter("renamed", tmp_path / "renamed")
    assert tensor in caught.value.message


def test_a_factor_of_the_wrong_shape_is_refused_naming_tensor_and_expected_shape(bert_runner, tmp_path):
    runner, root, *_ = bert_runner
    shutil.copytree(root / "all", tmp_path / "cut")
    path = tmp_path / "cut" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = "base_model.model.encoder.layer.0.intermediate.dense.lora_B.weight"
    tensors[key] = tensors[key][:100]  # [128, 4] -> [100, 4]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=rf"{key}: shape \(100, 4\), expected \(out=128, r=4\) for layers.0.ffn_in"
    ):
        runner.add_adapter("cut", tmp_path / "cut")


def test_a_rank_that_disagrees_with_adapter_config_is_refused(bert_runner, tmp_path):
    runner, root, *_ = bert_runner
    shutil.copytree(root / "all", tmp_path / "rank")
    config_path = tmp_path / "rank" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "r": 3}))
    with pytest.raises(ModelLoadError, match=r"lora_A.weight: shape \(4, 64\), expected \(r=3, in=64\)"):
        runner.add_adapter("rank", tmp_path / "rank")


def test_a_target_outside_the_encoder_is_refused_where_a_head_would_run_it(bert_runner):
    runner, root, *_ = bert_runner
    # The "dense" target hits pooler.dense: an embedder never runs it (dropped), a classifier would.
    with pytest.raises(ModelLoadError, match="targets pooler.dense, outside the encoder"):
        read_adapter("all", root / "all", runner.model, device="cpu", dtype=torch.float32, drop_head_targets=False)
    adapter = read_adapter("all", root / "all", runner.model, device="cpu", dtype=torch.float32, drop_head_targets=True)
    assert adapter.dropped_modules == ("pooler.dense",)


def test_an_adapter_on_deberta_projections_of_the_shared_position_table_is_refused(tmp_path):
    reference = save_backbone(tmp_path / "base", "deberta-v2")
    save_adapter(reference, tmp_path / "adapter", 1, r=4, target_modules=["query_proj", "value_proj"])
    runner = ModelRunner.from_dir(card("deberta-v2", tmp_path / "base"), tmp_path / "base", "cpu")
    with pytest.raises(ModelLoadError, match="relative-position table") as caught:
        runner.add_adapter("qv", tmp_path / "adapter")
    assert "encoder.layer.0.attention.self.query_proj" in caught.value.message
