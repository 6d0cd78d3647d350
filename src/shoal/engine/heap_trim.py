"""When a device gives freed heap memory back to the OS (`memory.trim`), judged after each batch.

Once the device goes idle it trims at most every TRIM_EVERY_S, and within that only if RSS grew
RETAINED_HEAP_BYTES since the last trim; while busy it reads RSS at most every BUSY_TRIM_EVERY_S and
trims only if RSS grew that much. Below that, and between looks, the next batches reuse the freed heap
without page faults: two lanes' working sets swing past RETAINED_HEAP_BYTES, so a trim per growth would
return memory the next batches fault straight back in.
"""

from __future__ import annotations

from . import memory

TRIM_EVERY_S = 2.0  # malloc_trim when the device goes idle, at most this often
BUSY_TRIM_EVERY_S = 10.0  # while busy: RSS is read, and the heap trimmed if it grew, at most this often


class HeapTrimmer:
    """The trim policy of one device; its lanes call `after_batch` one at a time (under the device's
    lock)."""

    def __init__(self) -> None:
        self._trimmed_at = 0.0
        self._busy_check_at = -BUSY_TRIM_EVERY_S  # the first batch's check trims once and sets both
        self._rss_after_trim = 0

    def after_batch(self, now: float, idle: bool) -> None:
        """A batch ended at `now` (`time.monotonic()`); `idle`: nothing is queued or running."""
        if idle and now - self._trimmed_at >= TRIM_EVERY_S:
            look = False
            self._trimmed_at = now
        elif idle or now - self._busy_check_at >= BUSY_TRIM_EVERY_S:
            look = True
            if not idle:
                self._busy_check_at = now
        else:
            return
        if look:
            rss = memory.rss_bytes()
            if rss is None or rss <= self._rss_after_trim + memory.RETAINED_HEAP_BYTES:
                return
            self._trimmed_at = now
        memory.trim()
        self._rss_after_trim = memory.rss_bytes() or 0
