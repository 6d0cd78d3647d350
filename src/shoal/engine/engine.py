"""The engine: async submit and admission on the event loop, one device thread that runs batches.

    encode(call) ─ admit (bounded) ─ cache.acquire ─ tokenize (pool) ─▶ scheduler ─▶ device loop
                                                                          ▲              │
                                          futures resolved on the loop ◀─┴──────────────┘

The device loop is the only code that touches the device. It sleeps on a condition variable until
work arrives; there is no polling.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

from ..catalog import Catalog, ModelCard
from ..config import EngineSettings
from ..errors import ConfigError, InvalidRequest, Overloaded, ShoalError
from ..metrics import Metrics
from .cache import ModelCache
from .scheduler import BatchLimits, Scheduler
from .tokenizer import TokenizerPool
from .types import Batch, EncodeCall, EncodeResult, EncodeSpec, ItemOutput, WorkItem


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        catalog: Catalog,
        *,
        metrics: Metrics | None = None,
        allow_download: bool = True,
        load_runner: Callable[[ModelCard], Any] | None = None,
        estimate_bytes: Callable[[ModelCard], int] | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.metrics = metrics or Metrics()
        if load_runner is None or estimate_bytes is None:
            from .runner import ModelRunner  # torch is imported here, not at `import shoal`

            load_runner = load_runner or (lambda card: ModelRunner.load(card, settings.device, allow_download))
            estimate_bytes = estimate_bytes or (lambda card: ModelRunner.estimate_bytes(card, allow_download))
        self.cache = ModelCache(
            load_runner, estimate_bytes,
            memory_budget_bytes=settings.memory_budget_bytes,
            pinned=frozenset(settings.pinned_models),
            load_timeout_s=settings.load_timeout_s,
        )
        self._tokenizers = TokenizerPool(settings.tokenizer_threads)
        self._scheduler = Scheduler(self._limits_for)
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admitted_items = 0
        self._hardware = hardware_class(settings.device)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._device_loop, name="shoal-device", daemon=True)
        self._thread.start()

    async def warm(self, model_ids: list[str]) -> None:
        """Load models now rather than on first request."""
        for model_id in model_ids:
            card = self.catalog.get(model_id)
            await self.cache.acquire(card)
            self.cache.release(card.id)
        self._record_cache()

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self._tokenizers.close()
        self.cache.close()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # --- submit ---------------------------------------------------------------------------------

    async def encode(self, call: EncodeCall) -> EncodeResult:
        if not call.texts:
            raise InvalidRequest("no texts to encode", details={"option": "texts"})
        card = self.catalog.get(call.model)
        spec = _spec(card, call)
        prefix = _prompt(card, call)
        texts = [prefix + t for t in call.texts] if prefix else call.texts
        self._admit(card.id, len(texts))
        try:
            was_loaded = self.cache.is_loaded(card.id)
            runner = await self.cache.acquire(card)
            if not was_loaded:  # a load (and maybe evictions) happened: refresh the cache gauges
                self._record_cache()
            try:
                started = time.perf_counter()
                tokenizer = runner.query_tokenizer if spec.is_query else runner.document_tokenizer
                token_ids = await self._tokenizers.encode(tokenizer, texts, call.truncate)
                tokenize_s = time.perf_counter() - started
                outputs = await self._submit(card.id, runner, token_ids, spec)
            finally:
                self.cache.release(card.id)
        finally:
            self._admitted_items -= len(texts)
            self.metrics.queue_depth.set(self._admitted_items)
        num_tokens = sum(len(t) for t in token_ids)
        queue_s = max(o.queue_s for o in outputs)
        inference_s = max(o.inference_s for o in outputs)
        m = self.metrics
        m.phase_seconds.labels("tokenize", card.id).observe(tokenize_s)
        m.phase_seconds.labels("queue", card.id).observe(queue_s)
        m.phase_seconds.labels("inference", card.id).observe(inference_s)
        return EncodeResult([o.result for o in outputs], num_tokens, tokenize_s, queue_s, inference_s)

    def _admit(self, model_id: str, num_items: int) -> None:
        limit = self.settings.max_queue_items
        if num_items > limit:  # could never be admitted: a retry would not help
            raise InvalidRequest(
                f"{num_items} items in one request is more than the queue holds ({limit}); split the request",
                details={"items": num_items, "max_queue_items": limit},
            )
        if self._admitted_items + num_items > limit:
            self.metrics.rejected.labels(model_id).inc()
            raise Overloaded(
                f"the queue is full ({self._admitted_items} items waiting, limit {limit}); retry shortly",
                retry_after_s=1.0,
            )
        self._admitted_items += num_items
        self.metrics.queue_depth.set(self._admitted_items)

    async def _submit(self, model_id: str, runner: Any, token_ids: list, spec: EncodeSpec) -> list[ItemOutput]:
        loop = asyncio.get_running_loop()
        items = [WorkItem(model_id, ids, spec, loop.create_future(), runner) for ids in token_ids]
        with self._wake:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", retry_after_s=1.0)
            self._scheduler.add(items)
            self._wake.notify()
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        except BaseException:
            for item in items:  # the scheduler drops what is cancelled before batching it
                item.future.cancel()
            raise

    def _limits_for(self, model_id: str) -> BatchLimits:
        batching = self.catalog.get(model_id).batching_for(self._hardware)
        return BatchLimits(
            batching.max_batch_tokens or self.settings.max_batch_tokens,
            batching.max_batch_items or self.settings.max_batch_items,
        )

    def _record_cache(self) -> None:
        self.metrics.loaded_models.set(self.cache.num_loaded)
        self.metrics.loaded_bytes.set(self.cache.loaded_bytes)

    # --- the device thread ----------------------------------------------------------------------

    def _device_loop(self) -> None:
        """Run batches until stopped; on stop, finish what was already queued (none is dropped)."""
        while True:
            with self._wake:
                batch = self._scheduler.next_batch()
                while not batch and not self._stopping:
                    self._wake.wait()
                    batch = self._scheduler.next_batch()
            if not batch:  # stopping, and the queue is drained
                return
            self._run(batch)

    def _run(self, items: list[WorkItem]) -> None:
        started = time.perf_counter()
        runner = items[0].runner
        try:
            results = runner.forward(Batch.pack([i.token_ids for i in items]), [i.spec for i in items])
        except Exception as exc:  # a failed batch fails its own requests only
            error = exc if isinstance(exc, ShoalError) else ShoalError(f"inference failed: {type(exc).__name__}: {exc}")
            self._loop.call_soon_threadsafe(_fail, items, error)
            return
        inference_s = time.perf_counter() - started
        model_id = items[0].model_id
        num_tokens = sum(i.num_tokens for i in items)
        m = self.metrics  # recorded before answering, so a caller's next scrape already counts it
        m.batch_tokens.labels(model_id).observe(num_tokens)
        m.batch_items.labels(model_id).observe(len(items))
        m.tokens.labels(model_id).inc(num_tokens)
        m.items.labels(model_id).inc(len(items))
        outputs = [ItemOutput(r, started - i.enqueued_at, inference_s) for r, i in zip(results, items)]
        self._loop.call_soon_threadsafe(_deliver, items, outputs)


def _deliver(items: list[WorkItem], outputs: list[ItemOutput]) -> None:
    for item, output in zip(items, outputs):
        if not item.future.done():
            item.future.set_result(output)


def _fail(items: list[WorkItem], error: Exception) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)


def _spec(card: ModelCard, call: EncodeCall) -> EncodeSpec:
    if call.dimensions is not None and call.dimensions > card.dimensions:
        raise InvalidRequest(
            f"model {card.id}: dimensions {call.dimensions} is larger than the model's {card.dimensions}",
            details={"model": card.id, "option": "dimensions", "max": card.dimensions},
        )
    outputs = tuple(dict.fromkeys(call.outputs)) if call.outputs else card.outputs[:1]
    unsupported = [o for o in outputs if o not in card.outputs]
    if unsupported:
        raise InvalidRequest(
            f"model {card.id} cannot produce {', '.join(unsupported)} output; its card allows: {', '.join(card.outputs)}",
            details={"model": card.id, "option": "outputs", "allowed": list(card.outputs)},
        )
    normalize = card.normalize if call.normalize is None else call.normalize
    return EncodeSpec(
        normalize=normalize, dimensions=call.dimensions, output_dtype=call.output_dtype, outputs=outputs,
        is_query=bool(call.is_query), sparse_top_k=call.sparse_top_k, return_tokens=call.return_tokens,
    )


def _prompt(card: ModelCard, call: EncodeCall) -> str:
    if call.prompt_name is not None and call.prompt_name not in card.prompts:
        allowed = ", ".join(sorted(card.prompts)) or "none"
        raise InvalidRequest(
            f"model {card.id} has no prompt {call.prompt_name!r}; its prompts: {allowed}",
            details={"model": card.id, "option": "prompt_name", "allowed": sorted(card.prompts)},
        )
    return card.prompt_for(call.prompt_name, call.is_query)


def hardware_class(device: str) -> str:
    """The key a card's `batching` is looked up by: "cpu", or "cuda:<device name>"."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but torch sees no CUDA device here; use --device cpu")
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    if device != "cpu":
        raise ConfigError(f"unsupported device {device!r}: use cpu, cuda or cuda:N")
    return "cpu"
