"""Attention masks and position biases cost once per forward and length group, not per layer or per
sequence: counted constructions, the masks the kernel receives, and the peak memory of a forward
(long causal text, 256-item MPNet batch) against bounds derived from the sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal.layers import AttentionMeta, PackedInputs, attention_meta

MIXED = [3, 9, 40, 17, 64, 1, 120, 100]  # three length groups, each padded: 1-17, 40-64, 100-120


def meta_for(lengths: list[int], each: bool = True) -> AttentionMeta:
    return AttentionMeta.build(torch.tensor([0] + lengths).cumsum(0).to(torch.int32), max(lengths), each=each)


def run(model: torch.nn.Module, lengths: list[int], meta: AttentionMeta | None = None) -> torch.Tensor:
    torch.manual_seed(1)
    meta = meta or meta_for(lengths)
    ids = torch.randint(3, 100, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        return model.eval()(PackedInputs(ids, positions, meta))


def tiny_modernbert(num_layers: int) -> torch.nn.Module:
    from shoal.models.modernbert import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    return ModernBertModel(
        ModernBertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            intermediate_size=64,
            global_layers=tuple(i % 3 == 0 for i in range(num_layers)),
            local_attention=16,
        )
    )


def tiny_llama(num_layers: int = 2, hidden: int = 64):
    from shoal.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    return LlamaModel(
        LlamaConfig(
            model_type="qwen3",
            vocab_size=100,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            intermediate_size=2 * hidden,
            qk_norm=True,
        )
    )


def tiny_mpnet(num_layers: int = 2, hidden: int = 48, heads: int = 12, max_length: int = 128):
    from shoal.models.mpnet import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    return MPNetModel(
        MPNetConfig(
            vocab_size=100,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            intermediate_size=hidden,
            max_position_embeddings=max_length + 2,
        )
    )


@pytest.fixture
def mask_builds(monkeypatch) -> list[tuple]:
    """Every call of the mask builder: (group length, causal, window)."""
    calls, real = [], attention_meta.build_mask

    def counting(g, causal, window, dtype):
        calls.append((g.max_seqlen, causal, window))
        return real(g, causal, window, dtype)

    monkeypatch.setattr(attention_meta, "build_mask", counting)
    return calls


@pytest.fixture
def sdpa_masks(monkeypatch) -> list[tuple]:
    """Every call of the SDPA kernel: (attn_mask shape or None, is_causal)."""
    calls, real = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("each", [False, True], ids=["padded", "each"])
@pytest.mark.parametrize("num_layers", [3, 9])
def test_masks_are_built_once_per_length_group_and_kind_whatever_the_number_of_layers(mask_builds, num_layers, each):
    meta = meta_for(MIXED, each)
    run(tiny_modernbert(num_layers), MIXED, meta)
    # Global and local layers. With the CPU "each" path on, the global layers need no mask at all
    # (full attention over unequal lengths: every sequence on its own, no padding).
    kinds = {(False, (8, 8))} if each else {(False, None), (False, (8, 8))}
    assert len(meta.groups) == 3
    assert Counter(mask_builds) == Counter((g.max_seqlen, *kind) for g in meta.groups for kind in kinds)


def test_a_second_forward_builds_its_own_masks_from_its_own_meta(mask_builds):
    model = tiny_modernbert(3)
    run(model, MIXED, meta_for(MIXED, each=False))
    run(model, [5, 70], meta_for([5, 70], each=False))
    assert len(mask_builds) == 2 * 3 + 2 * 2  # nothing is reused across forwards: each meta owns its masks


def test_causal_attention_hands_the_kernel_no_mask_even_with_padding(sdpa_masks):
    meta = meta_for(MIXED)
    run(tiny_llama(num_layers=3), MIXED, meta)
    assert len(sdpa_masks) == 3 * len(meta.groups)
    assert set(sdpa_masks) == {(None, True)}


def test_windowed_attention_shares_one_band_per_group_and_no_per_sequence_mask(sdpa_masks):
    meta = meta_for(MIXED)
    run(tiny_modernbert(3), MIXED, meta)  # layer 0 global, layers 1-2 local
    local = [shape for shape, _ in sdpa_masks if shape is not None and shape[2] > 1]
    assert sorted(local) == sorted([(1, 1, g.max_seqlen, g.max_seqlen) for g in meta.groups] * 2)


def test_mpnet_builds_its_position_bias_once_per_forward_and_attention_reads_it_per_group(monkeypatch, sdpa_masks):
    from shoal.models.mpnet import MPNetModel

    builds, real = [], MPNetModel.position_bias

    def counting(self, max_seqlen):
        builds.append(max_seqlen)
        return real(self, max_seqlen)

    monkeypatch.setattr(MPNetModel, "position_bias", counting)
    meta = meta_for(MIXED, each=False)  # the padded path (float32 on a CPU would take "each", bias and all)
    run(tiny_mpnet(num_layers=4, heads=4), MIXED, meta)
    assert builds == [max(MIXED)]
    # Every kernel call gets one [1, H, Lg, Lg] bias shared by the group's sequences, never [n, H, ...].
    assert sorted(sdpa_masks) == sorted([((1, 4, g.max_seqlen, g.max_seqlen), False) for g in meta.groups] * 4)


def test_mpnet_position_bias_equals_the_bias_table_at_each_bucketed_offset():
    from shoal.models.mpnet import relative_position_bucket

    model = tiny_mpnet(heads=4)
    L = 130
    positions = torch.arange(L)
    expected = model.relative_attention_bias(relative_position_bucket(positions[None, :] - positions[:, None]))
    assert torch.equal(model.position_bias(L), expected.permute(2, 0, 1))


def tiny_deberta(num_layers: int = 2):
    from shoal.models.deberta_v2 import DebertaV2Config, DebertaV2Model

    torch.manual_seed(0)
    return DebertaV2Model(
        DebertaV2Config(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=512,
            position_biased_input=False,
            relative_attention=True,
            pos_att_type=("c2p", "p2c"),
            position_buckets=32,
            max_relative_positions=64,
            norm_rel_ebd=("layer_norm",),
        )
    )


def test_deberta_builds_its_distances_once_per_forward(monkeypatch):
    from shoal.models import deberta_v2

    builds, real = [], deberta_v2.relative_positions

    def counting(L, cfg, device):
        builds.append(L)
        return real(L, cfg, device)

    monkeypatch.setattr(deberta_v2, "relative_positions", counting)
    run(tiny_deberta(num_layers=4), MIXED)
    assert builds == [max(MIXED)]


# --- peak memory of a forward, in a fresh interpreter --------------------------------------------

clear_refs = Path("/proc/self/clear_refs")
needs_proc = pytest.mark.skipif(
    not (clear_refs.exists() and os.access(clear_refs, os.W_OK)),
    reason="needs Linux /proc/self/clear_refs to reset the peak resident set",
)
LONG = 4096


def mpnet_batch_lengths() -> list[int]:
    """256 lengths drawn from 16..512 (MPNet's longest): five length groups."""
    return torch.randint(16, 513, (256,), generator=torch.Generator().manual_seed(0)).tolist()


def _status_kb(name: str) -> int:
    return int(re.search(rf"{name}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _child_peak_extra_bytes(case: str) -> None:
    """Runs in the child: prints the bytes the resident set grew by at its peak over one forward."""
    torch.set_num_threads(1)
    if case == "long-causal":
        model, lengths = tiny_llama(num_layers=2), [LONG]
    elif case == "deberta-one-long-many-short":
        model, lengths = tiny_deberta(num_layers=2), [8] * 255 + [512]
    else:
        model, lengths = tiny_mpnet(num_layers=2, heads=12, max_length=512), mpnet_batch_lengths()
    run(model, lengths[:1])  # warm-up: kernels and thread pools allocate once
    meta = meta_for(lengths)
    clear_refs.write_text("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    run(model, lengths, meta)
    print((_status_kb("VmHWM") - before) * 1024)


def peak_extra_bytes(case: str) -> int:
    # A pinned mmap threshold makes glibc map every large tensor and unmap it when freed, so the
    # resident set follows live tensors instead of a heap that keeps what it once held.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    code = f"import test_attention_memory as t; t._child_peak_extra_bytes({case!r})"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return int(out.strip().splitlines()[-1])


@needs_proc
def test_one_long_causal_text_costs_less_than_one_fp32_mask_of_its_length():
    # A per-layer [L, L] int64 offset plus bool masks, and the kernel's float copy, cost ~4 of these.
    assert peak_extra_bytes("long-causal") < LONG * LONG * 4 // 2


@needs_proc
def test_a_256_item_mpnet_batch_costs_a_fraction_of_its_n_h_l_l_bias():
    lengths, heads = mpnet_batch_lengths(), 12
    # One padded [n, H, L, L] fp32 bias for the batch costs this (3 GiB); shoal's is [H, L, L] (12 MiB).
    n_h_l_l_bytes = len(lengths) * heads * max(lengths) ** 2 * 4
    assert peak_extra_bytes("mpnet-batch") < n_h_l_l_bytes // 8


@needs_proc
def test_deberta_scores_a_mixed_batch_per_length_group_not_at_the_longest_length():
    n, heads, L = 256, 2, 512  # 255 texts of 8 tokens and one of 512
    # Padding every sequence to the longest would cost one [n, H, L, L] fp32 score tensor per term.
    assert peak_extra_bytes("deberta-one-long-many-short") < n * heads * L * L * 4 // 16
