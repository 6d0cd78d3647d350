"""Forwards captured once per token bucket and replayed: CUDA graphs, for a GPU.

    batch (T tokens, n sequences) ─▶ bucket (T_b, n_b) ─▶ pad into the bucket's static inputs ─▶ replay ─▶ states[:T]

On a GPU a batch of a few short sentences is bound by kernel launches, not by arithmetic: a
MiniLM forward is about a hundred kernels, each a few microseconds of host work. A captured graph
launches them all at once. A graph is captured for fixed shapes and fixed buffers, so:

- **Buckets.** A batch is padded up to a bucket of three sizes:
  - T_b tokens, on a ladder of powers of two and their halves (64, 96, 128, 192, ...);
  - L_b, the longest sequence the attention kernel is told: a power of two from 16, at most the
    model's `max_length`;
  - n_b sequences, a power of two.

  Batches beyond the largest bucket (`max_tokens`) run eagerly.
- **Padding.** The batch's own sequences come first. The bucket's spare tokens form filler
  sequences of at most L_b tokens, with positions from 0 and token id `pad_id`. The spare
  boundaries repeat the last one (empty sequences). Attention stays within a sequence, so the
  filler changes no real token's states. tests/test_graphs.py checks that on the CPU path.
- **Attention.** flash-attn's varlen kernel reads the boundaries on the device. Without it, the
  padded path takes the bucket as one `[n_b, L_b]` group built on the device
  (`AttentionMeta.whole`); its length groups would have to be read back on the host.
- **Buffers.** The replayed forward reads the bucket's static inputs, which each batch's
  arrays are copied into on the lane's stream. It writes its static output. States for the
  batch's tokens are a view of that output; the lane's heads read them before the lane's next
  replay, queued behind them on the same stream.
- **Per lane.** Each lane has its own graphs and memory pool (engine/streams.py: a lane per
  stream), so two lanes never share a buffer.
- **When.** Only on a device where `Graphs.capture` can capture: a CUDA device.
  - What the graph holds must not read the device back. So batches with a key cut, LoRA routing
    or feature rows stay eager.
  - A model that reads the device back, or pools itself, is never captured. Its class says
    `graphable = False` (DeBERTa, Idefics3), or it is a dual encoder that returns `[n, dim]`
    (`ModelRunner.capture_graphs`). A failed CUDA capture can leave torch's allocators believing
    that a capture is still under way.
  - A capture that fails anyway is logged once, and the model runs eagerly from then on.
  - Captures happen one at a time in the process (a lock), on the capturing lane's own stream.

The capture itself goes through `capture` (CUDA graphs by default). tests/test_graphs.py drives
everything else on a CPU with a capture that re-runs the function on the same buffers. The parity
of a real capture is bench/gpu_check.py's (`graphs` in its parity).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layers import AttentionMeta, PackedInputs
from .streams import LaneStream
from .types import Batch

log = logging.getLogger("shoal.graphs")

MIN_BUCKET_TOKENS = 64
MIN_BUCKET_SEQS = 8
MAX_GRAPHS_PER_LANE = 48

# capture(fn, pool) -> (the output of fn, replay): `replay()` re-runs what fn did, on the same
# buffers, rewriting that output.
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[torch.Tensor, Callable[[], None]]]


MIN_BUCKET_SEQLEN = 16


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int
    seqs: int
    seqlen: int  # the longest sequence attention is told of (flash-attn's grid; the padded view's L)


def bucket_tokens(num_tokens: int) -> int:
    """The smallest of 64, 96, 128, 192, 256, ... (powers of two and one and a half times them)
    that holds `num_tokens`."""
    size = MIN_BUCKET_TOKENS
    while True:
        if num_tokens <= size:
            return size
        if num_tokens <= size + size // 2:
            return size + size // 2
        size *= 2


def _power_of_two(n: int, least: int) -> int:
    size = least
    while size < n:
        size *= 2
    return size


def bucket_of(num_tokens: int, num_seqs: int, max_seqlen: int, max_length: int) -> Bucket:
    """The bucket a batch of `num_tokens` tokens in `num_seqs` sequences, the longest `max_seqlen`,
    pads into: room for its sequences and for the filler sequences (at most the bucket's seqlen
    each) of the spare tokens."""
    tokens = bucket_tokens(num_tokens)
    seqlen = min(max_length, _power_of_two(max_seqlen, MIN_BUCKET_SEQLEN))
    fillers = -(-(tokens - num_tokens) // seqlen)
    return Bucket(tokens, _power_of_two(num_seqs + fillers, MIN_BUCKET_SEQS), seqlen)


@dataclass(frozen=True)
class PaddedArrays:
    input_ids: np.ndarray  # [T_b] int64
    position_ids: np.ndarray  # [T_b] int64
    cu_seqlens: np.ndarray  # [n_b+1] int32
    token_type_ids: np.ndarray | None  # [T_b] int64, when the batch has them


def pad_to_bucket(batch: Batch, bucket: Bucket, pad_id: int) -> PaddedArrays:
    """The batch's arrays padded into `bucket` (see the module: filler sequences, then empty ones)."""
    T, n, most = batch.num_tokens, batch.num_seqs, bucket.seqlen
    spare = bucket.tokens - T
    fillers = [most] * (spare // most) + ([spare % most] if spare % most else [])
    if n + len(fillers) > bucket.seqs:
        raise ValueError(f"{n} sequences and {len(fillers)} fillers do not fit a bucket of {bucket.seqs}")
    input_ids = np.full(bucket.tokens, pad_id, dtype=np.int64)
    input_ids[:T] = batch.input_ids
    position_ids = np.zeros(bucket.tokens, dtype=np.int64)
    position_ids[:T] = batch.position_ids
    cu = np.full(bucket.seqs + 1, bucket.tokens, dtype=np.int32)
    cu[: n + 1] = batch.cu_seqlens
    start = T
    for i, length in enumerate(fillers):
        position_ids[start : start + length] = np.arange(length)
        start += length
        cu[n + 1 + i] = start
    token_type_ids = None
    if batch.token_type_ids is not None:
        token_type_ids = np.zeros(bucket.tokens, dtype=np.int64)
        token_type_ids[:T] = batch.token_type_ids
    return PaddedArrays(input_ids, position_ids, cu, token_type_ids)


@dataclass(frozen=True)
class _Graph:
    """One bucket's captured forward on one lane: its static inputs and output, and its replay."""

    static: dict[str, torch.Tensor]  # name -> the device tensor the graph reads
    states: torch.Tensor  # [T_b, hidden]: what the graph writes
    replay: Callable[[], None]


# One capture at a time in the process: CUDA allows no more, and torch's default capture stream is shared.
_CAPTURE_LOCK = threading.Lock()


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.Tensor, Callable[[], None]]:
    """Capture `fn` as a CUDA graph in `pool`, on the calling lane's stream (the current one),
    after one eager run there: lazy initialisations, such as cuBLAS's workspace or a model's
    per-length tables, must not happen inside a capture. The lanes capture one at a time."""
    stream = torch.cuda.current_stream()
    with _CAPTURE_LOCK:
        fn()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the other lane's calls (its copies, its reads back) do not break this capture.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            states = fn()
    return states, graph.replay


