"""`quantize: int8` (layers/int8.py): the encoder's Linears in int8 on CPU stay close to float32.

References are computed here: shoal's own float32 forward and sentence-transformers on MiniLM's
real weights (Lee documents, and Lee Spearman against the human scores as tests/test_quality.py
computes it); transformers' float32 models for random-initialised backbones of other
architectures; peft-built adapters run on the float32 base for LoRA on an int8 base. Speed is not
asserted here: bench/int8.py measures it.
"""

from __future__ import annotations

import platform

import msgspec
import numpy as np
import pytest
import torch
import transformers
import yaml

from lora_models import BACKBONES, reference_outputs, save_adapter, save_backbone
from parity import min_pooled_cosine, packed_batch, packed_hidden_states
from shoal.catalog import parse_card
from shoal.engine.runner import ModelRunner
from shoal.engine.types import Batch, EncodeSpec
from shoal.errors import CardError, ConfigError
from shoal.layers import FusedLinear, Int8FusedLinear, Int8Linear, input_maxima, quantize_linears
from shoal.layers.int8 import default_kernel
from shoal.weights import build_model
from test_quality import lee_data, spearman

MIN_COSINE = 0.99
MAX_SPEARMAN_SHIFT = 0.005
SPEC = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")


def int8_card(card):
    return msgspec.structs.replace(card, quantize="int8")  # as a card of one's own with `quantize: int8` says


def encode(runner: ModelRunner, texts: list[str], adapter_slot: int | None = None) -> np.ndarray:
    """Unit vectors `[n, dim]` of `texts` in one batch, through `ModelRunner.forward`."""
    seqs = runner.tokenizer.encode(texts, truncate=True)
    batch = Batch.pack(seqs, None if adapter_slot is None else [adapter_slot] * len(seqs))
    return np.stack([item.dense for item in runner.forward(batch, [SPEC] * len(seqs))])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def runners(card, model_dir):
    """MiniLM as its card says (float32) and with quantize: int8."""
    return ModelRunner.from_dir(card, model_dir, "cpu"), ModelRunner.from_dir(int8_card(card), model_dir, "cpu")


# --- MiniLM, real weights -------------------------------------------------------------------------


def test_int8_vectors_keep_cosine_099_to_float32_and_to_sentence_transformers_on_lee(
    runners, reference_model, lee_documents
):
    float32, int8 = runners
    ours, quantized = encode(float32, lee_documents), encode(int8, lee_documents)
    reference = reference_model.encode(lee_documents, convert_to_numpy=True)
    assert cosines(quantized, ours).min() >= MIN_COSINE
    assert cosines(quantized, reference).min() >= MIN_COSINE
    assert cosines(quantized, ours).min() < 0.99999  # int8 really ran: float32 equals itself far closer


def test_int8_lee_spearman_is_within_0005_of_float32_and_of_sentence_transformers(runners, reference_model):
    float32, int8 = runners
    docs, human = lee_data()
    rho_int8 = spearman(encode(int8, docs), human)
    rho_float32 = spearman(encode(float32, docs), human)
    rho_reference = spearman(reference_model.encode(docs, convert_to_numpy=True), human)
    assert abs(rho_int8 - rho_float32) <= MAX_SPEARMAN_SHIFT, (rho_int8, rho_float32)
    assert abs(rho_int8 - rho_reference) <= MAX_SPEARMAN_SHIFT, (rho_int8, rho_reference)


def test_int8_short_texts_keep_cosine_099_too(runners):
    """One-word texts are the hardest case: their few tokens are dominated by [CLS] and [SEP],
    whose huge channels the outlier split keeps in float32."""
    float32, int8 = runners
    docs, _ = lee_data()
    words = sorted({w.strip(".,\"'()") for doc in docs[:10] for w in doc.split()} - {""})[:120]
    assert cosines(encode(int8, words), encode(float32, words)).min() >= MIN_COSINE


