"""The CPU runtimes users pick for speed, in this process, as `shoal bench --against` baselines:
ONNX Runtime and OpenVINO on an ONNX export of the model's encoder (an embedder) or of its
`*ForSequenceClassification` model (a cross-encoder), each at its best settings.

    ort            ONNX Runtime fp32 on the graph its BERT optimizer fused (attention, LayerNorm,
                   GELU, embeddings; a classifier's told config.json's heads and width), all graph
                   optimizations on. MPNet's attention, with its relative-position bias, matches
                   none of the fuser's patterns and stays MatMul + Softmax
    ort-int8       that fused graph quantized by ONNX Runtime's dynamic int8 (weights int8 per
                   channel, activations quantized at run time: what optimum and fastembed ship)
    openvino       OpenVINO fp32 (INFERENCE_PRECISION_HINT f32)
    openvino-bf16  OpenVINO with its bf16 hint (where the CPU has AVX512-BF16 or AMX; refused where not)

The export is transformers' model (eager attention) through `torch.onnx.export` (the TorchScript
exporter, dynamic batch and sequence axes) to its last hidden state; pooling (the card's mean or
CLS, from the sentence-transformers folder's `1_Pooling/config.json`) and normalising run in numpy
after the runtime, as fastembed does. Each call's texts are sorted by length and run in batches (the
runtime's best of `BATCH_SIZES`), each padded to its longest, the library's tokenizer truncating
at the card's max length; threads = torch's (the cores). A runtime's vectors for the first call are
compared with shoal's first: fp32 runtimes must reach cosine >= 0.9999 on every text, reduced
precision >= 0.99 (the quality gate); below, no figure and no ratio.

A cross-encoder (a `score` workload) is exported to its logits and fed each call's (query,
document) pairs, tokenized as shoal does (truncated from the document only), with their segment
ids; its first logit is the raw score. Its raw scores for the first call are compared with
shoal's (`raw_scores`): the largest difference over the spread of shoal's scores must be <= 1e-3
at fp32 and <= 0.05 at reduced precision, else no figure.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .targets import InProcess
from .workloads import Workload

RUNTIMES = ("ort", "ort-int8", "openvino", "openvino-bf16")
REDUCED = frozenset({"ort-int8", "openvino-bf16"})
BATCH_SIZES = (8, 16, 32)
MIN_COSINE_FP32, MIN_COSINE_REDUCED = 0.9999, 0.99
MAX_SCORE_DIFF_FP32, MAX_SCORE_DIFF_REDUCED = 1e-3, 0.05  # |runtime - shoal| / spread of shoal's scores


@dataclass(frozen=True)
class Export:
    onnx: Path  # input_ids, attention_mask[, token_type_ids] -> last_hidden_state [b, s, h] | logits [b, labels]
    inputs: tuple[str, ...]
    pooling: str  # "mean" or "cls" (an embedder's; a cross-encoder's head pools inside the graph)
    scores: bool = False  # the graph ends in the sequence-classification head's logits
    heads_and_width: tuple[int, int] = (0, 0)  # attention heads and hidden size (0: ONNX Runtime's fuser detects)


def export_onnx(model_dir: Path, out_dir: Path, *, scores: bool = False) -> Export:
    """The folder's transformers model as ONNX (once per folder and run): its encoder to the last
    hidden state, or with `scores` its `*ForSequenceClassification` model to the logits."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    if scores and not any(a.endswith("ForSequenceClassification") for a in config.architectures or ()):
        raise ConfigError(f"{model_dir} is no cross-encoder (config.json's architectures: {config.architectures})")
    auto = AutoModelForSequenceClassification if scores else AutoModel
    model = auto.from_pretrained(model_dir, attn_implementation="eager").eval()
    types = int(getattr(config, "type_vocab_size", 0) or 0) > 0
    names = ("input_ids", "attention_mask", "token_type_ids") if types else ("input_ids", "attention_mask")
    output = "logits" if scores else "last_hidden_state"

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return getattr(self.model(**dict(zip(names, tensors))), output)

    sample = tuple(torch.ones(2, 16, dtype=torch.long) for _ in names)
    path = out_dir / "model.onnx"
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {
        output: {0: "batch"} if scores else {0: "batch", 1: "sequence"}
    }
    with torch.inference_mode():
        torch.onnx.export(
            Graph(),
            sample,
            str(path),
            dynamo=False,
            input_names=list(names),
            output_names=[output],
            dynamic_axes=axes,
            opset_version=17,
        )
    # The fuser detects an encoder's heads and width itself; on a classifier's graph it misses them
    # and leaves attention unfused. (Told them on an encoder, it fuses differently: MiniLM's int8
    # then falls under the 0.99 gate.)
    shape = (int(config.num_attention_heads), int(config.hidden_size)) if scores else (0, 0)
    return Export(path, names, _pooling(model_dir), scores, shape)


def _pooling(model_dir: Path) -> str:
    try:
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "mean"
    return "cls" if pooling.get("pooling_mode_cls_token") else "mean"


class _Runner:
    """One runtime's session: `run(batch of arrays) -> the graph's output` (last hidden state or logits)."""

    def __init__(self, name: str, export: Export, work: Path, threads: int) -> None:
        self.name = name
        if name.startswith("ort"):
            self.run = _ort_session(name, export, work, threads)
        else:
            self.run = _openvino_model(name, export, threads)


