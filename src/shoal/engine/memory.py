"""Keeping a long-running process's resident memory flat (glibc's malloc, on Linux).

A serving process allocates and frees tensors of a new shape for every batch, from several
threads (the device thread, the tokenizer pool, torch's intra-op pool). With glibc's defaults
three things let RSS creep up and stay up:

- its mmap threshold is dynamic: once a large block (say a 20 MB attention buffer) is freed, blocks
  up to that size come from the heap from then on instead of fresh mmaps, and a heap does not give
  pages back while anything above them is live;
- each thread may get its own arena (up to 8 per core), each holding its own freed memory;
- freed memory in the middle of a heap stays resident until `malloc_trim`.

And one thing outside malloc: oneDNN keeps every primitive it builds in two caches (ideep's, torch's
`LRU_CACHE_CAPACITY`, and oneDNN's own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1,024 entries each by
default, one per op and shape. A packed Linear's or a matmul's shape has the batch's token count in
it, new almost every batch, so a server's caches fill over its first thousand distinct batches with
about half a megabyte a primitive and RSS grows by hundreds of MiB (bench/soak.py shows it).
`tune_allocator` caps both at PRIMITIVE_CACHE_CAPACITY (unless the environment already sets them),
before the first primitive is built: RSS stays flat at the same speed, and small batches, where a
miss costs most, gain nothing from the larger caches either (docs/benchmarks.md, memory).

`tune_allocator` fixes the mmap threshold at 64 MiB (buffers above it always go back to the OS when
freed, and the threshold cannot creep up), caps the arenas and is called once when the engine
starts, before its threads exist. Buffers below it come from the heap and are reused batch after
batch, with no page faults: a CPU batch's activations (MiniLM's 4,096-token q/k/v projection is
19 MB, BERT-base's 38 MB; the feed-forward's wide intermediate runs in 3 MiB row blocks,
layers/rows.py) stay under it. A lower threshold makes those activations fresh mmaps, whose page
faults cost a large share of a CPU forward (docs/benchmarks.md, memory).
`trim` returns freed heap pages to the OS; a device lane calls it when the device goes idle, and after
a batch once RSS has grown RETAINED_HEAP_BYTES past what it was after the last trim, so a busy
server's heap stays bounded too. All are no-ops where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger("shoal.memory")

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 64 << 20  # blocks from 64 MiB up are mmapped, and unmapped when freed
# RSS growth since the last trim the device allows before it trims, even while busy.
RETAINED_HEAP_BYTES = 64 << 20
# Free heap at the top past this goes back to the OS on free: no lower than the mmap threshold, or
# the heap's 16-64 MiB buffers (q/k/v projections) would be given back and fault in again batch
# after batch.
TRIM_THRESHOLD_BYTES = MMAP_THRESHOLD_BYTES
ARENA_MAX = 4
PRIMITIVE_CACHE_CAPACITY = 128  # oneDNN primitives kept per cache (see the module)
# Each cache's variable, with the older names that set the same cache (oneDNN still reads DNNL_*).
_PRIMITIVE_CACHES = {"LRU_CACHE_CAPACITY": (), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": ("DNNL_PRIMITIVE_CACHE_CAPACITY",)}
PRIMITIVE_CACHE_VARIABLES = tuple(n for name, older in _PRIMITIVE_CACHES.items() for n in (name, *older))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018  (glibc only)
        libc.malloc_trim  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> bool:
    """Set glibc's malloc for a long-running server and cap oneDNN's primitive caches (read when
    the first primitive is built: call before any model loads); False where malloc's part does
    not apply."""
    for name, older in _PRIMITIVE_CACHES.items():  # a value the environment sets, under any name, wins
        if not any(n in os.environ for n in (name, *older)):
            os.environ[name] = str(PRIMITIVE_CACHE_CAPACITY)
    libc = _libc()
    if libc is None:
        return False
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not ok:
        log.warning("mallopt refused a setting; resident memory may grow under load")
    return ok


def rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc; else None). A few microseconds."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim() -> bool:
    """Return freed heap memory to the OS; True if some was."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# The share of the memory free at start that the default budget takes: the rest is for the
# process itself (Python, tokenizers, request and response buffers) and whatever else runs there.
DEFAULT_BUDGET_FRACTION = 0.8


def default_budget_bytes(device: str) -> int | None:
    """The default memory budget: a share of the VRAM free on a CUDA device, else of the RAM this
    process may still take (MemAvailable, lowered to a cgroup's remaining limit in a container).
    None where neither can be read."""
    if device.startswith("cuda"):
        import torch

        free_vram, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free_vram * DEFAULT_BUDGET_FRACTION)
    free = _mem_available_bytes()
    limit = _cgroup_free_bytes()
    if limit is not None:
        free = limit if free is None else min(free, limit)
    return None if free is None else int(free * DEFAULT_BUDGET_FRACTION)


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free_bytes() -> int | None:
    """A cgroup v2 memory limit less what the cgroup already uses; None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError):
        return None
