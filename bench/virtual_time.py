"""Virtual time for asyncio: a loop whose clock jumps to the next timer instead of sleeping.

    run_virtual(main())     asyncio.run on a VirtualLoop: `asyncio.sleep(1)`, `wait_for(..., 5)` and
                            a 1 s pull cost no wall time; the loop only ever runs what is ready
    virtual_clock(loop)     shoal's modules read that clock through `time.monotonic()` and
                            `time.time()` (deadlines, heartbeats' ages) while it is active

Nothing may do real I/O on such a loop: its selector never reports a ready file. A loop with no
ready callback and no timer has deadlocked, and one whose clock stops moving while tasks keep
waking each other has livelocked: both say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import sys
import time
from collections.abc import Iterator
from typing import Any

# A livelock: tasks that wake each other for ever at one instant (the clock never moves).
MAX_TURNS_AT_ONCE = 2_000_000
EPOCH = 1.8e9  # what the virtual clock's 0 is in unix seconds (headers carry deadlines as unix time)


class VirtualSelector(selectors.BaseSelector):
    """Never has a ready file: a select with a timeout moves the clock by it instead of waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.turns_at_now = 0  # loop turns since the clock last moved
        self.on_stall: Any = None  # called (and raises) once the clock has not moved for MAX_TURNS_AT_ONCE

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("virtual loop: nothing ready and no timer: every task waits on another (deadlock)")
        if timeout > 0:
            self.now += timeout
            self.turns_at_now = 0
        else:
            self.turns_at_now += 1
            if self.turns_at_now > MAX_TURNS_AT_ONCE and self.on_stall is not None:
                self.on_stall()
        return []

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return self._keys


class VirtualLoop(asyncio.SelectorEventLoop):
    """asyncio in virtual time (see VirtualSelector); `time()` starts at 0."""

    def __init__(self) -> None:
        self._virtual = VirtualSelector()
        super().__init__(selector=self._virtual)
        self._virtual.on_stall = self._stalled

    def _stalled(self) -> None:
        ready = []
        for handle in list(self._ready)[:12]:  # asyncio's own queue of callbacks
            task = getattr(getattr(handle, "_callback", None), "__self__", None)
            ready.append(f"{handle!r} {_awaiting(task.get_coro()) if isinstance(task, asyncio.Task) else ''}")
        raise RuntimeError(
            f"virtual loop: {MAX_TURNS_AT_ONCE:,} turns at t = {self.time():.6f} s without the clock moving "
            "(a livelock); ready now:\n  " + "\n  ".join(ready)
        )

    def time(self) -> float:
        return self._virtual.now

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        """A timer that, when it runs, has the clock at its time at least: asyncio runs timers due
        within its clock's resolution (1 ns) early, and a real clock then moves on by itself; this
        one would stay put, and code that waits "until `when`" would wait 1e-16 s for ever."""
        return super().call_at(when, self._at, when, callback, *args, context=context)

    def _at(self, when: float, callback: Any, *args: Any) -> None:
        if when > self._virtual.now:
            self._virtual.now = when
        callback(*args)


def run_virtual(coro: Any) -> Any:
    """`asyncio.run` on a VirtualLoop."""
    loop = VirtualLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


class _Clock:
    """The `time` module as shoal's modules see it in a simulation: its clocks read the loop's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def monotonic(self) -> float:
        return self._loop.time()

    def time(self) -> float:
        return EPOCH + self._loop.time()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def virtual_clock(loop: asyncio.AbstractEventLoop, prefix: str = "shoal.") -> Iterator[None]:
    """Every imported module under `prefix` that did `import time` reads the virtual clock."""
    patched = [
        m for name, m in list(sys.modules.items()) if name.startswith(prefix) and getattr(m, "time", None) is time
    ]
    shim = _Clock(loop)
    for module in patched:
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.time = time  # type: ignore[attr-defined]


def _awaiting(coro: Any) -> str:
    """Where a suspended coroutine waits: its chain of awaits, outermost first."""
    where = []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frame = coro.cr_frame
        where.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}:{frame.f_lineno}")
        coro = coro.cr_await
    return " > ".join(where)
