"""Many texts or images as several requests: chunks of `batch_size` (images also of at most
`IMAGE_BYTES_PER_REQUEST`), at most `concurrency` in flight, answers kept in the order sent.

Each chunk is its own request with its own retries (`http.Http.send`), so a chunk that meets a
`503` is sent again alone while the others' answers are kept. A chunk that still fails fails the
call: the chunks in flight are cancelled and the error is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_BATCH_SIZE = 256  # items per request when a call sends more and names no batch_size
# Image file bytes one request carries at most (one larger image goes alone): as base64 in JSON
# that is 5.3 MiB, under the server's default body limit (8 MiB, `--max-body-bytes`).
IMAGE_BYTES_PER_REQUEST = 4 * 2**20


def chunks_of(
    items: Sequence[T],
    batch_size: int | None,
    *,
    max_chunk_bytes: int | None = None,
    num_bytes: Callable[[T], int] | None = None,
) -> list[list[T]]:
    """`items` cut, in order, into lists of `batch_size` (default DEFAULT_BATCH_SIZE); with
    `num_bytes`, a list also ends before the item that would take it past `max_chunk_bytes`.
    An empty `items` is one empty chunk: the server says what is wrong."""
    size = batch_size or DEFAULT_BATCH_SIZE
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if num_bytes is None or max_chunk_bytes is None:
        return [list(items[i : i + size]) for i in range(0, len(items), size)] or [[]]
    chunks: list[list[T]] = [[]]
    chunk_bytes = 0
    for item in items:
        item_bytes = num_bytes(item)
        if chunks[-1] and (len(chunks[-1]) == size or chunk_bytes + item_bytes > max_chunk_bytes):
            chunks.append([])
            chunk_bytes = 0
        chunks[-1].append(item)
        chunk_bytes += item_bytes
    return chunks


async def map_chunks(
    chunks: list[list[T]],
    send: Callable[[list[T]], Awaitable[R]],
    *,
    concurrency: int,
    show_progress: bool,
    desc: str,
    unit: str = "text",
) -> list[R]:
    """`send(chunk)` for every chunk, `concurrency` at a time; the answers in chunk order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    gate = asyncio.Semaphore(concurrency)
    bar = _progress_bar(sum(map(len, chunks)), desc, unit) if show_progress else None

    async def one(chunk: list[T]) -> R:
        async with gate:
            answer = await send(chunk)
        if bar is not None:
            bar.update(len(chunk))
        return answer

    tasks = [asyncio.ensure_future(one(chunk)) for chunk in chunks]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let the cancelled ones finish
        if bar is not None:
            bar.close()


class _Bar(Protocol):
    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


def _progress_bar(total: int, desc: str, unit: str) -> _Bar:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise ImportError("show_progress=True needs tqdm: pip install 'shoal[sdk]'") from exc
    bar: _Bar = tqdm(total=total, desc=desc, unit=unit)
    return bar
