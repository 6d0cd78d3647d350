"""The CPU's model name and feature flags, read once from /proc/cpuinfo, and the cores this
process may run on (torch-free: the engine's hardware classes and lanes, the int8 layer's kernel
choice and `shoal tune` read them)."""

from __future__ import annotations

import functools
import os


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.cache
def _fields() -> dict[str, str]:
    """The first processor's `key: value` lines (Linux; empty elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def model_name() -> str:
    return _fields().get("model name", "")


def cpu_flags() -> frozenset[str]:
    """Feature flags (x86 Linux; empty elsewhere)."""
    return frozenset(_fields().get("flags", "").split())
