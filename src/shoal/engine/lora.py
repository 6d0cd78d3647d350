"""PEFT LoRA adapters: read from their folder onto shoal's modules, and the table of the adapters a
runner has installed.

A folder is what `PeftModel.save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`, read with `torch.load(weights_only=True)`).
Each `<prefix>.<module>.lora_A[.<adapter>].weight` `[r, in]` / `lora_B` `[out, r]` pair names a
module of the model PEFT wrapped; the name is mapped as the base checkpoint's are: PEFT's
`base_model.model.` stripped, then the model's checkpoint prefixes, then `<module>.weight` routed
through the model class's `weight_map` to a shoal Linear and shard (`query` -> shard 0 of `qkv`).
No per-architecture table: whatever the base checkpoint loads through, its adapter does too.

Scale per module: `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), r and alpha from
`rank_pattern` / `alpha_pattern` where a pattern matches the module, as PEFT resolves them.
`fan_in_fan_out` describes how the base layer stores its weight (GPT-2's Conv1D); LoRA factors are
stored `[r, in]` / `[out, r]` either way, so it changes nothing here. Refused, with what to do
instead: DoRA, LoRA biases, `bias` other than "none", `modules_to_save`, and the PEFT variants whose
forward is not `x @ A^T @ B^T` (their config field set).

Targets outside the encoder (a pooler, a masked-LM or LM head: the model's `ignored_weights`) are
refused, or dropped when the runner's heads never run those modules (`drop_head_targets`). So are
Linears a model also applies to something all sequences share (`model.shared_linears()`: DeBERTa's
projections of its relative-position table), which per-sequence routing cannot adapt.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..errors import InferenceFailed, ModelLoadError
from ..layers import AdapterFactors, Int8Linear, LoraFactors, LoraRouting, LoraShard
from ..layers.packed import PackedLinear
from ..weights import _PREFIXES, _canonical, _route, _tensors

_PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<kind>A|B|embedding_A|embedding_B)(?:\.(?P<adapter>[^.]+))?\.weight")
# Config fields that, when set, change what the adapter computes beyond x @ A^T @ B^T.
_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales the merged weight per column; merge it into the base model instead",
    "lora_bias": "LoRA biases (lora_bias) are not supported; retrain with lora_bias=False",
    "modules_to_save": "modules_to_save replaces whole modules (a classifier, embeddings); shoal applies only "
    "low-rank deltas: merge the adapter into the base model instead",
    "trainable_token_indices": "trainable token embeddings are not supported; merge the adapter instead",
    "layer_replication": "layer_replication changes the model's layers; merge the adapter instead",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}


@dataclass(frozen=True)
class AdapterConfig:
    """What shoal reads from adapter_config.json."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str | None
    fan_in_fan_out: bool
    base_model_name_or_path: str | None  # informational

    def scale(self, module: str) -> tuple[int, float]:
        """(r, scale) of one PEFT module name, patterns resolved as PEFT resolves them."""
        r = int(_pattern_value(self.rank_pattern, module, self.r))
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter, ready to install: its updates per shoal Linear on the runner's device and dtype."""

    name: str
    directory: Path
    config: AdapterConfig
    factors: AdapterFactors  # shoal module name -> stacked update
    dropped_modules: tuple[str, ...] = ()  # PEFT modules outside the encoder, not applied

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for f in self.factors.values())


def _refused(message: str, details: dict[str, Any] | None = None) -> ModelLoadError:
    """An adapter this server cannot apply as its files stand: a retry cannot help until they
    change (then the watcher reloads it), so the error is permanent (no Retry-After)."""
    return ModelLoadError(message, details=details, permanent=True)


