"""The engine: implements the Service protocol in process.

    run(call) ─ task.plan ─ admit (tokens, items) ─ cache.acquire ─ tokenize (pool) ─▶ device worker
                                                                                   (scheduler + lanes)
    every phase runs against the call's deadline; a caller that goes away cancels its call

Admission (engine/admission.py) counts the items, tokens and device seconds of everything admitted
and not yet answered; what would not finish within `max_queue_s` behind that backlog is answered
503 at once, with a Retry-After computed from the backlog at the measured rates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn, cast

import msgspec

from ..calls import (
    AnyCall,
    AnyResult,
    EncodeCall,
    EncodeResult,
    ExtractCall,
    ExtractResult,
    GenerateCall,
    Generated,
    GenerateResult,
    ScoreCall,
    ScoreResult,
    stream_updates,
    timeout_of,
)
from ..catalog import Catalog, ModelCard, needs_download
from ..config import EngineSettings
from ..cpuinfo import usable_cores
from ..errors import ConfigError, DeadlineExceeded, Forbidden, InvalidRequest, Overloaded
from ..metrics import Metrics
from ..service import Capacity, CardProblem, ModelStatus, Token
from ..verbs import VERB_OF_CALL, text_tokens
from . import memory
from .admission import Admission
from .backend import Backend
from .cache import ModelCache
from .device import DeviceWorker, Pending
from .fleet import Fleet
from .hardware import hardware_class
from .precision import card_for_device, precision_of
from .scheduler import BatchLimits
from .tasks import task_for
from .tasks.encode import prompt_of
from .tokenizer_pool import TokenizerPool
from .types import GenerateSpec, PhaseSeconds

log = logging.getLogger("shoal.engine")


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        catalog: Catalog,
        *,
        metrics: Metrics | None = None,
        allow_download: bool = True,
        backend: Backend | None = None,
        models_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.settings = settings
        self.allow_download = allow_download  # a given backend is built with its own; it says the same
        self.metrics = metrics or Metrics()
        self.metrics.start_models(card.id for card in catalog)
        self._hardware = hardware_class(settings.device)
        lanes = device_lanes(settings)
        fetch: Callable[[ModelCard], object] | None = None  # the torch backend's Hub downloads
        if backend is None:
            from .runner import TorchBackend  # torch is imported here, not at `import shoal`

            def max_batch_tokens(card: ModelCard) -> int:
                return card.batching_for(self._hardware).max_batch_tokens or settings.max_batch_tokens

            backend = TorchBackend(
                settings.device,
                allow_download=allow_download,
                max_batch_tokens_of=max_batch_tokens,
                pack=settings.onednn_linear,
                image_limits=(settings.max_image_bytes, settings.max_image_pixels),
                reduced_precision=settings.reduced_precision,
                cuda_graphs=settings.cuda_graphs,
            )
            if allow_download:  # a download happens outside the lock that materializes weights
                from ..catalog import resolve_weights

                fetch = lambda card: resolve_weights(card, allow_download=True)  # noqa: E731
        self.backend = backend
        budget = settings.memory_budget_bytes
        if budget is None:
            budget = memory.default_budget_bytes(settings.device)
        self.metrics.memory_budget_bytes.labels(settings.device).set(budget or 0)
        cache = ModelCache(
            backend.load,
            backend.estimate_bytes,
            fetch=fetch,
            memory_budget_bytes=budget,
            pinned=frozenset(settings.pinned_models),
            load_timeout_s=settings.load_timeout_s,
            load_backoff_s=settings.load_backoff_s,
            metrics=self.metrics,
            device=settings.device,
            side_by_side=lanes,
        )
        self.fleet = Fleet(
            catalog,
            cache,
            device=settings.device,
            models_dirs=models_dirs,
            watch_interval_s=settings.watch_interval_s,
            allow_download=allow_download,
        )
        self._tokenizers = TokenizerPool(settings.tokenizer_threads)
        self._device = DeviceWorker(
            self._limits_for,
            self.metrics,
            restart_delay_s=settings.device_restart_delay_s,
            small_request_tokens=4 * settings.min_batch_tokens,
            min_rate_tokens=settings.min_batch_tokens // 2,
            lanes=lanes,
        )
        self._admission = Admission(
            settings.max_queue_items, settings.max_queue_tokens, settings.max_queue_s, self._rate_of
        )
        self._started = False
        self._stopping = False

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        memory.tune_allocator()  # before the engine's threads exist (see engine/memory.py)
        self._device.start()
        self.fleet.start()
        self._started = True

    @property
    def catalog(self) -> Catalog:
        return self.fleet.catalog

    @property
    def cache(self) -> ModelCache:
        return self.fleet.cache

    async def warm(self, model_ids: list[str]) -> None:
        """Load models now rather than on first request: `model_ids`, then the cards that ask for it."""
        await self.fleet.warm(model_ids)

    async def stop(self) -> None:
        """Refuse new calls, finish the admitted ones, then free the models (never under a batch)."""
        self._stopping = True
        await self.fleet.stop()
        await self._drain_generations(self.settings.stop_timeout_s)
        finished = await self._device.stop(self.settings.stop_timeout_s)
        self._tokenizers.close()
        if finished:
            self.cache.close()

    async def _drain_generations(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the generating models' admitted calls to end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loops = [getattr(self.cache.runner(s.id), "generation", None) for s in self.fleet.statuses()]
            if all(loop is None or loop.idle for loop in loops):
                return
            await asyncio.sleep(0.05)

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping and self._device.ready

    @property
    def device_lanes(self) -> int:
        """Batches the device runs side by side."""
        return self._device.lanes

    # --- Service --------------------------------------------------------------------------------

    def models(self) -> list[ModelStatus]:
        return [self._with_precision(status) for status in self.fleet.statuses()]

    def model(self, model_id: str) -> ModelStatus:
        return self._with_precision(self.fleet.status(self.catalog.get(model_id)))

    def problems(self) -> list[CardProblem]:
        return self.fleet.problems()

    async def admin(self, model_id: str, action: str) -> ModelStatus:
        return self._with_precision(await self.fleet.admin(model_id, action))

    def _with_precision(self, status: ModelStatus) -> ModelStatus:
        """The status with the precision the model runs in: the loaded model's, else what a load
        here would choose (engine/precision.py)."""
        runner = self.fleet.cache.runner(status.id)
        if runner is not None:
            precision = runner.info.precision
        else:
            card = self.catalog.get(status.id)
            precision = precision_of(
                card_for_device(card, self.settings.device, reduced=self.settings.reduced_precision)
            )
        return msgspec.structs.replace(status, precision=precision)

    async def tokenize(
        self,
        model_id: str,
        texts: list[str],
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
        *,
        may_download: bool = True,
    ) -> list[list[Token]]:
        """Admitted like any call (its tokens are bounded: each text is cut at the model's limit
        before it is tokenized, in the tokenizer pool)."""
        card = self.catalog.get(model_id)
        await self._check_download(card, may_download)
        prefix = prompt_of(card, prompt_name, None)
        timeout_s = self.settings.request_timeout_s
        deadline = time.monotonic() + timeout_s
        tokens = sum(text_tokens(t, card.max_length, card, len(prefix)) for t in texts)
        self._admit(card.id, len(texts), tokens, timeout_s)
        try:
            model, _ = await _within(self.fleet.acquire(card, None), deadline, "load")
            try:
                tokenizer = model.info.text
                cut = await _within(
                    self._tokenizers.map(
                        lambda chunk, _: tokenizer.tokens([prefix + t for t in chunk], add_special_tokens), texts
                    ),
                    deadline,
                    "tokenize",
                )
            finally:
                self.fleet.release(card.id, None)
        finally:
            self._admission.remove(card.id, len(texts), tokens)
            self._record_queue()
        return [[Token(*token) for token in tokens] for tokens in cut]

    async def detokenize(
        self,
        model_id: str,
        ids: list[list[int]],
        skip_special_tokens: bool = True,
        *,
        may_download: bool = True,
    ) -> list[str]:
        """Admitted like `tokenize`, a token per id; decoded in the tokenizer pool."""
        card = self.catalog.get(model_id)
        await self._check_download(card, may_download)
        timeout_s = self.settings.request_timeout_s
        deadline = time.monotonic() + timeout_s
        tokens = sum(map(len, ids))
        self._admit(card.id, len(ids), tokens, timeout_s)
        try:
            model, _ = await _within(self.fleet.acquire(card, None), deadline, "load")
            try:
                tokenizer = model.info.text
                return await _within(
                    self._tokenizers.map(lambda chunk, first: tokenizer.decode(chunk, skip_special_tokens, first), ids),
                    deadline,
                    "tokenize",
                )
            finally:
                self.fleet.release(card.id, None)
        finally:
            self._admission.remove(card.id, len(ids), tokens)
            self._record_queue()

    def has_model(self, model_id: str) -> bool:
        return model_id in self.catalog

    def capacity(self) -> Capacity:
        return Capacity(self._admission.tokens, self.settings.max_queue_tokens, self._device.tokens_per_s)

    async def encode(self, call: EncodeCall) -> EncodeResult:
        """`run` for an encode call (typed for in-process callers)."""
        result = await self.run(call)
        assert isinstance(result, EncodeResult)
        return result

    async def score(self, call: ScoreCall) -> ScoreResult:
        """`run` for a score call (typed for in-process callers)."""
        result = await self.run(call)
        assert isinstance(result, ScoreResult)
        return result

    async def extract(self, call: ExtractCall) -> ExtractResult:
        """`run` for an extract call (typed for in-process callers)."""
        result = await self.run(call)
        assert isinstance(result, ExtractResult)
        return result

    async def run(self, call: AnyCall) -> AnyResult:
        return await self._run(call, None)

    def stream(self, call: GenerateCall) -> AsyncIterator[Generated | GenerateResult]:
        """A generation as it comes: a `Generated` after each step that gave it tokens (its whole
        text so far), then the call's GenerateResult. Leaving the iteration early (the client went
        away) cancels the generation and frees its KV cache slot."""
        return stream_updates(lambda on_update: self._run(call, on_update))

    async def _run(self, call: AnyCall, on_update: Callable[[Generated], None] | None) -> AnyResult:
        if type(call) not in VERB_OF_CALL:
            raise InvalidRequest(f"this server does not serve {type(call).__name__} calls")
        timeout_s = timeout_of(call, self.settings.request_timeout_s)
        deadline = time.monotonic() + timeout_s
        card = self.catalog.get(call.model)
        await self._check_download(card, call.may_download)
        task = task_for(call, card)
        plan = task.plan(card, call)
        tokens = plan.estimated_tokens
        timed = self._admission.seconds(card.id, tokens) is not None  # else time is checked once tokenized
        self._admit(card.id, plan.num_items, tokens, timeout_s)
        try:
            runner, adapter_slot = await _within(self.fleet.acquire(card, call.adapter), deadline, "load")
            handed_over = False  # once submitted, the device releases the model when done with it
            try:
                started = time.perf_counter()
                seqs = await _within(task.tokenize(plan, runner.info, self._tokenizers), deadline, "tokenize")
                tokenize_s = time.perf_counter() - started
                _check_sequences(seqs)
                task.check_size(plan, seqs, self.settings.max_result_bytes)
                real = sum(len(s) for s in seqs)  # the backlog now counts real tokens
                if real > self.settings.max_queue_tokens:  # the estimate was short (windows, odd text)
                    raise InvalidRequest(
                        f"{real} tokens in one request is more than the queue holds "
                        f"({self.settings.max_queue_tokens}); split the request",
                        details={"tokens": real, "max_queue_tokens": self.settings.max_queue_tokens},
                    )
                try:
                    self._admission.recount(card.id, tokens, real, timeout_s, timed=timed)
                except Overloaded as exc:
                    self._refuse(card.id, exc)
                tokens = real
                if getattr(task, "generates", False):
                    specs = cast(list[GenerateSpec], task.specs(plan, seqs))
                    generated_tokens = sum(spec.max_new_tokens for spec in specs)
                    try:  # its new tokens count in the backlog too
                        self._admission.recount(card.id, tokens, tokens + generated_tokens, timeout_s, timed=True)
                    except Overloaded as exc:
                        self._refuse(card.id, exc)
                    tokens += generated_tokens
                    started = time.perf_counter()
                    outputs = await self._generate(card.id, runner, seqs, specs, deadline, on_update)
                    timings = PhaseSeconds(
                        tokenize_s=tokenize_s, queue_s=0.0, inference_s=time.perf_counter() - started
                    )
                    first_token_s = self._count_generated(card.id, outputs, deadline - timeout_s, timings)
                    result = task.collect(plan, seqs, outputs, timings)
                    if isinstance(result, GenerateResult) and first_token_s[0] is not None:
                        result = msgspec.structs.replace(result, first_token_s=first_token_s[0])
                    return msgspec.structs.replace(result, precision=runner.info.precision)
                pending = Pending(
                    card.id,
                    runner,
                    seqs,
                    task.specs(plan, seqs),
                    deadline=deadline,
                    request_id=call.request_id,
                    future=asyncio.get_running_loop().create_future(),
                    on_released=lambda: self.fleet.release(card.id, call.adapter),
                    adapter_slot=adapter_slot,
                )
                self._device.submit(pending)
                handed_over = True
                outputs = await self._outcome(pending, deadline)
            finally:
                if not handed_over:
                    self.fleet.release(card.id, call.adapter)
        except DeadlineExceeded as exc:
            exc.details.setdefault("request_id", call.request_id)
            self.metrics.deadline_exceeded.labels(card.id, exc.details.get("phase", "-")).inc()
            raise
        finally:
            self._admission.remove(card.id, plan.num_items, tokens)
            self._record_queue()
        timings = PhaseSeconds(tokenize_s=tokenize_s, queue_s=pending.queue_s, inference_s=pending.inference_s)
        m = self.metrics
        for phase, seconds in (
            ("tokenize", tokenize_s),
            ("queue", pending.queue_s),
            ("inference", pending.inference_s),
        ):
            m.phase_seconds.labels(phase, card.id).observe(seconds)
        if task.collect_off_loop(plan, outputs):
            # A heavy decoding (thousands of span candidates) runs beside the event loop, not on it.
            result = await asyncio.to_thread(task.collect, plan, seqs, outputs, timings)
        else:
            result = task.collect(plan, seqs, outputs, timings)
        return msgspec.structs.replace(result, precision=runner.info.precision)

    def _count_generated(
        self, model_id: str, outputs: list[Generated], started: float, timings: PhaseSeconds
    ) -> list[float | None]:
        """A generation call's metrics (its time, new tokens, and each sequence's first token since
        the call `started`, a time.monotonic()); returns those first-token seconds."""
        m = self.metrics
        m.phase_seconds.labels("inference", model_id).observe(timings["inference_s"])
        m.generated_tokens.labels(model_id).inc(sum(len(o.token_ids) for o in outputs))
        firsts = [None if o.first_token_at is None else o.first_token_at - started for o in outputs]
        for seconds in firsts:
            if seconds is not None:
                m.first_token_seconds.labels(model_id).observe(seconds)
        return firsts

    async def _generate(
        self,
        model_id: str,
        runner: Any,
        seqs: list,
        specs: list[GenerateSpec],
        deadline: float,
        on_update: Callable[[Generated], None] | None,
    ) -> list[Generated]:
        """Each sequence generated on the model's loop (engine/generation.py): constraints compiled
        off the event loop first (a bad one is a 400 before any slot is taken); a caller that goes
        away, or a deadline that passes, cancels them all."""
        generation = getattr(runner, "generation", None)
        if generation is None:
            raise InvalidRequest(f"model {model_id} does not generate", details={"model": model_id})
        grammars: dict[str, str | None] = {}
        for spec in specs:
            key = _constraint_key(spec)
            if key not in grammars:
                grammars[key] = (
                    None
                    if spec.constraint is None
                    else await _within(asyncio.to_thread(runner.compile, spec.constraint), deadline, "tokenize")
                )
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Generated]] = [loop.create_future() for _ in seqs]

        def deliver(index: int, generated: Generated, error: BaseException | None) -> None:
            future = futures[index]
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            elif generated.finish_reason is not None:
                future.set_result(generated)
            elif on_update is not None:
                on_update(generated)

        entries = []
        try:
            for index, (seq, spec) in enumerate(zip(seqs, specs)):
                try:
                    entry = generation.submit(
                        [int(i) for i in seq.ids],
                        spec,
                        grammars[_constraint_key(spec)],
                        lambda g, e, i=index: loop.call_soon_threadsafe(deliver, i, g, e),
                        deadline=deadline,
                        max_wait_s=min(self.settings.max_queue_s or math.inf, deadline - time.monotonic()),
                        streams=on_update is not None,
                    )
                except Overloaded as exc:  # its wait for a KV cache slot would be too long
                    self._refuse(model_id, exc)
                entries.append(entry)
            outputs = await _within(asyncio.gather(*futures), deadline + _RUNNING_GRACE_S, "generate")
        finally:
            for entry in entries:
                if not entry.done:
                    generation.cancel(entry)
            for future in futures:
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # retrieved: a sibling's failure is the one raised
        if any(out.finish_reason == "deadline" for out in outputs):
            raise DeadlineExceeded(
                "the request's deadline passed while generating (phase: generate); retry with a longer "
                "timeout_s or fewer max_new_tokens",
                details={"phase": "generate"},
            )
        return outputs

    async def _outcome(self, pending: Pending, deadline: float) -> list:
        """The request's outputs. A caller that goes away cancels it (the device drops what has not
        run); past its deadline plus a grace for the batch it may be in, it is given up on."""
        try:
            return await _within(pending.future, deadline + _RUNNING_GRACE_S, "queue")
        except DeadlineExceeded as exc:
            if pending.future.cancelled():  # our own give-up (the device never answered), not its drop
                exc.details["phase"] = "inference" if pending.next_index else "queue"
            raise
        finally:
            if not pending.future.done() or pending.future.cancelled():
                pending.future.cancel()
                self._device.wake()

    # --- admission ------------------------------------------------------------------------------

    async def _check_download(self, card: ModelCard, may_download: bool) -> None:
        """Forbidden if serving `card` would start a download and the caller may not start one:
        checked before its load, so a refusal neither reaches the network nor counts as a failed
        load. A model loaded or loading starts none."""
        if may_download or not self.allow_download or self.cache.is_loaded(card.id) or self.cache.is_loading(card.id):
            return
        if await asyncio.to_thread(needs_download, card):
            raise Forbidden(
                f"model {card.id!r} is not on this server (its weights would be downloaded from the Hugging "
                "Face Hub) and downloads are not granted to this token: use a token with the `download` scope, "
                "or have an operator preload or load it",
                details={"model": card.id},
            )

    def _admit(self, model_id: str, num_items: int, num_tokens: int, timeout_s: float) -> None:
        if self._stopping:
            raise Overloaded("the server is shutting down; retry on another replica", retry_after_s=1.0)
        try:
            self._admission.admit(model_id, num_items, num_tokens, timeout_s)
        except Overloaded as exc:
            self._refuse(model_id, exc)
        self._record_queue()

    def _refuse(self, model_id: str, exc: Overloaded) -> NoReturn:
        self.metrics.rejected.labels(model_id).inc()
        raise exc

    def _rate_of(self, model_id: str) -> float | None:
        """The device's tokens/s for a model: its batches' rate times the lanes busy beside them;
        before one is measured, the device's over every model. None for a generating model: its
        steps run on its own loop, not the device's lanes, and its calls' wait for a KV cache slot
        is bounded there (engine/generation.py)."""
        card = self.catalog.find(model_id)
        if card is not None and card.generate is not None:
            return None
        return self._device.device_tokens_per_s_of(model_id) or self._device.tokens_per_s

    def _limits_for(self, model_id: str) -> BatchLimits:
        """The card's (or the settings') limits. While small and large requests share the device, the
        token budget is also cut to about `target_batch_s` of device time at the model's measured
        rate (until a rate is measured, 4 x `min_batch_tokens`); otherwise batches get the full budget.
        Called by the scheduler on a device lane, once per batch."""
        s = self.settings
        # The loaded model's card: the catalog may have changed (hot add) while its work is queued.
        loaded = self.cache.runner(model_id)
        card = loaded.info.card if loaded is not None else self.catalog.get(model_id)
        batching = card.batching_for(self._hardware)
        max_tokens = batching.max_batch_tokens or s.max_batch_tokens
        if s.target_batch_s and self._device.contended:
            rate = self._device.tokens_per_s_of(model_id)
            timed = int(rate * s.target_batch_s) if rate else 4 * s.min_batch_tokens
            max_tokens = min(max_tokens, max(s.min_batch_tokens, timed))
        return BatchLimits(
            max_tokens, batching.max_batch_items or s.max_batch_items, (batching.batch_wait_ms or 0.0) / 1000
        )

    def _record_queue(self) -> None:
        self.metrics.queue_depth.set(self._admission.items)
        self.metrics.queue_tokens.set(self._admission.tokens)


def device_lanes(settings: EngineSettings) -> int:
    """Batches the device runs side by side (engine/device.py): the settings' `device_lanes`, else
    two on a CPU with two or more cores to run on, two on a GPU (each lane its own CUDA stream: one
    lane's host work and copies overlap the other's forward, engine/streams.py), else one."""
    lanes = settings.device_lanes
    on_cpu = settings.device == "cpu"  # hardware_class refuses any other CPU spelling
    if lanes is None:
        return 1 if on_cpu and usable_cores() < 2 else 2
    if lanes < 1:
        raise ConfigError(f"device_lanes must be at least 1, not {lanes}", details={"field": "device_lanes"})
    return lanes


_PHASE_WORDS = {
    "load": "waiting for the model to load",
    "tokenize": "being tokenized",
    "queue": "waiting for the device",
    "generate": "generating",
}
# How long past its deadline a call still waits for a batch it may already be in.
_RUNNING_GRACE_S = 10.0


async def _within(awaitable: Any, deadline: float, phase: str) -> Any:
    """`awaitable`'s result, or DeadlineExceeded naming `phase` if the deadline passes first.

    A cancellation of the caller always propagates (asyncio.timeout never swallows one)."""
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(remaining):
                return await awaitable
        return await asyncio.wait_for(awaitable, remaining)
    except (TimeoutError, asyncio.TimeoutError):
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise DeadlineExceeded(
            f"the request's deadline passed while {_PHASE_WORDS[phase]} (phase: {phase}); "
            "retry later or with a longer timeout_s",
            details={"phase": phase},
        ) from None


def _constraint_key(spec: GenerateSpec) -> str:
    return "" if spec.constraint is None else json.dumps(spec.constraint, sort_keys=True, default=str)


def _check_sequences(seqs: list) -> None:
    for index, seq in enumerate(seqs):
        if len(seq) == 0:
            raise InvalidRequest(
                f"items[{index}] is empty after tokenization (this tokenizer adds no special tokens): send some text",
                details={"index": index},
            )
