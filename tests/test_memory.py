"""glibc's malloc under a serving process's allocation pattern: large buffers freed between small
live ones. Untuned, a freed 30 MB block raises the dynamic mmap threshold, later 4 MiB buffers come
from the heap and stay resident after they are freed; `tune_allocator` (a fixed 1 MiB threshold)
and `trim` both give them back. Each case runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.engine import memory

pytestmark = pytest.mark.skipif(memory._libc() is None or not sys.platform.startswith("linux"),
                                reason="glibc's malloc on Linux only")

SCRIPT = """
import sys, numpy as np
from shoal.engine import memory
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
if sys.argv[1] == "tuned":
    assert memory.tune_allocator()
big = np.ones(30_000_000 // 8); del big  # a large freed block: the dynamic threshold rises
base = rss()
blocks, keep = [], []
for _ in range(50):
    blocks.append(np.ones((4 << 20) // 8))  # 4 MiB "batch" buffers ...
    keep.append(np.ones(64))  # ... between small allocations that stay live
del blocks
if sys.argv[2] == "trim":
    memory.trim()
print((rss() - base) / 2**20)
"""


def retained_mib(tuned: bool, trim: bool) -> float:
    result = subprocess.run([sys.executable, "-c", SCRIPT, "tuned" if tuned else "untuned", "trim" if trim else "-"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return float(result.stdout.strip())


def test_untuned_glibc_keeps_freed_batch_buffers_resident():
    assert retained_mib(tuned=False, trim=False) > 10  # what the soak saw as steps of RSS


def test_tune_allocator_returns_freed_batch_buffers_to_the_os():
    assert retained_mib(tuned=True, trim=False) < 2


def test_trim_returns_them_too():
    assert retained_mib(tuned=False, trim=True) < 2
