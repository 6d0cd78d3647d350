"""Checkpoints (a config file + weights) -> a model on a device, via the model's weight map.

A folder holds its checkpoint in one of the `LAYOUTS`: transformers' (config.json with
`*.safetensors`, or `pytorch_model*.bin`) or open_clip's (open_clip_config.json with
`open_clip_model.safetensors`, or `open_clip_pytorch_model.bin`); `checkpoint_layout` decides
which. Safetensors are read lazily, torch pickles with `torch.load(weights_only=True)`. The model
class declares, as data, how checkpoint names become its parameter names (`weight_map`: pattern,
replacement, shard), which checkpoint tensors it ignores and which it stores transposed
(`transposed_weights`: `[in, out]` where the parameter, an nn.Linear's weight, is `[out, in]`).
Fused projections (q, k, v into one `FusedLinear`) are filled shard by shard (shard i), or whole
from a checkpoint that fuses them too (shard None). Every parameter must be filled exactly;
anything else is a ModelLoadError that names the tensors.
"""

from __future__ import annotations

import importlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from .errors import ModelLoadError
from .models import model_class

# Prefixes that task heads and wrappers put in front of the encoder's tensor names; a model class
# may declare its own as `checkpoint_prefixes`.
_PREFIXES = ("bert.", "model.")
_LEGACY = ((".gamma", ".weight"), (".beta", ".bias"))

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Layout:
    """How a folder holds a checkpoint: the config file that names the layout, and its weights
    (`safetensors`, else `pickles`: file patterns in the folder)."""

    config_file: str
    safetensors: str
    pickles: str
    # "module:function" turning the config file's JSON into config.json's keys; None: it is config.json
    convert: str | None = None

    def weight_files(self, directory: Path) -> list[Path]:
        """The folder's weight files in this layout: its safetensors, or failing those its pickles.
        A file that another layout names outright is that layout's, not a match of a pattern here
        (open_clip_model.safetensors is no transformers shard)."""
        named = {p for other in LAYOUTS if other != self for p in (other.safetensors, other.pickles) if "*" not in p}
        for pattern in (self.safetensors, self.pickles):
            files = sorted(path for path in directory.glob(pattern) if path.name not in named)
            if files:
                return files
        return []


# In order of preference, for a folder that holds several (the LAION hub repos ship both).
LAYOUTS = (
    Layout("config.json", "*.safetensors", "pytorch_model*.bin"),
    Layout(
        "open_clip_config.json",
        "open_clip_model.safetensors",
        "open_clip_pytorch_model.bin",
        convert="shoal.models.clip:config_from_open_clip",
    ),
)
_READ = ", or ".join(f"{lay.config_file} with {lay.safetensors} (or {lay.pickles})" for lay in LAYOUTS)


def checkpoint_layout(directory: Path) -> tuple[Layout, list[Path]]:
    """The layout of the folder's checkpoint and its weight files: the first of `LAYOUTS` whose
    config file and weights the folder holds both of; for a folder that holds weights beside none
    of those config files (a GLiNER folder, whose caller reads its config), the first whose weights
    it holds. A ModelLoadError, naming the layouts shoal reads, where it holds no weights."""
    found = [(layout, files) for layout in LAYOUTS if (files := layout.weight_files(directory))]
    if not found:
        raise ModelLoadError(f"{directory}: no checkpoint shoal reads; it reads {_READ}")
    return next(((layout, files) for layout, files in found if (directory / layout.config_file).is_file()), found[0])


def read_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}/config.json: {exc}") from None


