"""`quantize: int4` (layers/int4.py): a generating card's Linears with 4-bit weights on a CPU.

The weights here are built on a 4-bit grid the way llama.cpp's Q4_1 blocks store them (each block
of 32: d * q + min, q in 0..15, its smallest at 0 and its largest at 15), so the levels int4 finds
are known; the reference product is torch's own float32 one over the same weights and the
bfloat16-rounded inputs. Greedy answers on SmolLM2's real weights against transformers' float32
model: tests/test_generate.py. Speed: bench/generate_int8.py.
"""

from __future__ import annotations

import concurrent.futures

import msgspec
import pytest
import torch
import yaml
from torch import nn

from shoal.catalog import Catalog, parse_card
from shoal.catalog.card import Batching
from shoal.errors import CardError, ConfigError
from shoal.layers import FusedLinear
from shoal.layers.int4 import (
    GROUP,
    Int4FusedLinear,
    Int4Linear,
    Int8WeightLinear,
    available,
    fits,
    quantize_groups,
    quantize_linears_int4,
)

kernel = pytest.mark.skipif(not available(), reason="this torch lacks the CPU int4 kernel")


def q4_1_weight(rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight `[rows, width]` float32 on a 4-bit grid per block of GROUP, its levels `[rows, width]`)."""
    g = torch.Generator().manual_seed(seed)
    blocks = width // GROUP
    d = torch.rand(rows, blocks, generator=g) * 0.02 + 0.001
    low = -torch.rand(rows, blocks, generator=g) * 0.1
    q = torch.randint(0, 16, (rows, blocks, GROUP), generator=g)
    q[..., 3], q[..., 17] = 0, 15  # each block spans its full range, as Q4_1's quantiser makes it
    return (q * d[..., None] + low[..., None]).reshape(rows, width), q.reshape(rows, width)


@kernel
def test_int4_finds_a_4_bit_checkpoints_own_levels_and_multiplies_within_bfloat16_rounding():
    weight, levels = q4_1_weight(96, 128)
    found, scales_and_zeros = quantize_groups(weight)
    assert torch.equal(found, levels.to(torch.int32))
    assert scales_and_zeros.shape == (128 // GROUP, 96, 2) and scales_and_zeros.dtype == torch.bfloat16

    linear = nn.Linear(128, 96)
    linear.weight = nn.Parameter(weight)
    int4 = Int4Linear.of(linear)
    x = torch.randn(2, 5, 128)
    expected = torch.nn.functional.linear(x.bfloat16().float(), weight, linear.bias)
    got = int4(x)
    assert got.shape == (2, 5, 96) and got.dtype == torch.float32
    # bfloat16's rounding of the inputs, of each block's scale and zero (a zero's error is shared by
    # its 32 weights) and of the result: within a hundredth of the largest output (a wrong layout or
    # block order is off by the outputs' own size)
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()


@kernel
def test_a_fused_linear_keeps_its_shards_and_shapes_the_kernel_cannot_take_stay_float32():
    weight, _ = q4_1_weight(64 + 32, 64, seed=1)
    fused = FusedLinear(64, (64, 32), bias=False)
    fused.weight = nn.Parameter(weight)
    model = nn.ModuleDict({"qkv": fused, "odd": nn.Linear(64, 20), "narrow": nn.Linear(48, 32)})
    assert not fits(model["odd"]) and not fits(model["narrow"])
    assert quantize_linears_int4(model) == ("qkv",)
    assert isinstance(model["qkv"], Int4FusedLinear) and type(model["odd"]) is nn.Linear
    x = torch.randn(3, 64)
    a, b = model["qkv"].split(x)
    full = torch.nn.functional.linear(x.bfloat16().float(), weight)
    assert a.shape == (3, 64) and b.shape == (3, 32)
    assert torch.allclose(torch.cat([a, b], -1), full, rtol=0, atol=1e-2 * full.abs().max().item())
    with pytest.raises(ValueError, match="multiple of"):
        Int4Linear.of(model["odd"])


@kernel
def test_the_int8_head_multiplies_within_its_rounding():
    """The LM head under int4 (int8 weights per row, bfloat16 activations) against torch's float32
    product with the float weights."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=generator)
    head = Int8WeightLinear.of(weight)
    assert head.weight.dtype == torch.int8 and head.weight.shape == (1000, 64)
    x = torch.randn(3, 64, generator=generator)
    got = head(x)
    assert got.shape == (3, 1000) and got.dtype == torch.float32
    # Exactly the int8 levels times their scales over the bfloat16-rounded activations (up to the
    # kernel's summation order and its bfloat16 output) ...
    levels = head.weight.float() * head.scale.float()[:, None]
    exact = torch.nn.functional.linear(x.bfloat16().float(), levels)
    assert (got - exact).abs().max() <= 1e-2 * exact.abs().max() / 2
    # ... and near float32's product with the float weights (the two roundings: ~1 % of the largest).
    expected = torch.nn.functional.linear(x, weight)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_int4_is_for_generating_float32_cards_on_cpus_and_a_tuned_limit_chooses_it(tmp_path):
    encoder = "id: test/enc\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\n"
    with pytest.raises(CardError, match="generating cards") as info:
        parse_card(yaml.safe_load(encoder + "quantize: int4\n"), "enc.yaml")
    assert info.value.details["field"] == "quantize"
    with pytest.raises(CardError, match="generating cards"):
        parse_card(yaml.safe_load(encoder + "batching: {cpu: {quantize: int4}}\n"), "enc.yaml")

    card = Catalog.load().get("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert card.generate is not None and card.quantize is None
    fields = msgspec.to_builtins(card)
    assert parse_card({**fields, "quantize": "int4"}, "smollm2.yaml").quantize == "int4"
    with pytest.raises(CardError, match="float32"):
        parse_card({**fields, "quantize": "int4", "dtype": "bfloat16"}, "smollm2.yaml")
    with pytest.raises(CardError, match="CPUs only"):
        parse_card({**fields, "batching": {"cuda": {"quantize": "int4"}}}, "smollm2.yaml")
    # A limit picks int4 over the card's int8, int8 over its int4, and "none" drops either.
    int8 = msgspec.structs.replace(card, quantize="int8", batching={"cpu": Batching(quantize="int4")})
    assert int8.quantize_for("cpu").quantize == "int4"
    int4 = msgspec.structs.replace(card, quantize="int4", batching={"cpu": Batching(quantize="int8")})
    assert int4.quantize_for("cpu").quantize == "int8"
    none = msgspec.structs.replace(card, quantize="int4", batching={"cpu": Batching(quantize="none")})
    assert none.quantize_for("cpu").quantize is None

    # At load (engine/precision.py `check_quantize`, which GeneratingModel calls too): a card built in
    # code, or limits of two hardware classes that combine a dtype with int4, are caught there.
    from shoal.engine.precision import check_quantize

    minilm = Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(ConfigError, match="generating cards"):
        check_quantize(msgspec.structs.replace(minilm, quantize="int4"), "cpu")
    with pytest.raises(ConfigError, match="float32 activations"):
        check_quantize(msgspec.structs.replace(card, quantize="int4", dtype="bfloat16"), "cpu")
    with pytest.raises(ConfigError, match="CPUs only"):
        check_quantize(msgspec.structs.replace(card, quantize="int4"), "cuda")
    check_quantize(msgspec.structs.replace(card, quantize="int4"), "cpu")

    # A tuned overlay asking int4 of an encoder is refused with the file named.
    (tmp_path / "tuned").mkdir()
    overlay = dict(model="sentence-transformers/all-MiniLM-L6-v2", hardware="cpu", batching={"quantize": "int4"})
    (tmp_path / "tuned" / "minilm.yaml").write_text(yaml.safe_dump(overlay))
    with pytest.raises(CardError, match="minilm.yaml.*generating cards"):
        Catalog.load((tmp_path,))


def _random_decoder(tmp_path, family: str, eps: float = 1e-6, slots: int = 2):
    """A random 2-layer Qwen3 (per-head norms) or Llama decoder with int4 Linears, and its cache."""
    import transformers

    from shoal.generate.forward import CachedDecoder
    from shoal.generate.kv_cache import PagedCache
    from shoal.weights import build_model

    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    torch.manual_seed(0)
    width = {"qwen3": 128, "llama": 64}[family]
    config = config_class(
        vocab_size=300,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        initializer_range=0.2,
        hidden_size=width,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=2 * width,
        rms_norm_eps=eps,
    )
    model_class(config).eval().save_pretrained(tmp_path / f"{family}-{eps}")
    model = build_model(tmp_path / f"{family}-{eps}", None, "cpu")
    quantize_linears_int4(model)
    assert all(isinstance(layer.qkv, Int4Linear) for layer in model.layers)
    cfg = model.config
    cache = PagedCache(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=slots, max_len=96, block_size=64
    )
    return CachedDecoder(model, cache)


@kernel
def test_a_compiled_decode_layer_gives_the_eager_steps_logits_for_two_families_in_one_process(tmp_path):
    """`CachedDecoder.compile_span` (torch.compile of one sequence's decode layer, its guards the
    tensors' only, one copy of the code per decoder): teacher-forced over the same 40 tokens, each
    step's logits are the eager decoder's within bfloat16 rounding, for a Qwen3 decoder (per-head
    norms) and two Llama ones of another width compiled in the same process, the two alike in every
    tensor's shape but not in their norms' epsilon (a constant in the compiled code, which only the
    dropped guards would tell apart: without a copy of the code each, the second would run the
    first's); the steps took the compiled layer (one slot's consecutive blocks) at several places
    in the pools (the slot alone, and after another, then on another thread)."""
    from shoal.generate.forward import Segment

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (9,), generator=generator).tolist()
    forced = torch.randint(0, 300, (40,), generator=generator).tolist()

    starts: set[int] = set()

    def run(decoder, after: int) -> list[torch.Tensor]:
        """Logits of the forced steps in a slot allocated after another holding `after` positions."""
        held = [decoder.cache.alloc(after)] if after else []
        slot = decoder.cache.alloc(len(prompt) + len(forced))
        start = decoder.cache.span(slot, 2)
        assert start is not None  # read as a slice
        starts.add(start)
        try:
            out = [decoder.step([Segment(slot, prompt)])]
            out += [decoder.step([Segment(slot, [token])]) for token in forced]
        finally:
            for used in [slot, *held]:
                decoder.cache.free(used)
        return out

    decoders = {
        "qwen3": _random_decoder(tmp_path, "qwen3"),
        "llama": _random_decoder(tmp_path, "llama"),
        "llama eps 0.5": _random_decoder(tmp_path, "llama", eps=0.5),
    }
    eager = {(family, after): run(decoder, after) for family, decoder in decoders.items() for after in (0, 32)}
    for decoder in decoders.values():
        assert decoder.compile_span() is None and decoder.compiled
    starts.clear()
    for family, decoder in decoders.items():
        for after in (0, 32):  # the slot's positions first in the pools, and after another's
            calls: list[int] = []
            layer = decoder._span_layer
            decoder._span_layer = lambda *args, layer=layer, calls=calls: calls.append(1) or layer(*args)
            if after:  # on another thread than the one that compiled it, as the served loop runs it
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    got = pool.submit(run, decoder, after).result()
            else:
                got = run(decoder, after)
            decoder._span_layer = layer
            assert len(calls) == len(forced) * decoder.model.config.num_hidden_layers, family
            for want, have in zip(eager[family, after], got):
                assert have.shape == want.shape
                assert (have - want).abs().max() <= 2e-2 * want.abs().max(), (family, after)
    assert len(starts) >= 2  # the compiled steps read slices at several places in the pools


@kernel
def test_a_decoder_whose_layers_differ_stays_eager(tmp_path):
    """A Linear the int4 kernel refused stays packed float32 (`quantize_linears_int4`), which
    inductor does not lower: `compile_span` says why and changes nothing."""
    from shoal.layers.packed import PackedLinear

    decoder = _random_decoder(tmp_path, "llama")
    first = decoder.model.layers[0]
    first.down = PackedLinear.of(nn.Linear(first.down.in_features, first.down.out_features, bias=False))
    assert decoder.compile_span() == "its layers differ in their Linears"
    assert not decoder.compiled


@kernel
def test_without_room_for_two_scratch_slots_the_steps_stay_eager_and_no_slot_is_kept(tmp_path):
    """A cache of one slot: `compile_span` cannot take its second scratch slot, says so, and gives
    the first back (a slot kept would leave the model unable to take a call)."""
    decoder = _random_decoder(tmp_path, "llama", slots=1)
    why = decoder.compile_span()
    assert why is not None and "slots" in why
    assert not decoder.compiled and decoder.cache.in_use == 0
