"""The CPU's model name and feature flags, read once from /proc/cpuinfo (torch-free: the engine's
hardware classes and the int8 layer's kernel choice both read them)."""

from __future__ import annotations

import functools


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