def cuda_pool() -> Any:
    return torch.cuda.graph_pool_handle()


class Graphs:
    """A model's captured forwards, per lane and bucket (see the module)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_length: int,
        max_tokens: int,
        pad_id: int = 0,
        capture: Capture = cuda_capture,
        new_pool: Callable[[], Any] = cuda_pool,
        max_graphs: int = MAX_GRAPHS_PER_LANE,
    ) -> None:
        self.model = model
        self.max_length = max_length
        self.max_tokens = max_tokens
        self.pad_id = pad_id
        self._capture = capture
        self._new_pool = new_pool
        self._max_graphs = max_graphs
        self._local = threading.local()  # .graphs: {(Bucket, typed): _Graph}, .pool
        self.broken: str | None = None  # why capturing failed: then every batch runs eagerly
        self.captures = 0  # graphs captured, all lanes (tests and logs read it)
        self.replays = 0

    def fits(self, batch: Batch) -> bool:
        """Whether `batch` may run as a replay: text only (no feature rows), every token a key, and
        within the largest bucket."""
        return (
            self.broken is None
            and not batch.features
            and batch.key_lengths is None
            and batch.adapter_slots is None
            and batch.num_tokens <= self.max_tokens
            and batch.max_seqlen <= self.max_length
        )

    def forward(self, batch: Batch, lane: LaneStream) -> torch.Tensor | None:
        """The batch's states `[T, hidden]` from its bucket's replay (captured first if new); None
        when it does not fit or its bucket cannot be captured: the caller runs it eagerly."""
        if not self.fits(batch):
            return None
        bucket = bucket_of(batch.num_tokens, batch.num_seqs, batch.max_seqlen, self.max_length)
        padded = pad_to_bucket(batch, bucket, self.pad_id)
        graphs = self._lane_graphs()
        key = (bucket, padded.token_type_ids is not None)
        graph = graphs.get(key)
        if graph is None:
            if len(graphs) >= self._max_graphs:
                return None
            graph = self._captured(padded, bucket, lane)
            if graph is None:
                return None
            graphs[key] = graph
        for name in ("input_ids", "position_ids", "cu_seqlens", "token_type_ids"):
            array = getattr(padded, name)
            if array is not None:
                graph.static[name].copy_(lane.stage(array), non_blocking=True)
        graph.replay()
        self.replays += 1
        return graph.states[: batch.num_tokens]

    def _lane_graphs(self) -> dict:
        graphs = getattr(self._local, "graphs", None)
        if graphs is None:
            graphs = self._local.graphs = {}
            self._local.pool = self._new_pool()
        return graphs

    def _captured(self, padded: PaddedArrays, bucket: Bucket, lane: LaneStream) -> _Graph | None:
        static = {
            name: lane.stage(array).clone()  # the graph's own buffers: a staged array may be the host's memory
            for name in ("input_ids", "position_ids", "cu_seqlens", "token_type_ids")
            if (array := getattr(padded, name)) is not None
        }

        def run() -> torch.Tensor:
            meta = AttentionMeta.build(
                static["cu_seqlens"], bucket.seqlen, num_tokens=bucket.tokens, each=False, whole=True
            )
            inputs = PackedInputs(static["input_ids"], static["position_ids"], meta, static.get("token_type_ids"))
            return self.model(inputs)

        try:
            states, replay = self._capture(run, self._local.pool)
        except Exception as exc:  # any failure means: this model runs eagerly
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("capturing a forward failed; the model runs without graphs: %s", self.broken)
            return None
        self.captures += 1
        return _Graph(static, states, replay)