def read_model_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's config in config.json's keys, from its layout's config file (a folder with
    a config and no weights yet: the first layout whose config it holds, so that a model shoal does
    not implement is refused by what its config says before the weights are looked for)."""
    configured = [layout for layout in LAYOUTS if (directory / layout.config_file).is_file()]
    has_weights = any(layout.weight_files(directory) for layout in LAYOUTS)
    layout = checkpoint_layout(directory)[0] if has_weights or not configured else configured[0]
    path = directory / layout.config_file
    if not path.is_file():
        raise ModelLoadError(f"{directory}: weights with no config file beside them; shoal reads {_READ}")
    if layout.convert is None:
        return read_config(directory)
    try:
        raw = json.loads(path.read_text())
        module, _, name = layout.convert.partition(":")
        return cast("dict[str, Any]", getattr(importlib.import_module(module), name)(raw))
    except (OSError, ValueError, TypeError, KeyError) as exc:  # unreadable, or a model shoal does not implement
        raise ModelLoadError(f"{path}: {exc}", details={"file": layout.config_file}) from None


def build_model(
    directory: Path,
    architecture: str | None,
    device: str,
    dtype: str = "float32",
    *,
    config: dict[str, Any] | None = None,
    prefixes: tuple[str, ...] | None = None,
) -> nn.Module:
    """Instantiate the architecture from the checkpoint's config (or `config`) and load its
    weights, ready for inference. `prefixes`: what the checkpoint puts before the encoder's names,
    when it is not what the model class declares (a GLiNER checkpoint nests its backbone)."""
    model = _meta_model(directory, architecture, config).to_empty(device=device)
    load_weights(model, directory, prefixes)
    return model.to(_DTYPES[dtype]).eval().requires_grad_(False)


def _meta_model(directory: Path, architecture: str | None, config: dict[str, Any] | None = None) -> nn.Module:
    """The architecture built from the checkpoint's config (or `config`) on the meta device:
    shapes, no memory."""
    config = read_model_config(directory) if config is None else config
    arch = architecture or config.get("model_type")
    try:
        cls = model_class(str(arch))
        cfg = cls.config_class.from_dict(config)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{directory}: {exc}") from None
    with torch.device("meta"):
        return cls(cfg)


def _checkpoint_files(directory: Path) -> list[Path]:
    return checkpoint_layout(directory)[1]


def _tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """(name, load, shape) for each tensor of one file, loading lazily where the format allows.

    safetensors is read lazily; a torch pickle (.bin/.pt) only with `weights_only=True`, which
    refuses arbitrary code.
    """
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():

                def get(key: str = key) -> torch.Tensor:
                    return f.get_tensor(key)

                yield key, get, tuple(f.get_slice(key).get_shape())
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
        for key, tensor in state.items():

            def loaded(tensor: torch.Tensor = tensor) -> torch.Tensor:
                return tensor

            yield key, loaded, tuple(tensor.shape)


def _canonical(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    for old, new in _LEGACY:
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


def load_weights(model: nn.Module, directory: Path, prefixes: tuple[str, ...] | None = None) -> None:
    # Class attributes of the model class (nn.Module's __getattr__ stub says Tensor | Module).
    weight_map = cast("Iterable[tuple[str, str, int | None]]", model.weight_map)
    rules = [(re.compile(p), repl, shard) for p, repl, shard in weight_map]
    ignored = [re.compile(p) for p in cast("Iterable[str]", model.ignored_weights)]
    transposed = [re.compile(p) for p in cast("Iterable[str]", getattr(model, "transposed_weights", ()))]
    prefixes = tuple(getattr(model, "checkpoint_prefixes", _PREFIXES)) if prefixes is None else prefixes
    params = dict(model.named_parameters())
    filled: Counter[str] = Counter()
    unknown: list[str] = []

    for path in _checkpoint_files(directory):
        for key, load, _ in _tensors(path):
            name = _canonical(key, prefixes)
            target = _route(rules, name)
            if target is None:
                if not any(p.fullmatch(name) for p in ignored):
                    unknown.append(key)
                continue
            param_name, shard = target
            if param_name not in params:  # e.g. an MLM head the model was built without
                unknown.append(key)
                continue
            tensor = load()
            if any(p.fullmatch(name) for p in transposed):
                tensor = tensor.T
            _copy(model, params[param_name], param_name, shard, tensor, key)
            # A shard fills one of the parameter's shards; a whole tensor fills them all.
            filled[param_name] += 1 if shard is not None else _num_shards(model, param_name)

    missing = [name for name in params if filled[name] != _num_shards(model, name)]
    if missing:
        raise ModelLoadError(
            f"{directory}: checkpoint lacks tensors for {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
            details={"missing": missing, "unused": unknown},
        )


def _num_shards(model: nn.Module, param_name: str) -> int:
    """How many checkpoint shards fill the parameter: a FusedLinear's parts, else 1."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return len(getattr(module, "shard_sizes", (0,)))


