"""glibc's malloc under a serving process's allocation pattern: large buffers freed between small
live ones. Untuned, a freed 30 MB block raises the dynamic mmap threshold, and later buffers up to
that size come from the heap and stay resident after they are freed. `tune_allocator` fixes the
threshold at 64 MiB: larger buffers are always mmapped (and unmapped when freed); smaller ones come
from the heap, where the next batches reuse them without page faults, and `trim` (which the device
runs when idle, or once RSS has grown 64 MiB since its last trim) gives them back. Each case runs
in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.engine import memory

pytestmark = pytest.mark.skipif(
    memory._libc() is None or not sys.platform.startswith("linux"), reason="glibc's malloc on Linux only"
)

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
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, "tuned" if tuned else "untuned", "trim" if trim else "-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return float(result.stdout.strip())


def test_untuned_glibc_keeps_freed_batch_buffers_resident():
    assert retained_mib(tuned=False, trim=False) > 10  # what the soak saw as steps of RSS


MMAPPED = """
import sys, ctypes, ctypes.util, numpy as np
from shoal.engine import memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert memory.tune_allocator()
if sys.argv[2] == "after-free":
    big = np.ones(120_000_000 // 8); del big  # a large freed block: an untuned threshold would rise
counts = []
for mib in (20, 80):
    before = libc.mallinfo2().hblks  # mmapped blocks in use
    x = np.ones((mib << 20) // 8)
    counts.append(libc.mallinfo2().hblks - before)
    del x
print(*counts)
"""


def mmapped(tuned: bool, after_free: bool = False) -> list[int]:
    """Whether a 20 MiB and an 80 MiB buffer were mmapped (after a 120 MB block was freed)."""
    result = subprocess.run(
        [sys.executable, "-c", MMAPPED, "tuned" if tuned else "untuned", "after-free" if after_free else "-"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0 and "mallinfo2" in result.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert result.returncode == 0, result.stderr
    return [int(x) for x in result.stdout.split()]


def test_tune_allocator_fixes_the_mmap_threshold_so_large_buffers_go_back_when_freed():
    assert memory.MMAP_THRESHOLD_BYTES == 64 << 20
    assert mmapped(tuned=False) == [1, 1]  # glibc's starting threshold (128 KiB): every batch buffer a fresh mmap
    assert mmapped(tuned=True) == [0, 1]  # 20 MiB from the heap (reused by the next batch), 80 MiB mmapped
    assert mmapped(tuned=True, after_free=True) == [0, 1]  # and the threshold does not creep up


def test_tuned_and_trimmed_gives_freed_heap_buffers_back():
    assert retained_mib(tuned=True, trim=True) < 2


def test_rss_bytes_is_the_kernels_resident_set():
    with open("/proc/self/status") as f:
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(memory.rss_bytes() - vm_rss) < 8 << 20


def test_trim_returns_them_too():
    assert retained_mib(tuned=False, trim=True) < 2


PRIMITIVES = """
import sys, torch
from shoal.engine import memory
from shoal.layers.packed import PackedLinear, available
if not available():
    print("skip"); sys.exit()
if sys.argv[1] == "tuned":
    memory.tune_allocator()
linear = PackedLinear.of(torch.nn.Linear(384, 1536))
x = torch.randn(1200, 384)
with torch.inference_mode():
    linear(x[:7])
    memory.trim()
    base = memory.rss_bytes()
    for num_tokens in range(1, 1201, 3):  # 400 batch sizes: 400 oneDNN primitives
        linear(x[:num_tokens])
memory.trim()
print((memory.rss_bytes() - base) / 2**20)
"""


def primitives_mib(tuned: bool) -> float:
    result = subprocess.run(
        [sys.executable, "-c", PRIMITIVES, "tuned" if tuned else "untuned"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in memory.PRIMITIVE_CACHE_VARIABLES},
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "skip":
        pytest.skip("this torch has no oneDNN inner product")
    return float(result.stdout.strip())


def test_capped_primitive_caches_keep_a_packed_linear_of_many_batch_sizes_from_growing_rss():
    assert memory.PRIMITIVE_CACHE_CAPACITY == 128
    untuned, tuned = primitives_mib(tuned=False), primitives_mib(tuned=True)
    # oneDNN's default keeps all 400 primitives (~0.5 MB each on an AVX-512 CPU), the cap 128 of them.
    assert untuned > 64 and tuned < untuned / 2, (untuned, tuned)


def test_a_primitive_cache_size_the_environment_sets_wins_under_either_name(monkeypatch):
    for name in memory.PRIMITIVE_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "7")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "9")
    memory.tune_allocator()
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ and os.environ["LRU_CACHE_CAPACITY"] == "9"
    monkeypatch.delenv("DNNL_PRIMITIVE_CACHE_CAPACITY")
    memory.tune_allocator()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(memory.PRIMITIVE_CACHE_CAPACITY)
