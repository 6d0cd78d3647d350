"""Reduced precision by default (engine/precision.py): which precision a card runs in on a device,
what `usage` and `/v1/models` say of it, and the card's and the tuner's checks.

The choice is a pure function of the card, its limits for the hardware class, the server's
`reduced_precision` and the CPU's flags; the tests give it each CPU class's flags. The served
checks run MiniLM's real weights on this machine's CPU: bfloat16 where it has native bf16
(tests/conftest.py hides it from the other tests; these put it back), float32 elsewhere.
Whether bfloat16 keeps the answers is tests/test_precision_gate.py's question.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import numpy as np
import pytest
import yaml

from conftest import MODEL_ID, REAL_NATIVE_BF16
from shoal.calls import EncodeCall
from shoal.catalog import Catalog, parse_card
from shoal.catalog.card import Batching
from shoal.config import EngineSettings
from shoal.engine import Engine, precision
from shoal.engine.precision import card_for_device, precision_of
from shoal.errors import CardError

AMX = frozenset({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"})  # Intel Sapphire Rapids and later
ZEN4 = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})  # AMD Zen 4
AVX512 = frozenset({"avx512f", "avx512_vnni"})  # Intel Cascade Lake: no bf16
AVX2 = frozenset({"avx2"})
HW = "cpu:Some CPU+amx"
NATIVE = REAL_NATIVE_BF16()  # this machine's CPU


def minilm(**changes):
    return msgspec.structs.replace(Catalog.load().get(MODEL_ID), **changes)


# --- the choice -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "want"), [(AMX, "bfloat16"), (ZEN4, "bfloat16"), (AVX512, "float32"), (AVX2, "float32")]
)
def test_a_card_listing_bfloat16_runs_it_where_the_cpu_has_it_natively(flags, want):
    card = minilm()
    assert card.precisions == ("bfloat16",) and card.dtype == "float32"
    assert precision_of(card_for_device(card, "cpu", hardware=HW, flags=flags)) == want


def test_the_server_setting_off_a_card_listing_nothing_and_an_old_gpu_keep_the_cards_own_dtype(monkeypatch):
    assert precision_of(card_for_device(minilm(), "cpu", reduced=False, hardware=HW, flags=AMX)) == "float32"
    assert precision_of(card_for_device(minilm(precisions=()), "cpu", hardware=HW, flags=AMX)) == "float32"
    monkeypatch.setattr(precision, "cuda_bf16", lambda device: False)  # a GPU before Ampere
    assert card_for_device(minilm(), "cuda:0", hardware="cuda:Tesla T4", flags=AMX) == minilm()
    half = minilm(dtype="float16", precisions=())
    assert precision_of(card_for_device(half, "cpu", hardware=HW, flags=AVX2)) == "float16"  # asked for by name


def test_a_gpu_with_bf16_runs_a_card_that_lists_it_in_bfloat16_and_others_as_written(monkeypatch):
    monkeypatch.setattr(precision, "cuda_bf16", lambda device: True)
    assert precision_of(card_for_device(minilm(), "cuda:0", hardware="cuda:NVIDIA H100")) == "bfloat16"
    assert precision_of(card_for_device(minilm(), "cuda", reduced=False, hardware="cuda:NVIDIA H100")) == "float32"
    assert precision_of(card_for_device(minilm(precisions=()), "cuda:0", hardware="cuda:NVIDIA H100")) == "float32"
    half = minilm(dtype="float16")
    assert precision_of(card_for_device(half, "cuda:0", hardware="cuda:NVIDIA H100")) == "float16"  # as written


def test_the_limits_for_the_hardware_class_win_over_the_default():
    kept = minilm(batching={"cpu": Batching(dtype="float32")})  # e.g. `shoal tune` measured bf16 slower
    assert precision_of(card_for_device(kept, "cpu", hardware=HW, flags=AMX)) == "float32"
    forced = minilm(precisions=(), batching={HW: Batching(dtype="bfloat16")})
    assert precision_of(card_for_device(forced, "cpu", hardware=HW, flags=AVX2)) == "bfloat16"
    other = minilm(batching={"cpu:Other CPU+amx": Batching(dtype="float32")})  # another class's limits
    assert precision_of(card_for_device(other, "cpu", hardware=HW, flags=AMX)) == "bfloat16"
    int8 = minilm(batching={"cpu": Batching(quantize="int8")})  # int8 runs over float32 activations
    assert precision_of(card_for_device(int8, "cpu", hardware=HW, flags=AMX)) == "int8"


def test_a_card_refuses_dtype_limits_for_a_gpu_and_bfloat16_with_int8():
    text = "id: test/p\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\n"
    with pytest.raises(CardError, match="CPU's precision") as info:
        parse_card(yaml.safe_load(text + "batching: {cuda: {dtype: bfloat16}}\n"), "p.yaml")
    assert info.value.details["field"] == "batching.cuda.dtype"
    with pytest.raises(CardError, match="float32 activations"):
        parse_card(yaml.safe_load(text + "batching: {cpu: {dtype: bfloat16, quantize: int8}}\n"), "p.yaml")
    with pytest.raises(CardError, match="float32 activations") as info:
        parse_card(yaml.safe_load(text + "quantize: int8\nbatching: {cpu: {dtype: bfloat16}}\n"), "p.yaml")
    assert info.value.details["field"] == "batching.cpu.dtype"
    with pytest.raises(CardError, match="precisions"):
        parse_card(yaml.safe_load(text + "precisions: [int8]\n"), "p.yaml")
    assert parse_card(yaml.safe_load(text + "precisions: [bfloat16]\n"), "p.yaml").precisions == ("bfloat16",)


# --- served ---------------------------------------------------------------------------------------


@pytest.fixture
def native_bf16_as_it_is():
    """This CPU's own answer to `native_bf16` (tests/conftest.py says no for the other tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision, "native_bf16", REAL_NATIVE_BF16)
        yield


