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
    """A model's tokenizer with its special tokens and truncation at `max_length` tokens.

    Late-interaction models also shape the ids: `marker_id` goes right after the first token
    ([CLS] [Q] ...), and `expand_to` pads the sequence with `expand_id` up to that length (ColBERT's
    query augmentation with [MASK]). Both stay within `max_length`.
    """

    def __init__(self, tokenizer: Tokenizer, max_length: int, *, marker_id: int | None = None,
                 expand_to: int | None = None, expand_id: int | None = None) -> None:
        self.max_length = max_length
        self.marker_id = marker_id
        self.expand_to = min(expand_to, max_length) if expand_to else None
        self.expand_id = expand_id
        self._tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length - (marker_id is not None))

    @classmethod
    def from_dir(cls, directory: Path, max_length: int) -> "TextTokenizer":
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory}: no tokenizer.json (shoal reads fast-tokenizer files)")
        return cls(Tokenizer.from_file(str(path)), max_length)

    def variant(self, max_length: int, *, marker: str | None = None, expand_to: int | None = None,
                expand_token: str | None = None) -> "TextTokenizer":
        """A copy with its own truncation, marker and expansion (the original is shared by threads)."""
        clone = Tokenizer.from_str(self._tokenizer.to_str())
        return TextTokenizer(clone, max_length, marker_id=self.token_id(marker) if marker else None,
                             expand_to=expand_to, expand_id=self.token_id(expand_token) if expand_token else None)

    def token_ids(self, tokens) -> list[int]:
        """Ids of those `tokens` that are in the vocabulary (others are skipped)."""
        return [i for i in map(self._tokenizer.token_to_id, tokens) if i is not None]

    def token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"token {token!r} is not in the model's vocabulary")
        return token_id

    def token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(int(token_id)) or ""

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def special_ids(self) -> list[int]:
        return sorted(i for i, tok in self._tokenizer.get_added_tokens_decoder().items() if tok.special)

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
        ids = [enc.ids for enc in encodings]
        if self.marker_id is not None:
            ids = [i[:1] + [self.marker_id] + i[1:] for i in ids]
        if self.expand_to is not None:
            ids = [i + [self.expand_id] * (self.expand_to - len(i)) for i in ids]
        return [np.asarray(i, dtype=np.int64) for i in ids]


class TokenizerPool:
    def __init__(self, num_threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="shoal-tokenize")

    async def encode(self, tokenizer: TextTokenizer, texts: list[str], truncate: bool) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, tokenizer.encode, texts, truncate)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
