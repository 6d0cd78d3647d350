"""Per-token work in blocks of rows (CPU): a layer's feed-forward block, a few hundred tokens at a time.

A feed-forward block widens every token 4x (MiniLM: 384 -> 1,536 floats) and then narrows it back.
Over a whole 4,096-token batch the wide intermediate is a 25 MB tensor (BERT-base: 50 MB), and so
is each of the elementwise passes that follow it (GELU; with `quantize: int8`, the int32 product's
conversion, its scaling, and the quantisation of the next Linear's input). That buffer fits no
cache: every pass streams it through memory. Run on blocks of rows whose intermediate fits 3 MiB
(the default, catalog/card.py's ROW_BLOCK_BYTES: 512 MiniLM tokens, 256 BERT-base ones), the
block's buffers stay in L2/L3 and are reused block after block: int8's passes gain most, float32's
less (`python bench/int8.py --row-block-bytes 0,1572864,3145728,6291456`; the figures are in
docs/benchmarks.md, CPU kernels). A card's `batching.row_block_bytes` sets the size per hardware
class (0: off), and `shoal tune` tries it.

Each row's result is what the whole-batch call gives it (the block's matmuls and norms are per row;
int8 quantises per token), up to float32's last bits. Blocks are CPU only (on a GPU one launch over
the whole batch is what is fast) and are off while LoRA adapters run: their forward hooks route a
Linear's rows by the batch's token positions, one call per Linear (layers/lora.py). The runner says
which, in `AttentionMeta.row_block_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_BLOCK_ROWS = 64


def block_rows(width: int, block_bytes: int, element_size: int = 4) -> int:
    """Rows per block for an intermediate `width` values wide; 0: the whole batch in one call."""
    if block_bytes <= 0:
        return 0
    return max(MIN_BLOCK_ROWS, block_bytes // (width * element_size))


def in_row_blocks(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, width: int, block_bytes: int
) -> torch.Tensor:
    """`fn(x)` for per-token `fn` over `x` `[T, ...]`, called on blocks of rows whose widest
    intermediate (`width` values a row) fits `block_bytes` (0: one call over all T rows)."""
    rows = block_rows(width, block_bytes, x.element_size())
    T = x.shape[0]
    if rows == 0 or T <= rows:
        return fn(x)
    first = fn(x[:rows])
    out = first.new_empty((T, *first.shape[1:]))
    out[:rows] = first
    for start in range(rows, T, rows):
        out[start : start + rows] = fn(x[start : start + rows])
    return out
