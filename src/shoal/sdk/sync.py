"""`Client`: the blocking twin of `AsyncClient`, with the same methods and arguments.

There is one implementation: each call runs the async core's coroutine on a private event loop
that a background thread owns, and blocks until it is done (so it also works where the caller's
own thread already runs an event loop, as in a notebook). Interrupting the wait cancels the call.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from .client import AsyncClient

if TYPE_CHECKING:
    import httpx
    from typing_extensions import Self

R = TypeVar("R")
P = ParamSpec("P")


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Client, P], R]:
    """`AsyncClient`'s method as a blocking method of `Client`, with the same arguments."""

    @functools.wraps(method)
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(method(self._async, *args, **kwargs))

    return call


class Client:
    """A blocking client of one shoal server: `with Client(url) as client: client.encode(...)`.
    Arguments, results and errors are `AsyncClient`'s; one instance is safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        deadline_s: float | None = None,
        format: str = "msgpack",
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shoal-sdk-loop", daemon=True)
        self._thread.start()
        self._closed = False

        async def build() -> AsyncClient:  # on the loop that will use its connections
            return AsyncClient(
                base_url,
                api_key=api_key,
                timeout_s=timeout_s,
                max_retries=max_retries,
                deadline_s=deadline_s,
                format=format,
                transport=transport,
                headers=headers,
            )

        try:
            self._async = self._run(build())
        except BaseException:  # whatever stops the build (even an interrupt): stop the loop's thread, re-raise
            self._stop_loop()
            raise

    encode = _blocking(AsyncClient.encode)
    score = _blocking(AsyncClient.score)
    extract = _blocking(AsyncClient.extract)
    models = _blocking(AsyncClient.models)
    model = _blocking(AsyncClient.model)

    def close(self) -> None:
        """Close the connections and stop the loop's thread; later calls raise RuntimeError."""
        if self._closed:
            return
        try:
            self._run(self._async.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, R]) -> R:
        if self._closed:
            coroutine.close()
            raise RuntimeError("this shoal Client is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:  # any end of the wait, an interrupt (KeyboardInterrupt) too; re-raised
            future.cancel()  # an interrupted wait must not leave the call running
            raise