def read_adapter_config(directory: Path) -> AdapterConfig:
    """adapter_config.json, with every feature shoal cannot apply refused by name."""
    path = directory / "adapter_config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refused(f"{path}: cannot read the adapter config: {exc}") from None
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refused(f"{path}: peft_type {peft_type!r}; shoal serves LoRA adapters only")
    for field, why in _REFUSED.items():
        if raw.get(field):
            raise _refused(f"{path}: {why}", details={"field": field})
    if raw.get("bias", "none") != "none":
        raise _refused(
            f"{path}: bias={raw['bias']!r} trains the base model's biases; shoal applies only "
            "low-rank deltas: retrain with bias='none' or merge the adapter",
            details={"field": "bias"},
        )
    targets = raw.get("target_modules")
    return AdapterConfig(
        r=int(raw.get("r", 8)),
        lora_alpha=float(raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora")),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        target_modules=tuple(targets) if isinstance(targets, list) else targets,
        fan_in_fan_out=bool(raw.get("fan_in_fan_out")),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )


def read_adapter(
    name: str,
    directory: Path,
    model: nn.Module,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    drop_head_targets: bool = False,
    prefixes: tuple[str, ...] | None = None,
) -> LoraAdapter:
    """The adapter in `directory` mapped onto `model` (a shoal model), its tensors on `device` in
    `dtype`. `prefixes`: the base checkpoint's, when not the model class's."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    pairs = _read_pairs(directory)
    # A shoal model class's attributes (shoal.models), which nn.Module types as `Tensor | Module`.
    weight_map = cast(Sequence[tuple[str, str, int | None]], model.weight_map)
    rules = [(re.compile(p), repl, shard) for p, repl, shard in weight_map]
    ignored = [re.compile(p) for p in cast(Sequence[str], model.ignored_weights)]
    prefixes = tuple(getattr(model, "checkpoint_prefixes", _PREFIXES)) if prefixes is None else prefixes

    shared_linears = getattr(model, "shared_linears", None)
    shared: set[str] = set(shared_linears()) if shared_linears is not None else set()
    shards: dict[str, list[LoraShard]] = {}
    unrouted, dropped, on_shared = [], [], []
    for module, (a, b, names) in sorted(pairs.items()):
        canonical = _canonical(f"{module}.weight", prefixes)
        target = _route(rules, canonical)
        if target is None:
            if any(p.fullmatch(canonical) for p in ignored):
                dropped.append(module)
            else:
                unrouted.append(names[0])
            continue
        param, shard = target
        ours = param.rpartition(".")[0]  # e.g. "layers.0.qkv"
        linear = _linear(model, ours, shard)
        if linear is None:
            unrouted.append(names[0])
            continue
        if ours in shared:
            on_shared.append(module)
            continue
        r, scale = config.scale(module)
        _check_shapes(names, a, b, r, linear, shard, ours)
        shards.setdefault(ours, []).append(LoraShard(shard, a, b, scale))
    if unrouted:
        raise _refused(
            f"{directory}: LoRA tensors for modules that are not Linears of this model's encoder: "
            f"{', '.join(unrouted[:8])}"
            + (f" and {len(unrouted) - 8} more" if len(unrouted) > 8 else "")
            + "; was the adapter trained on this base model?",
            details={"tensors": unrouted},
        )
    if on_shared:
        raise _refused(
            f"{directory}: the adapter targets {', '.join(on_shared[:8])}, which this model also "
            "applies to inputs every sequence of a batch shares (DeBERTa's relative-position "
            "table); a per-sequence adapter cannot adapt them: retrain without them or merge it",
            details={"modules": on_shared},
        )
    if dropped and not drop_head_targets:
        raise _refused(
            f"{directory}: the adapter targets {', '.join(dropped[:8])}, outside the encoder, which "
            "this model's heads use; shoal adapts the encoder's Linears only: retrain excluding them "
            "(exclude_modules) or merge the adapter",
            details={"modules": dropped},
        )
    if not shards:
        raise _refused(
            f"{directory}: the adapter adapts no Linear of the encoder (target_modules: {config.target_modules})"
        )
    # Each module is one `_linear` accepted: a float Linear, or its int8 or packed form.
    factors = {
        m: LoraFactors.stack(cast(nn.Linear | Int8Linear | PackedLinear, model.get_submodule(m)), s).to(device, dtype)
        for m, s in shards.items()
    }
    return LoraAdapter(name, directory, config, factors, tuple(dropped))


def _read_pairs(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple[str, str]]]:
    """PEFT module name -> (A, B, (A's tensor name, B's)) from the adapter's weights file."""
    path = next(
        (p for p in (directory / "adapter_model.safetensors", directory / "adapter_model.bin") if p.is_file()), None
    )
    if path is None:
        raise _refused(f"{directory}: no adapter_model.safetensors (or adapter_model.bin)")
    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    adapters, unexpected = set(), []
    for key, load, _ in _tensors(path):
        match = _TENSOR.fullmatch(key)
        if match is None:
            unexpected.append(key)
            continue
        if match["kind"].startswith("embedding"):
            raise _refused(f"{path}: {key}: LoRA on embeddings is not supported; retrain targeting Linears only")
        adapters.add(match["adapter"])
        module = match["module"].removeprefix(_PEFT_PREFIX)
        found.setdefault(module, {})[match["kind"]] = (key, load())
    if unexpected:
        raise _refused(
            f"{path}: tensors that are not LoRA A/B weights: {', '.join(unexpected[:8])}"
            " (LoRA biases, DoRA magnitudes or saved modules are not supported)",
            details={"tensors": unexpected},
        )
    if len(adapters) > 1:
        raise _refused(
            f"{path}: holds several adapters ({', '.join(sorted(map(str, adapters)))}); save each to its own folder"
        )
    pairs = {}
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            have = next(iter(parts.values()))[0]
            raise _refused(f"{path}: {have} has no lora_{'B' if 'A' in parts else 'A'} partner")
        (name_a, a), (name_b, b) = parts["A"], parts["B"]
        pairs[module] = (a, b, (name_a, name_b))
    return pairs


def _linear(model: nn.Module, module: str, shard: int | None) -> nn.Linear | Int8Linear | PackedLinear | None:
    try:
        linear = model.get_submodule(module)
    except AttributeError:
        return None
    # An int8 base (quantize: int8) or a oneDNN-packed one (float32 on CPU) takes float32 deltas too.
    if not isinstance(linear, (nn.Linear, Int8Linear, PackedLinear)):
        return None
    if shard is not None and shard >= len(getattr(linear, "shard_sizes", ())):
        return None
    return linear


def _check_shapes(
    names: tuple[str, str],
    a: torch.Tensor,
    b: torch.Tensor,
    r: int,
    linear: nn.Linear | Int8Linear | PackedLinear,
    shard: int | None,
    ours: str,
) -> None:
    shard_sizes: tuple[int, ...] = getattr(linear, "shard_sizes", ())  # a fused Linear's; `_linear` checked `shard`
    out = linear.out_features if shard is None else shard_sizes[shard]
    where = ours + ("" if shard is None else f" shard {shard}")
    if tuple(a.shape) != (r, linear.in_features):
        raise _refused(
            f"{names[0]}: shape {tuple(a.shape)}, expected (r={r}, in={linear.in_features}) for "
            f"{where}" + (" (r from adapter_config.json's r / rank_pattern)" if a.shape[0] != r else "")
        )
    if tuple(b.shape) != (out, r):
        raise _refused(f"{names[1]}: shape {tuple(b.shape)}, expected (out={out}, r={r}) for {where}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first pattern that matches the end of the module name, on a dot boundary."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


class AdapterTable:
    """The adapters installed on one runner, by name and slot (a small int, stable while installed).

    Writers (`install`, `remove`, from loader threads) take a lock and swap in a new snapshot; a
    forward reads one snapshot at its start, so it never sees a half-installed adapter and an
    install during it changes nothing it computes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, int] = {}
        self._by_slot: dict[int, LoraAdapter] = {}  # replaced, never mutated

    def install(self, adapter: LoraAdapter) -> int:
        with self._lock:
            if adapter.name in self._by_name:
                raise _refused(f"adapter {adapter.name!r} is already installed; remove it first")
            slot = next(i for i in range(len(self._by_slot) + 1) if i not in self._by_slot)
            self._by_slot = {**self._by_slot, slot: adapter}
            self._by_name = {**self._by_name, adapter.name: slot}
            return slot

    def remove(self, name: str) -> None:
        with self._lock:
            slot = self._by_name.get(name)
            if slot is None:
                raise KeyError(f"adapter {name!r} is not installed")
            self._by_name = {k: v for k, v in self._by_name.items() if k != name}
            self._by_slot = {k: v for k, v in self._by_slot.items() if k != slot}

    def slot(self, name: str) -> int | None:
        return self._by_name.get(name)

    def get(self, name: str) -> LoraAdapter:
        slot = self._by_name.get(name)
        if slot is None:
            raise KeyError(f"adapter {name!r} is not installed")
        return self._by_slot[slot]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def routing(self, cu_seqlens: np.ndarray, slots: np.ndarray, device: torch.device) -> LoraRouting | None:
        """The routing of one batch (`cu_seqlens` `[n+1]`, `slots` `[n]`) over this snapshot."""
        by_slot = self._by_slot
        missing = sorted({int(s) for s in slots if s >= 0 and int(s) not in by_slot})
        if missing:
            raise InferenceFailed(f"the batch uses adapter slots {missing}, which hold no adapter")
        return LoraRouting.build(cu_seqlens, slots, {s: a.factors for s, a in by_slot.items()}, device)