def test_an_engine_runs_and_reports_the_precision_this_cpu_chooses(native_bf16_as_it_is, embed_reference):
    want = "bfloat16" if NATIVE else "float32"
    texts = ["The cat sat on the mat.", "Shares fell 3.2% on Tuesday.", "rain"]

    async def run(reduced: bool):
        engine = Engine(
            EngineSettings(reduced_precision=reduced), Catalog.load().restrict((MODEL_ID,)), allow_download=False
        )
        await engine.start()
        try:
            before = engine.model(MODEL_ID)
            result = await engine.encode(EncodeCall(MODEL_ID, texts))
            return before, result, engine.model(MODEL_ID)
        finally:
            await engine.stop()

    before, result, after = asyncio.run(run(True))
    assert (before.precision, result.precision, after.precision) == (want, want, want)
    assert before.state == "not_loaded" and after.state == "loaded"
    reference = embed_reference(texts)
    cosines = (np.stack(result.vectors) * reference).sum(1)
    assert cosines.min() >= 0.99
    _, exact, status = asyncio.run(run(False))
    assert exact.precision == status.precision == "float32"
    assert np.abs(np.stack(exact.vectors) - reference).max() <= 1e-5


def test_usage_and_v1_models_say_what_ran(native_bf16_as_it_is, serve):
    want = "bfloat16" if NATIVE else "float32"
    url = serve(engine=EngineSettings(reduced_precision=True))
    body = httpx.post(f"{url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": "hello"}]}).json()
    assert body["usage"] == {"tokens": 3, "precision": want}
    entry = httpx.get(f"{url}/v1/models/{MODEL_ID}").json()
    assert entry["precision"] == want and entry["state"] == "loaded"
    score = httpx.post(
        f"{url}/v1/score", json={"model": MODEL_ID, "query": {"text": "cat"}, "items": [{"text": "a cat"}]}
    ).json()
    assert score["usage"]["precision"] == want
    exact = serve(engine=EngineSettings(reduced_precision=False))
    body = httpx.post(f"{exact}/v1/encode", json={"model": MODEL_ID, "items": [{"text": "hello"}]}).json()
    assert body["usage"]["precision"] == "float32"
    assert httpx.get(f"{exact}/v1/models/{MODEL_ID}").json()["precision"] == "float32"


def test_shoal_tune_searches_dtype_only_for_a_float32_dense_encoder_on_a_cpu_with_native_bf16(monkeypatch):
    from shoal.bench.tune import _gated_refusal

    monkeypatch.setattr(precision, "native_bf16", lambda flags=None: True)
    assert _gated_refusal("dtype", minilm(), HW) is None
    assert "GPU" in _gated_refusal("dtype", minilm(), "cuda:NVIDIA H100")
    assert "already" in _gated_refusal("dtype", minilm(dtype="float16"), HW)
    assert "dense" in _gated_refusal("dtype", minilm(outputs=("sparse",)), HW)
    assert "CPUs only" in _gated_refusal("quantize", minilm(), "cuda:NVIDIA H100")
    monkeypatch.setattr(precision, "native_bf16", lambda flags=None: False)
    assert "no native bf16" in _gated_refusal("dtype", minilm(), HW)
    assert _gated_refusal("quantize", minilm(), HW) is None  # int8 needs no bf16
