"""The precision a model runs at on a device: the card as written, its limits for this hardware
class (a `shoal tune` overlay may set `dtype` or `quantize`), or bfloat16 where that is safe and
fast. Torch-free: the backend loads the card this returns, and `/v1/models` reports it.

    card ─ batching_for(hardware).quantize / .dtype set? ──────────────── those (tuned or by hand)
         ─ reduced precision allowed, card lists bfloat16 in `precisions`
           (its quality gate passed: tests/test_precision_gate.py), a float32
           card on a CPU with native bf16 (AMX or AVX512-BF16)
           or on a CUDA device with bf16 (compute capability 8.0 or later)? ── dtype bfloat16
         ─ otherwise ──────────────────────────────────────────────────── the card's own

Where a CPU lacks native bf16, torch emulates it and bfloat16 runs slower than float32; such a CPU
keeps float32 unless the card or its limits ask for bfloat16 by name. On a GPU, bf16 matmuls
accumulate in float32 (cuBLAS, flash-attn); a card's limits cannot set a GPU's dtype (the card
refuses `batching.cuda.dtype`).
"""

from __future__ import annotations

import msgspec

from ..catalog import ModelCard
from ..cpuinfo import cpu_flags
from ..errors import ConfigError
from .hardware import hardware_class

# /proc/cpuinfo flags of the CPUs whose bf16 matmuls run natively (oneDNN's AMX and AVX512-BF16 kernels).
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with `flags`) multiplies bf16 natively."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def card_for_device(
    card: ModelCard,
    device: str,
    *,
    reduced: bool = True,
    hardware: str | None = None,
    flags: frozenset[str] | None = None,
) -> ModelCard:
    """`card` as it runs on `device` (see the module docstring): its limits' `quantize` and `dtype`
    for the hardware class, else bfloat16 where `reduced` allows, the card lists it and the CPU has
    it natively. `hardware` and `flags` default to this machine's."""
    if not device.startswith("cpu"):  # int8 is refused there (check_quantize)
        gated = reduced and _gated_bf16(card)
        return msgspec.structs.replace(card, dtype="bfloat16") if gated and cuda_bf16(device) else card
    hardware = hardware or hardware_class(device)
    limits = card.batching_for(hardware)
    chosen = card.quantize_for(hardware)
    if limits.dtype is not None:
        return chosen if chosen.dtype == limits.dtype else msgspec.structs.replace(chosen, dtype=limits.dtype)
    if reduced and _gated_bf16(chosen) and native_bf16(flags):
        return msgspec.structs.replace(chosen, dtype="bfloat16")
    return chosen


def _gated_bf16(card: ModelCard) -> bool:
    """A float32 card whose quality gate passed in bfloat16."""
    return "bfloat16" in card.precisions and card.dtype == "float32" and card.quantize is None


def cuda_bf16(device: str) -> bool:
    """Whether the CUDA device computes in bf16 natively (Ampere and later)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def precision_of(card: ModelCard) -> str:
    """What a loaded card computes in: "int8" (int8 Linears over float32 activations), "int4"
    (4-bit Linear weights) or its dtype."""
    return card.quantize or card.dtype


def check_quantize(card: ModelCard, device: str) -> None:
    """`quantize` (int8; int4 for generating cards) is a CPU backend over float32 activations; the
    card's own check covers the dtype, but a card built in code (msgspec.structs.replace), or one
    whose limits for two hardware classes combine (a dtype from one, quantize from another), skips
    that check. Both the encoder runner and GeneratingModel call this at load."""
    if card.quantize is None:
        return
    if card.quantize == "int4" and card.generate is None:
        raise ConfigError(
            f"{card.id}: quantize int4 is for generating cards (a decode step's 4-bit weights): use int8",
            details={"model": card.id, "field": "quantize"},
        )
    if not device.startswith("cpu"):
        raise ConfigError(
            f"{card.id}: quantize {card.quantize} runs on CPUs only (its products are CPU kernels), "
            f"not on {device}: serve it on a CPU, or drop quantize and use dtype float16 or bfloat16",
            details={"model": card.id, "field": "quantize", "device": device},
        )
    if card.dtype != "float32":
        raise ConfigError(
            f"{card.id}: quantize {card.quantize} runs with float32 activations, not dtype "
            f"{card.dtype}: leave dtype unset (float32) or drop quantize",
            details={"model": card.id, "field": "quantize", "dtype": card.dtype},
        )