def _ort_session(name: str, export: Export, work: Path, threads: int):
    try:
        import onnxruntime as ort
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as exc:
        raise ConfigError(f"--against {name} needs onnxruntime: pip install onnxruntime") from exc
    fused = work / "model-fused.onnx"
    if not fused.exists():
        heads, width = export.heads_and_width
        optimize_model(str(export.onnx), model_type="bert", num_heads=heads, hidden_size=width).save_model_to_file(
            str(fused)
        )
    path = fused
    if name == "ort-int8":
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        path = work / "model-int8.onnx"
        if not path.exists():  # the fused ops' outputs have no inferred type: they are float
            quantize_dynamic(
                str(fused),
                str(path),
                weight_type=QuantType.QInt8,
                per_channel=True,
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}

    def run(arrays: dict[str, np.ndarray]) -> np.ndarray:
        return session.run(None, {k: v for k, v in arrays.items() if k in wanted})[0]

    return run


def _openvino_model(name: str, export: Export, threads: int):
    try:
        import openvino as ov
    except ImportError as exc:
        raise ConfigError(f"--against {name} needs openvino: pip install openvino") from exc
    core = ov.Core()
    precision = "bf16" if name == "openvino-bf16" else "f32"
    if precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise ConfigError(f"--against {name}: this CPU has no bf16 (AVX512-BF16 or AMX); OpenVINO would run fp32")
    compiled = core.compile_model(
        core.read_model(str(export.onnx)),
        "CPU",
        {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads},
    )
    request = compiled.create_infer_request()
    wanted = {p.get_any_name() for p in compiled.inputs}

    def run(arrays: dict[str, np.ndarray]) -> np.ndarray:
        request.infer({k: v for k, v in arrays.items() if k in wanted})
        return request.get_output_tensor(0).data.copy()

    return run


def _run_sorted(runner: _Runner, export: Export, encodings: list, batch: int) -> tuple[np.ndarray, int]:
    """One output row per encoding (in the order given) and their tokens: sorted by length and run
    `batch` at a time, each batch padded to its longest. Rows: normalised vectors, or raw scores."""
    order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
    out: list[np.ndarray] = [np.empty(0)] * len(encodings)
    tokens = 0
    for at in range(0, len(order), batch):
        rows = order[at : at + batch]
        width = max(len(encodings[i].ids) for i in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        mask, types = np.zeros_like(ids), np.zeros_like(ids)
        for r, i in enumerate(rows):
            n = len(encodings[i].ids)
            ids[r, :n], mask[r, :n], types[r, :n] = encodings[i].ids, 1, encodings[i].type_ids
        tokens += int(mask.sum())
        output = runner.run({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        if export.scores:
            pooled = output[:, 0]  # [b]: the first logit, the raw score
        else:
            if export.pooling == "cls":
                pooled = output[:, 0]
            else:
                pooled = (output * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            pooled = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        for r, i in enumerate(rows):
            out[i] = pooled[r]
    return np.stack(out), tokens


def _encode(runner: _Runner, tokenizer, export: Export, call, batch: int) -> tuple[np.ndarray, int]:
    """A call's rows (vectors of its texts, or raw scores of its (query, text) pairs) and tokens."""
    texts = list(call.texts)
    inputs = [(call.query, t) for t in texts] if export.scores else texts
    return _run_sorted(runner, export, tokenizer.encode_batch(inputs), batch)


def _agreement(export: Export, first: np.ndarray, served: list) -> float:
    """Min cosine of the rows to shoal's vectors, or the largest score difference over the spread
    of shoal's scores."""
    if export.scores:
        theirs = np.asarray(served, dtype=np.float64)
        spread = max(float(theirs.max() - theirs.min()), 1e-6)
        return float(np.abs(first - theirs).max() / spread)
    theirs = np.asarray(served, dtype=np.float64)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    return float((first * theirs).sum(axis=1).min())


def passes(name: str, export: Export, agreement: float) -> bool:
    """Whether a runtime's agreement with shoal reaches the bar for its precision and output."""
    reduced = name in REDUCED
    if export.scores:
        return agreement <= (MAX_SCORE_DIFF_REDUCED if reduced else MAX_SCORE_DIFF_FP32)
    return agreement >= (MIN_COSINE_REDUCED if reduced else MIN_COSINE_FP32)


def runtime_baseline(
    name: str,
    export: Export,
    model_dir: Path,
    work: Path,
    workload: Workload,
    *,
    duration_s: float,
    served: list,
    max_length: int,
    threads: int,
) -> tuple[float, InProcess | None]:
    """(the runtime's agreement with shoal on the first call, its best figure over BATCH_SIZES), or
    (that agreement, None) when it misses the bar: outputs that differ get no figure. `served`:
    shoal's vectors for the first call's texts, or its raw scores of the call's pairs (`export.scores`);
    agreement: the smallest cosine, or the largest score difference over the spread of shoal's."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    # A pair is cut from its document only, as shoal's tokenizer cuts it.
    tokenizer.enable_truncation(max_length, strategy="only_second" if export.scores else "longest_first")
    runner = _Runner(name, export, work, threads)
    calls = workload.calls
    first, _ = _encode(runner, tokenizer, export, calls[0], BATCH_SIZES[-1])
    agreement = _agreement(export, first, served)
    if not passes(name, export, agreement):
        return agreement, None
    best: InProcess | None = None
    by_size: dict[int, float] = {}
    for batch in BATCH_SIZES:
        num_calls = items = tokens = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s:
            call = calls[num_calls % len(calls)]
            tokens += _encode(runner, tokenizer, export, call, batch)[1]
            num_calls += 1
            items += len(call.texts)
        figure = InProcess(num_calls, items, tokens, time.perf_counter() - start, batch_size=batch)
        by_size[batch] = figure.items_per_s
        if best is None or figure.tokens_per_s > best.tokens_per_s:
            best = figure
    assert best is not None
    best.items_per_s_by_batch_size = by_size
    return agreement, best
