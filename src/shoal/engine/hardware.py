"""The hardware class of a device: the key a card's `batching` (and a tuned overlay) is looked up by."""

from __future__ import annotations

import re

from ..errors import ConfigError


def hardware_class(device: str) -> str:
    """The key a card's `batching` is looked up by: "cpu:<CPU model>" or "cuda:<device name>"."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but torch sees no CUDA device here; use --device cpu")
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    if device != "cpu":
        raise ConfigError(f"unsupported device {device!r}: use cpu, cuda or cuda:N")
    return cpu_class()


def cpu_class() -> str:
    """ "cpu:<model name>" (the first model name /proc/cpuinfo gives, less trademarks and clock), or
    "cpu" where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            name = next((line.partition(":")[2] for line in info if line.startswith("model name")), "")
    except OSError:
        name = ""
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|@.*$|\d+-Core Processor", " ", name)
    name = " ".join(re.sub(r"[^\w .-]", " ", name).split())
    return f"cpu:{name}" if name else "cpu"
