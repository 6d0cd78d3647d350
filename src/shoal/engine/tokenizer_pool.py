"""The tokenizer pool: texts are tokenized off the event loop and off the device lanes, in turns.

`tokenizers` releases the GIL while it encodes, so a few threads tokenize the next requests while
the device runs the current batch. A request's texts go TEXTS_PER_JOB at a time, so a bulk
request takes turns with the others and stops when its caller goes away; a short one (a query, a
sentence) is tokenized on the loop, cheaper than two thread hops.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .tokenizer import TEXTS_PER_JOB, TextTokenizer
from .types import Encoded

if TYPE_CHECKING:
    from .backend import Preprocessor

# Requests of at most this many texts and characters are tokenized on the event loop, not in the pool.
INLINE_CHARS = 1024
INLINE_TEXTS = 32


class TokenizerPool:
    def __init__(self, num_threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="shoal-tokenize")

    async def map(self, fn, items: list) -> list:
        """`fn(chunk, first_index) -> list` over `items` in the pool, TEXTS_PER_JOB items a job."""
        loop = asyncio.get_running_loop()
        out: list = []
        for start in range(0, len(items), TEXTS_PER_JOB):
            out += await loop.run_in_executor(self._executor, fn, items[start : start + TEXTS_PER_JOB], start)
        return out

    async def encode(
        self,
        tokenizer: TextTokenizer,
        texts: list[str],
        truncate: bool,
        *,
        pairs: list[str] | None = None,
        with_offsets: bool = False,
        what: str = "items",
        indexed: bool = True,
        cut_first: bool = False,
    ) -> list[Encoded]:
        """`tokenizer.encode` in the pool, TEXTS_PER_JOB texts a job (so requests take turns).
        Errors name `what[i]`, or `what` alone when not `indexed`."""
        if len(texts) <= INLINE_TEXTS and sum(map(len, texts)) + sum(map(len, pairs or ())) <= INLINE_CHARS:
            # A short request (a query, a sentence): tokenized here on the loop in tens of
            # microseconds, cheaper than the two thread hops of the pool.
            return tokenizer.encode(
                texts,
                truncate,
                pairs=pairs,
                with_offsets=with_offsets,
                first_index=0 if indexed else None,
                what=what,
                cut_first=cut_first,
            )
        loop = asyncio.get_running_loop()
        out: list[Encoded] = []
        for start in range(0, len(texts), TEXTS_PER_JOB):
            chunk = texts[start : start + TEXTS_PER_JOB]
            chunk_pairs = pairs[start : start + TEXTS_PER_JOB] if pairs is not None else None
            out += await loop.run_in_executor(
                self._executor,
                functools.partial(
                    tokenizer.encode,
                    chunk,
                    truncate,
                    pairs=chunk_pairs,
                    with_offsets=with_offsets,
                    first_index=start if indexed else None,
                    what=what,
                    cut_first=cut_first,
                ),
            )
        return out

    async def prepare(
        self, preprocessor: Preprocessor, values: list, indices: Sequence[int], truncate: bool, what: str = "items"
    ) -> list[Encoded]:
        """`preprocessor.prepare` of each value in the pool, TEXTS_PER_JOB values a job; `indices`
        are the values' positions in their request (errors name `what[index]`)."""

        def job(chunk: list, start: int) -> list[Encoded]:
            return [
                preprocessor.prepare([value], truncate, first_index=indices[start + offset], what=what)[0]
                for offset, value in enumerate(chunk)
            ]

        return await self.map(job, values)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
