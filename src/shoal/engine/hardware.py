"""The hardware class of a device: the key a card's `batching` (and a tuned overlay) is looked up by."""

from __future__ import annotations

import re

from ..cpuinfo import cpu_flags, model_name
from ..errors import ConfigError


def hardware_class(device: str) -> str:
    """The key a card's `batching` is looked up by: "cpu:<CPU model>+<ISA>" (`cpu_class`) or "cuda:<device name>"."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but torch sees no CUDA device here; use --device cpu")
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    if device != "cpu":
        raise ConfigError(f"unsupported device {device!r}: use cpu, cuda or cuda:N")
    return cpu_class()


def cpu_class() -> str:
    """ "cpu:<model name>+<ISA>" (the first model name /proc/cpuinfo gives, less trademarks and
    clock; the widest vector ISA, `cpu_isa`), "cpu:<model name>" where no ISA is known, or "cpu"
    where the name cannot be read. One model name covers CPUs of different ISAs (AMD EPYC: AVX2
    and AVX-512 generations), whose best batching and kernels differ; a card's `batching_for`
    falls back from this class to the name alone, then to "cpu"."""
    name = model_name()
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|@.*$|\d+-Core Processor", " ", name)
    name = " ".join(re.sub(r"[^\w .-]", " ", name).split())
    if not name:
        return "cpu"
    isa = cpu_isa(cpu_flags())
    return f"cpu:{name}+{isa}" if isa else f"cpu:{name}"


def cpu_isa(flags: frozenset[str] | set[str]) -> str | None:
    """The widest vector ISA in `flags`, as a class suffix: amx, avx512[-vnni], avx2[-vnni], or None."""
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if "avx2" in flags:
        return "avx2-vnni" if "avx_vnni" in flags else "avx2"
    return None
