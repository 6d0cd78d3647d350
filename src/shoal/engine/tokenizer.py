"""Tokenization off the event loop and off the device thread.

`tokenizers` releases the GIL while it encodes, so a small thread pool tokenizes the next requests
while the device thread runs the current batch.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import InputTooLong, ModelLoadError


class TextTokenizer:
    """A model's tokenizer with its special tokens and truncation at `max_length` tokens."""

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self.max_length = max_length
        self._tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length)

    @classmethod
    def from_dir(cls, directory: Path, max_length: int) -> "TextTokenizer":
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory}: no tokenizer.json (shoal reads fast-tokenizer files)")
        return cls(Tokenizer.from_file(str(path)), max_length)

    def encode(self, texts: list[str], truncate: bool) -> list[np.ndarray]:
        """Token ids per text, special tokens included, each at most `max_length` long."""
        encodings = self._tokenizer.encode_batch(texts)
        if not truncate:
            for index, enc in enumerate(encodings):
                if enc.overflowing:
                    raise InputTooLong(
                        f"items[{index}] is longer than the model's max_length of {self.max_length} "
                        "tokens; shorten it or send truncate: true",
                        details={"index": index, "max_length": self.max_length},
                    )
        return [np.asarray(enc.ids, dtype=np.int64) for enc in encodings]


class TokenizerPool:
    def __init__(self, num_threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="shoal-tokenize")

    async def encode(self, tokenizer: TextTokenizer, texts: list[str], truncate: bool) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, tokenizer.encode, texts, truncate)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
