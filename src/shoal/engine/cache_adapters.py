"""The LoRA adapters resident beside their models, under the cache's one memory budget.

An adapter load holds its model (never evicts it), fails at once if the adapter cannot fit beside
it, and backs off after a failure as models do; a changed adapter drains before it reloads. The
methods are ModelCache's (engine/cache.py), which owns the state they read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError, Overloaded
from .backend import LoadedModel
from .load_failures import Failure, retry_later

if TYPE_CHECKING:
    import contextlib

    from .threads import ThreadPerJob

log = logging.getLogger("shoal.cache")


class AdapterResidency:
    # The cache's state these methods share (set by ModelCache.__init__).
    budget_bytes: int | None
    _load_timeout_s: float
    _loaded: OrderedDict[str, LoadedModel]
    _inflight: Counter[str]
    _executor: ThreadPerJob
    _adapters: OrderedDict[tuple[str, str], int]
    _adapter_inflight: Counter[tuple[str, str]]
    _adapter_loading: dict[tuple[str, str], asyncio.Task]
    _adapter_stale: set[tuple[str, str]]
    _adapter_failures: dict[tuple[str, str], Failure]

    if TYPE_CHECKING:  # ModelCache's

        async def _until(self, done: Callable[[], bool], timeout_s: float | None, message: str) -> None: ...

        def _room(
            self, subject: str, needed: int, workspace: int = 0, keep: str | None = None
        ) -> contextlib.AbstractAsyncContextManager[None]: ...

        def _evict_for(self, subject: str, needed: int, workspace: int = 0, keep: str | None = None) -> bool: ...

        def _record_failure(self, store: dict, key: str | tuple[str, str], what: str, exc: Exception) -> Failure: ...

        def _notify(self) -> None: ...

        def _record(self) -> None: ...

        def release(self, model_id: str) -> None: ...

    async def acquire_adapter(self, model_id: str, runner: LoadedModel, name: str, directory: Path) -> int:
        """The adapter's slot on `runner` (loading it if needed), counted in flight until
        `release_adapter`. The caller holds the model itself (`acquire`)."""
        key = (model_id, name)
        if key in self._adapter_stale and key in self._adapters:  # the old files' copy drains first
            await self._until(
                lambda: key not in self._adapter_stale,
                self._load_timeout_s,
                f"adapter {name} of {model_id} is reloading its changed files; retry shortly",
            )
        self._adapter_inflight[key] += 1
        try:
            if key in self._adapters and runner.adapter_slot(name) is None:  # recorded for a runner since gone
                del self._adapters[key]
            if key not in self._adapters:
                failure = self._adapter_failures.get(key)
                if failure is not None and time.monotonic() < failure.retry_at and key not in self._adapter_loading:
                    raise retry_later(failure)
                task = self._adapter_loading.get(key)
                if task is None:
                    task = self._adapter_loading[key] = asyncio.create_task(self._load_adapter(key, runner, directory))
                await asyncio.wait_for(asyncio.shield(task), self._load_timeout_s)
            self._adapters.move_to_end(key)
            slot = runner.adapter_slot(name)
            if slot is None:
                raise Overloaded(f"adapter {name} of {model_id} was unloaded while loading; retry", retry_after_s=1.0)
            return slot
        except asyncio.TimeoutError:
            self.release_adapter(model_id, name)
            raise Overloaded(
                f"adapter {name} of {model_id} is still loading; retry shortly",
                retry_after_s=2.0,
                details={"model": model_id, "adapter": name},
            ) from None
        except BaseException:
            self.release_adapter(model_id, name)
            raise

    def release_adapter(self, model_id: str, name: str) -> None:
        key = (model_id, name)
        self._adapter_inflight[key] -= 1
        if self._adapter_inflight[key] <= 0:
            del self._adapter_inflight[key]
            if key in self._adapter_stale and key not in self._adapter_loading:
                self._adapter_stale.discard(key)
                self._drop_adapter(key, "changed")
            self._notify()

    def invalidate_adapter(self, model_id: str, name: str) -> None:
        """The adapter's files changed: drop its resident copy once idle (the next request loads it)."""
        key = (model_id, name)
        self._adapter_failures.pop(key, None)
        if key in self._adapter_loading or (key in self._adapters and self._adapter_inflight[key] > 0):
            self._adapter_stale.add(key)
        elif key in self._adapters:
            self._drop_adapter(key, "changed")

    async def _load_adapter(self, key: tuple[str, str], runner: LoadedModel, directory: Path) -> None:
        loop = asyncio.get_running_loop()
        model_id, name = key
        what = f"adapter {name} of {model_id}"
        self._inflight[model_id] += 1  # the model stays while its adapter loads
        try:
            async with self._room(what, _adapter_file_bytes(directory), keep=model_id):
                if self._loaded.get(model_id) is not runner:
                    raise Overloaded(f"model {model_id} was unloaded while {what} waited; retry", retry_after_s=1.0)
                await loop.run_in_executor(self._executor, runner.add_adapter, name, directory)
                num_bytes = runner.adapter_bytes(name)  # measured: its stacked factors on the device
                try:
                    if self.budget_bytes is not None and not self._evict_for(what, num_bytes, keep=model_id):
                        raise Overloaded(
                            f"no room for {what}: the models in memory are busy; retry shortly", retry_after_s=2.0
                        )
                except BaseException:
                    runner.remove_adapter(name)
                    raise
                self._adapters[key] = num_bytes
            self._adapter_failures.pop(key, None)
            log.info("loaded %s (%d bytes)", what, num_bytes)
        except Overloaded:
            raise
        except Exception as exc:  # a broken adapter: a clear 502 and a back-off, never a 500
            if key in self._adapter_stale:  # its files changed meanwhile: the next try reads the new ones
                self._adapter_stale.discard(key)
                raise ModelLoadError(f"{what} changed while it loaded; retry", retry_after_s=1.0) from None
            raise retry_later(self._record_failure(self._adapter_failures, key, what, exc)) from None
        finally:
            del self._adapter_loading[key]
            if key in self._adapter_stale and self._adapter_inflight[key] == 0:  # changed, and nobody waits
                self._adapter_stale.discard(key)
                self._drop_adapter(key, "changed")
            self.release(model_id)
            self._record()

    def _drop_adapter(self, key: tuple[str, str], reason: str) -> None:
        if self._adapters.pop(key, None) is None:
            return
        runner = self._loaded.get(key[0])
        if runner is not None and runner.adapter_slot(key[1]) is not None:
            runner.remove_adapter(key[1])
        log.info("unloaded adapter %s of %s (%s)", key[1], key[0], reason)
        self._record()


def _adapter_file_bytes(directory: Path) -> int:
    """Before an adapter is read: the size of its weights file (its tensors, near enough)."""
    return sum(p.stat().st_size for p in Path(directory).glob("adapter_model.*") if p.is_file())