def _route(rules, name: str) -> tuple[str, int | None] | None:
    for pattern, repl, shard in rules:
        match = pattern.fullmatch(name)
        if match:
            return match.expand(repl), shard
    return None


def _copy(
    model: nn.Module, param: torch.Tensor, param_name: str, shard: int | None, tensor: torch.Tensor, key: str
) -> None:
    dest = param.data
    if shard is not None:
        sizes = cast("tuple[int, ...]", model.get_submodule(param_name.rsplit(".", 1)[0]).shard_sizes)
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{key}: shape {tuple(tensor.shape)} does not fit {param_name} {tuple(dest.shape)}")
    dest.copy_(tensor)


def tensor_shape(directory: Path, names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The shape of the first of `names` the checkpoint holds (in one pass over it, read from
    headers where the format allows), or None."""
    found: dict[str, tuple[int, ...]] = {}
    for path in _checkpoint_files(directory):
        for key, _, shape in _tensors(path):
            if key in names:
                found[key] = shape
    return next((found[name] for name in names if name in found), None)


def estimate_bytes(
    directory: Path, dtype: str = "float32", *, quantize: str | None = None, architecture: str | None = None
) -> int:
    """Bytes the weights take once loaded in `dtype`: from safetensors headers, or from the shapes
    of memory-mapped torch pickles (the files of the folder's layout). With `quantize` "int8", the
    encoder's Linear weights (of `architecture`, default the config's) take one byte per element
    plus a float32 scale per output row, as layers/int8.py stores them; with "int4", the decoder's
    Linears half a byte per element plus a bfloat16 scale and zero per 32 (layers/int4.py), and
    its LM head an int8 copy of the embeddings or of its own head (a byte each plus a scale per row)."""
    itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    total = 0
    for path in _checkpoint_files(directory):
        for _, _, shape in _tensors(path):
            numel = 1
            for dim in shape:
                numel *= dim
            total += numel * itemsize
    if quantize == "int8":
        linears = [m for m in _meta_model(directory, architecture).modules() if isinstance(m, nn.Linear)]
        total -= sum(m.weight.numel() * (itemsize - 1) - m.out_features * 4 for m in linears)
    elif quantize == "int4":
        from .layers.int4 import GROUP, fits

        model = _meta_model(directory, architecture)
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and fits(m)]
        total -= sum(
            m.weight.numel() * itemsize - m.weight.numel() // 2 - m.weight.numel() // GROUP * 4 for m in linears
        )
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        total += sum(m.weight.numel() + m.num_embeddings * 2 for m in embeddings[:1])  # the int8 head
    return total


def load_tensors(
    directory: Path, names: list[str], file: str | None = None, prefixes: tuple[str, ...] = _PREFIXES
) -> dict[str, torch.Tensor]:
    """Tensors by name for a head (MLM head, projections), from the model's safetensors or `file`.

    Names match after prefix stripping, as for the encoder. A `.pt`/`.bin` file is read with
    `torch.load(weights_only=True)` (BGE-M3 ships its sparse and ColBERT heads that way).
    """
    wanted = set(names)
    found: dict[str, torch.Tensor] = {}
    paths = [directory / file] if file else _checkpoint_files(directory)
    for path in paths:
        if not path.is_file():
            raise ModelLoadError(f"{path}: head weights file not found")
        for key, load, _ in _tensors(path):
            name = _canonical(key, prefixes)
            if name in wanted:
                found[name] = load()
    missing = sorted(wanted - set(found))
    if missing:
        raise ModelLoadError(f"{directory}: no tensors named {', '.join(missing)}" + (f" in {file}" if file else ""))
    return found