def test_int8_replaces_every_encoder_linear_keeps_fused_shards_and_quarters_their_bytes(runners, card, model_dir):
    float32, int8 = runners
    plain = build_model(model_dir, card.architecture, "cpu")  # the Linears as built, before any runner swaps them
    linears = {n: m for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
    swapped = {n: m for n, m in int8.model.named_modules() if isinstance(m, Int8Linear)}
    assert set(swapped) == set(linears) and not any(isinstance(m, torch.nn.Linear) for m in int8.model.modules())
    for name, module in swapped.items():
        assert isinstance(module, Int8FusedLinear) == isinstance(linears[name], FusedLinear)
        assert getattr(module, "shard_sizes", None) == getattr(linears[name], "shard_sizes", None)
        assert module.kernel == default_kernel()  # this CPU's: u8 keeps the weights in oneDNN's layout only
        assert module.weight_t.dtype == torch.int8 if module.kernel == "int_mm" else module.weight_t is None
    # Measured bytes drop by at least 70% of the Linear weights' float32 bytes (int8 is 75% less,
    # less the per-row scales and the float32 outlier columns), and the pre-load estimate follows.
    weight_bytes = sum(m.weight.numel() * 4 for m in linears.values())
    assert int8.num_bytes <= float32.num_bytes - 0.7 * weight_bytes
    estimate = ModelRunner.estimate_bytes(int8_card(card), allow_download=False)
    assert abs(estimate - int8.num_bytes) <= 0.02 * int8.num_bytes, (estimate, int8.num_bytes)
    assert ModelRunner.estimate_bytes(card, allow_download=False) - estimate >= 0.7 * weight_bytes


# Both run on any x86 CPU (default_kernel() picks the fast one here); u8 needs x86 and oneDNN.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
KERNELS = ["int_mm", pytest.param("u8", marks=pytest.mark.skipif(not _X86, reason="oneDNN's u8 kernel is x86's"))]


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_int8_token_keeps_its_own_scale_whatever_its_batch_mates_hold(kernel):
    """Per-token activation scales: a token with huge activations elsewhere in the batch leaves the
    other tokens' outputs as they are alone (one scale per call over the batch would coarsen them)."""
    torch.manual_seed(1)
    linear = Int8Linear.of(torch.nn.Linear(96, 48), kernel=kernel)
    x = torch.randn(9, 96)
    loud = torch.cat([x, 1000 * torch.randn(1, 96)])  # [10, 96]: one token 1000x the others
    with torch.inference_mode():
        alone = torch.cat([linear(row[None]) for row in x])  # [9, 48]
        assert (linear(loud)[:9] - alone).abs().max() <= 1e-5


# --- other architectures, random weights -----------------------------------------------------------


@pytest.mark.parametrize("name", ["xlm-roberta", "modernbert", "qwen3", "deberta-v2"])
def test_int8_random_backbones_stay_within_cosine_099_of_transformers(tmp_path, name):
    spec = BACKBONES[name]
    reference = save_backbone(tmp_path, name)  # float32, transformers' own forward
    model = build_model(tmp_path, None, "cpu")
    calibration = packed_batch([12, 30, 5, 50], 1000, first_id=spec.first_id, seed=2)
    quantize_linears(model, input_maxima(model, lambda: packed_hidden_states(model, calibration)))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    batch = packed_batch([1, 40, 7, 2, 23, 64, 5], 1000, first_id=spec.first_id, seed=3)
    hidden = packed_hidden_states(model, batch)  # [T, hidden]
    expected = reference_outputs(reference, name, [s.numpy() for s in batch.seqs])
    assert min_pooled_cosine(hidden, batch.meta, expected, "mean") >= MIN_COSINE
    assert (hidden - torch.cat(expected)).abs().max() > 1e-4  # int8 really ran


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_kernels_do_not_saturate_where_every_product_is_largest(kernel):
    """Every activation and weight at its row's max, all of one sign (or of opposite signs): the
    largest sums a kernel meets. AVX2's u8 x s8 adds pairs in int16 with saturation; 8-bit weights
    there would cap these sums, 7-bit ones keep them exact."""
    linear = torch.nn.Linear(512, 8, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
        linear.weight[4:] = -0.5
    x = torch.full((3, 512), 2.0)
    with torch.inference_mode():
        y = Int8Linear.of(linear, kernel=kernel)(x)
    assert torch.allclose(y, linear(x).detach(), rtol=1e-5), y  # 512 x 2 x +-0.5 = +-512


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_kernels_track_float32_on_random_inputs_and_agree(kernel):
    torch.manual_seed(3)
    linear = torch.nn.Linear(384, 1536)
    x = torch.randn(200, 384)
    with torch.inference_mode():
        expected, y = linear(x), Int8Linear.of(linear, kernel=kernel)(x)
        other = Int8Linear.of(linear, kernel="int_mm" if kernel == "u8" else "u8")(x) if _X86 else y
    cos = torch.nn.functional.cosine_similarity(y, expected, dim=1)
    assert cos.min() >= 0.999 and (y - expected).abs().max() > 1e-5  # quantised, and close
    assert torch.nn.functional.cosine_similarity(y, other, dim=1).min() >= 0.999  # the kernels agree


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_keeps_outlier_channels_in_float32_and_splits_like_a_fused_linear(kernel):
    torch.manual_seed(0)
    linear = FusedLinear(64, (32, 16, 16))
    x = torch.randn(40, 64)
    x[:, 7] *= 50  # a channel of huge activations, as transformers carry
    expected = linear(x).detach()
    plain, split = Int8Linear.of(linear, kernel=kernel), Int8Linear.of(linear, x.abs().amax(0), kernel=kernel)
    assert split.outliers.tolist() == [7] and plain.outliers is None

    def error(module):
        with torch.inference_mode():
            return ((module(x) - expected).norm() / expected.norm()).item()

    assert error(split) * 5 < error(plain)  # the outlier leaves every other channel a few levels
    with torch.inference_mode():
        parts = split.split(x)
    assert [p.shape[-1] for p in parts] == [32, 16, 16]
    assert torch.equal(torch.cat(parts, -1), split(x.clone()))


# --- LoRA on an int8 base ----------------------------------------------------------------------------


def test_a_lora_adapter_on_an_int8_base_tracks_the_float32_adapted_model(tmp_path, runners, model_dir, lee_documents):
    """The adapter's forward hook adds its float32 delta to the int8 Linear's output, as on float32."""
    float32, int8 = runners
    base = transformers.BertModel.from_pretrained(model_dir).eval()
    save_adapter(base, tmp_path / "tuned", seed=3, r=4, lora_alpha=1, target_modules=["query", "value", "dense"])
    slots = {runner: runner.add_adapter("tuned", tmp_path / "tuned") for runner in runners}
    try:
        texts = lee_documents[:6]
        adapted = encode(float32, texts, slots[float32])
        assert cosines(adapted, encode(float32, texts)).max() < 0.98  # the adapter really moves the vectors
        assert cosines(encode(int8, texts, slots[int8]), adapted).min() >= MIN_COSINE
        # Base sequences next to adapted ones in an int8 batch are what the batch gives them without
        # adapters, bit for bit: their rows are never written, and their scales are their own.
        seqs = int8.tokenizer.encode(texts, truncate=True)
        mixed = int8.forward(Batch.pack(seqs, [slots[int8], -1] * 3), [SPEC] * len(seqs))
        bare = int8.forward(Batch.pack(seqs), [SPEC] * len(seqs))
        assert all(np.array_equal(mixed[i].dense, bare[i].dense) for i in (1, 3, 5))
        assert not np.array_equal(mixed[0].dense, bare[0].dense)
    finally:
        for runner in runners:
            runner.remove_adapter("tuned")


# --- where int8 is refused -------------------------------------------------------------------------------


def test_a_tuned_limit_choosing_int8_for_this_cpu_loads_int8_and_is_estimated_so(card, model_dir, runners):
    """`shoal tune` writes `quantize` into a hardware class's limits: the runner and the pre-load
    estimate follow the limits for this CPU, and "none" undoes a card's own int8."""
    from shoal.catalog.card import Batching
    from shoal.engine.hardware import cpu_class

    chosen = msgspec.structs.replace(card, batching={cpu_class(): Batching(quantize="int8")})
    runner = ModelRunner.from_dir(chosen, model_dir, "cpu")
    assert runner.card.quantize == "int8" and any(isinstance(m, Int8Linear) for m in runner.model.modules())
    assert ModelRunner.estimate_bytes(chosen, allow_download=False) == ModelRunner.estimate_bytes(
        int8_card(card), allow_download=False
    )
    texts = ["a tuned overlay chose int8 here", "the limits are per hardware class"]
    assert np.array_equal(encode(runner, texts), encode(runners[1], texts))  # the same int8 model as the card's own
    undone = msgspec.structs.replace(int8_card(card), batching={cpu_class(): Batching(quantize="none")})
    plain = ModelRunner.from_dir(undone, model_dir, "cpu")
    assert plain.card.quantize is None and not any(isinstance(m, Int8Linear) for m in plain.model.modules())


def test_int8_on_a_cuda_device_is_a_config_error_before_anything_loads(card, tmp_path):
    with pytest.raises(ConfigError, match="CPU") as info:
        ModelRunner.from_dir(int8_card(card), tmp_path, "cuda")  # an empty folder: the check comes first
    assert info.value.details["field"] == "quantize"


def test_int8_with_a_half_dtype_is_a_config_error_at_load_and_a_card_error_in_yaml(card, model_dir):
    with pytest.raises(ConfigError, match="float16"):
        ModelRunner.from_dir(msgspec.structs.replace(card, quantize="int8", dtype="float16"), model_dir, "cpu")
    text = (
        "id: test/half-int8\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 384\n"
        "dtype: bfloat16\nquantize: int8\n"
    )
    with pytest.raises(CardError, match="bfloat16") as info:
        parse_card(yaml.safe_load(text), "half-int8.yaml")
    assert info.value.details == {"file": "half-int8.yaml", "field": "quantize"}
    assert parse_card(yaml.safe_load(text.replace("dtype: bfloat16\n", "")), "int8.yaml").quantize == "int8"
