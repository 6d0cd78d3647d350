"""How a device lane moves a batch's host arrays onto its device and runs the batch there.

    lane thread ─▶ LaneStreams.current() ─▶ with lane.running(): lane.stage(array) … model … heads (.cpu())

- On a CPU nothing moves: `stage` wraps the array (`torch.from_numpy`, no copy) and `running` does
  nothing.
- On a CUDA device each lane thread has a stream of its own. A batch's arrays go to pinned host
  memory, then to the device asynchronously on that stream, and the lane's forward and heads run on
  the same stream after them. So a lane's copies wait only for its own earlier work.
- With two lanes (the default on CUDA, engine.device_lanes), one lane's host work runs while the
  other's forward keeps the device busy: packing the batch, pinning, the copies, and reading the
  outputs back (a head's `.cpu()` waits for its own stream only). The two lanes may hold different
  models' batches, and their kernels interleave on the device.
- Torch's pinned-memory allocator keeps a pinned buffer until the copy that reads it has run, so
  `stage` can drop its pinned tensor at once.

The CUDA calls go through `ops` (`CudaOps` by default). tests/test_streams.py hands in a
recording stand-in and drives the stream logic through real device lanes on a CPU; running it on a
GPU is bench/gpu_check.py's job.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch


class StreamOps(Protocol):
    """The device calls a lane's stream makes (`CudaOps` on a GPU)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """`stream` is the current one inside: kernels and copies are queued on it."""
        ...

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host` on `device`, the copy queued on the current stream without waiting for it."""
        ...


class CudaOps:
    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        # From pinned memory the copy is asynchronous; the pinned block is kept until it has run.
        return host.pin_memory().to(device, non_blocking=True)


class LaneStream:
    """One lane's stream on one device: `stage` arrays onto it, and run the batch inside `running()`."""

    def __init__(self, device: torch.device, stream: Any = None, ops: StreamOps | None = None) -> None:
        self.device = device
        self.stream = stream  # None: the host (a CPU device), where nothing is queued
        self._ops = ops

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device. On CUDA the copy is queued on this lane's stream from pinned memory:
        call it inside `running()`, so the work after it is queued behind it."""
        host = torch.from_numpy(array)
        if self.stream is None or self._ops is None:
            return host
        return self._ops.to_device(host, self.device)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The lane's stream is the current one inside: every kernel and copy of the batch is queued
        on it, in order."""
        if self.stream is None or self._ops is None:
            yield
            return
        with self._ops.use(self.stream):
            yield


_CUDA_OPS = CudaOps()
# Each thread's lane streams, by (device, ops): every model a lane runs shares its stream. torch
# hands streams out of a pool of 32 per device in turn, so one per model and lane would soon put
# two lanes on one stream.
_THREAD_LANES = threading.local()


class LaneStreams:
    """Each lane thread's `LaneStream` on one device, made on the thread's first batch and kept."""

    def __init__(self, device: torch.device, ops: StreamOps | None = None) -> None:
        self.device = device
        self._ops = ops if ops is not None else (_CUDA_OPS if device.type == "cuda" else None)

    def current(self) -> LaneStream:
        """The calling thread's stream on the device (a new one on its first call)."""
        lanes = getattr(_THREAD_LANES, "lanes", None)
        if lanes is None:
            lanes = _THREAD_LANES.lanes = {}
        key = (str(self.device), self._ops)  # the ops object itself: an id could be reused
        lane = lanes.get(key)
        if lane is None:
            stream = None if self._ops is None else self._ops.new_stream(self.device)
            lane = lanes[key] = LaneStream(self.device, stream, self._ops)
        return lane
