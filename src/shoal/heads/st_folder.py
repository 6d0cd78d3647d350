"""What a sentence-transformers folder says about its dense output: the modules after the encoder.

`modules.json` lists the modules in order. The encoder (`Transformer`) comes first; after it shoal
reads `Pooling` (its mode, and `include_prompt`: when false the prompt's tokens are left out of
pooling), then any number of `Dense` (a linear layer and an activation, weights in the module's
folder) and `Normalize` modules, applied in order. `Dropout` is a no-op at inference. Any other
module would change the output in a way shoal does not compute, so it is a load error rather than a
silently different vector.

Both the current config keys (`pooling_mode`, `embedding_dimension`) and the older ones
(`pooling_mode_*_token(s)` booleans, `word_embedding_dimension`) are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

# sentence-transformers' pooling mode -> the card's `pooling`; other modes have no card value.
CARD_POOLING = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
# The older boolean keys, in the order sentence-transformers concatenates their outputs.
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_OUTPUT_KEY = "sentence_embedding"


@dataclass(frozen=True)
class DenseModule:
    """`y = activation(x @ W.T + b)` (+ x, or a projection of x, when `residual`)."""

    directory: Path  # holds linear.weight / linear.bias (and residual.weight)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # the torch.nn class name: Tanh, Identity, ...
    residual: bool = False


@dataclass(frozen=True)
class NormalizeModule:
    """L2 normalisation of the pooled vector."""


@dataclass(frozen=True)
class DensePipeline:
    """Pooling, then `steps` in order."""

    modes: tuple[str, ...]  # sentence-transformers' names; several are concatenated
    include_prompt: bool
    embedding_dimension: int  # the encoder's hidden size, as Pooling was built for
    steps: tuple[DenseModule | NormalizeModule, ...]

    @property
    def dimensions(self) -> int:
        """Length of the final vector."""
        denses = [s for s in self.steps if isinstance(s, DenseModule)]
        return denses[-1].out_features if denses else self.embedding_dimension * len(self.modes)

    @property
    def normalizes(self) -> bool:
        """The final vector has unit length (the last step is a Normalize)."""
        return bool(self.steps) and isinstance(self.steps[-1], NormalizeModule)


def read_pipeline(directory: Path) -> DensePipeline | None:
    """The folder's pooling and post-pooling modules; None when it has no modules.json or lists no
    Pooling module (the card alone then says how to pool)."""
    listing = directory / "modules.json"
    if not listing.is_file():
        return None
    modules = _read_json(listing)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{listing}: expected a list of modules")
    kinds = [(_kind(m.get("type", "")), directory / m.get("path", "")) for m in modules]  # in list order
    at = next((i for i, (kind, _) in enumerate(kinds) if kind == "Pooling"), None)
    if at is None:
        return None
    for kind, path in kinds[:at]:
        if kind != "Transformer":
            raise ModelLoadError(
                f"{listing}: module {kind} ({path.name}) before Pooling is not supported",
                details={"file": str(listing), "module": kind},
            )
    modes, include_prompt, width = _pooling(kinds[at][1] / "config.json")
    steps: list[DenseModule | NormalizeModule] = []
    for kind, path in kinds[at + 1 :]:
        if kind == "Dense":
            steps.append(_dense(path))
        elif kind == "Normalize":
            _check_keys(path / "config.json", ("module_input_name", "module_output_name"))
            steps.append(NormalizeModule())
        elif kind != "Dropout":
            raise ModelLoadError(
                f"{listing}: module {kind} ({path.name}) after Pooling is not supported "
                "(shoal applies Dense and Normalize)",
                details={"file": str(listing), "module": kind},
            )
    return DensePipeline(modes, include_prompt, width, tuple(steps))


def _pooling(path: Path) -> tuple[tuple[str, ...], bool, int]:
    config = _read_json(path)
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:  # older saves: one boolean per mode; none set means mean
        modes = tuple(m for key, m in _LEGACY_MODES.items() if config.get(key)) or ("mean",)
    width = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if not isinstance(width, int):
        raise ModelLoadError(f"{path}: no embedding_dimension", details={"file": str(path)})
    return modes, bool(config.get("include_prompt", True)), width


def _dense(folder: Path) -> DenseModule:
    path = folder / "config.json"
    config = _read_json(path)
    _check_keys(path, ("module_input_name", "module_output_name"), config)
    try:
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(
            f"{path}: needs integer in_features and out_features", details={"file": str(path)}
        ) from None
    # sentence-transformers' default activation is Tanh; it stores the class's dotted path.
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    if not name.startswith("torch."):
        raise ModelLoadError(
            f"{path}: activation_function {name!r} is not a torch.nn module",
            details={"file": str(path), "field": "activation_function"},
        )
    return DenseModule(
        folder,
        in_features,
        out_features,
        bool(config.get("bias", True)),
        name.rsplit(".", 1)[-1],
        bool(config.get("use_residual", False)),
    )


def _check_keys(path: Path, keys: tuple[str, ...], config: dict | None = None) -> None:
    """The module must read and write the pooled vector (not the token embeddings)."""
    if config is None:
        config = _read_json(path) if path.is_file() else {}
    for key in keys:
        value = config.get(key)
        if value is not None and value != _OUTPUT_KEY:
            raise ModelLoadError(
                f"{path}: {key} {value!r} is not supported (only {_OUTPUT_KEY!r})",
                details={"file": str(path), "field": key},
            )


def _kind(type_name: str) -> str:
    """`sentence_transformers.models.Dense` and `sentence_transformers.base.modules.dense.Dense`
    are both `Dense`."""
    return type_name.rsplit(".", 1)[-1]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}", details={"file": str(path)}) from None
