"""glibc's malloc under a serving process's allocation pattern: large buffers freed between small
live ones. Untuned, a freed 30 MB block raises the dynamic mmap threshold, and later buffers up to
that size come from the heap and stay resident after they are freed. `tune_allocator` fixes the
threshold at 16 MiB: larger buffers are always mmapped (and unmapped when freed); smaller ones come
from the heap, where the next batches reuse them without page faults, and `trim` (which the device
runs when idle, or once RSS has grown 64 MiB since its last trim) gives them back. Each case runs
in a fresh interpreter."""

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
big = np.ones(30_000_000 // 8); del big  # a large freed block: the dynamic threshold rises
counts = []
for mib in (4, 20):
    before = libc.mallinfo2().hblks  # mmapped blocks in use
    x = np.ones((mib << 20) // 8)
    counts.append(libc.mallinfo2().hblks - before)
    del x
print(*counts)
"""


def mmapped(tuned: bool) -> list[int]:
    """Whether a 4 MiB and a 20 MiB buffer, allocated after a large free, were mmapped."""
    result = subprocess.run([sys.executable, "-c", MMAPPED, "tuned" if tuned else "untuned"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "mallinfo2" in result.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert result.returncode == 0, result.stderr
    return [int(x) for x in result.stdout.split()]


def test_tune_allocator_fixes_the_mmap_threshold_so_large_buffers_go_back_when_freed():
    assert memory.MMAP_THRESHOLD_BYTES == 16 << 20
    assert mmapped(tuned=False) == [0, 0]  # both from the heap once the threshold has risen
    assert mmapped(tuned=True) == [0, 1]  # 4 MiB from the heap (reused by the next batch), 20 MiB mmapped


def test_tuned_and_trimmed_gives_freed_heap_buffers_back():
    assert retained_mib(tuned=True, trim=True) < 2


def test_rss_bytes_is_the_kernels_resident_set():
    with open("/proc/self/status") as f:
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(memory.rss_bytes() - vm_rss) < 8 << 20


def test_trim_returns_them_too():
    assert retained_mib(tuned=False, trim=True) < 2
