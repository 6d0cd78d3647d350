"""`score` against its references, computed here: sentence-transformers' CrossEncoder on random-
initialised sequence-classification models of each backbone and on the real MiniLM encoder with a
seeded head; transformers for the LLM-reranker (Qwen3-Reranker) formula on the real SmolLM2
weights; and the encoder outputs for bi-encoder scoring."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder

from engine_calls import catalog_with, run
from rerankers import build_minilm_reranker, minilm_dir
from shoal.catalog import Catalog
from shoal.config import EngineSettings
from shoal.engine import EncodeCall, Engine, ScoreCall
from shoal.errors import InputTooLong, InvalidRequest

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
QUERY = "how do shoals of fish avoid predators?"
DOCUMENTS = [
    "Fish in a shoal move together, so a predator finds it hard to pick one out.",
    "The stock market fell sharply on Tuesday.",
    "a",
    "Schooling behaviour confuses predators: many fish turn at once, and the shoal flashes and splits "
    "around the attacker before closing again behind it. " * 6,  # longer than max_length: truncated
    "Predators.",
]


def reranker_card(directory, max_length: int, **score) -> str:
    fields = "".join(f"\n  {k}: {v}" for k, v in score.items())
    return f"""
id: test/reranker
tasks: [score]
source: {{path: {directory}}}
max_length: {max_length}
score:
  kind: cross_encoder{fields}
"""


def save_tokenizer(directory, with_segments: bool) -> None:
    """MiniLM's WordPiece tokenizer as a generic fast tokenizer. Backbones whose tokenizers feed no
    segment ids (RoBERTa/XLM-R, ModernBERT, DistilBERT) get a config that says so, as theirs do."""
    names = ["input_ids", "token_type_ids", "attention_mask"] if with_segments else ["input_ids", "attention_mask"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(minilm_dir() / "tokenizer.json"),
        model_input_names=names,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(directory)


VOCAB = 30522  # MiniLM's vocabulary, so its tokenizer drives every backbone
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)

BACKBONES = {
    "bert": (
        lambda labels: transformers.BertForSequenceClassification(
            transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, num_labels=labels, **SMALL)
        ),
        True,
    ),
    "xlm-roberta": (
        lambda labels: transformers.XLMRobertaForSequenceClassification(
            transformers.XLMRobertaConfig(
                vocab_size=VOCAB,
                max_position_embeddings=66,
                pad_token_id=0,
                type_vocab_size=1,
                num_labels=labels,
                **SMALL,
            )
        ),
        False,
    ),
    "deberta-v2": (
        lambda labels: transformers.DebertaV2ForSequenceClassification(
            transformers.DebertaV2Config(
                vocab_size=VOCAB,
                max_position_embeddings=64,
                relative_attention=True,
                position_buckets=16,
                pos_att_type=["p2c", "c2p"],
                max_relative_positions=-1,
                position_biased_input=False,
                type_vocab_size=0,
                norm_rel_ebd="layer_norm",
                share_att_key=True,
                pad_token_id=0,
                num_labels=labels,
                **SMALL,
            )
        ),
        True,
    ),
    "modernbert-cls": (
        lambda labels: transformers.ModernBertForSequenceClassification(
            transformers.ModernBertConfig(
                vocab_size=VOCAB,
                max_position_embeddings=64,
                pad_token_id=0,
                cls_token_id=101,
                sep_token_id=102,
                bos_token_id=101,
                eos_token_id=102,
                global_attn_every_n_layers=2,
                local_attention=16,
                classifier_pooling="cls",
                num_labels=labels,
                **SMALL,
            )
        ),
        False,
    ),
    "modernbert-mean": (
        lambda labels: transformers.ModernBertForSequenceClassification(
            transformers.ModernBertConfig(
                vocab_size=VOCAB,
                max_position_embeddings=64,
                pad_token_id=0,
                cls_token_id=101,
                sep_token_id=102,
                bos_token_id=101,
                eos_token_id=102,
                global_attn_every_n_layers=2,
                local_attention=16,
                classifier_pooling="mean",
                classifier_activation="silu",
                classifier_bias=True,
                num_labels=labels,
                **SMALL,
            )
        ),
        False,
    ),
    "distilbert": (
        lambda labels: transformers.DistilBertForSequenceClassification(
            transformers.DistilBertConfig(
                vocab_size=VOCAB,
                max_position_embeddings=64,
                dim=32,
                n_layers=2,
                n_heads=4,
                hidden_dim=64,
                num_labels=labels,
            )
        ),
        False,
    ),
}


def build_cross_encoder(directory, backbone: str, labels: int = 1, seed: int = 0):
    make, with_segments = BACKBONES[backbone]
    torch.manual_seed(seed)
    model = make(labels).eval()
    with torch.no_grad():  # larger random weights than the initialiser's, so scores spread out
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
            elif "embeddings" in name:  # token, position and segment rows that differ clearly
                param.normal_(0, 1.0)
            else:
                param.normal_(0, 1.5 / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    save_tokenizer(directory, with_segments)
    return model


def pairs():
    return [(QUERY, d) for d in DOCUMENTS]


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_cross_encoder_logits_equal_sentence_transformers_cross_encoder(tmp_path, backbone):
    directory = tmp_path / "model"
    build_cross_encoder(directory, backbone)
    reference = CrossEncoder(str(directory), max_length=64, device="cpu")
    expected = reference.predict(pairs(), activation_fn=torch.nn.Identity(), batch_size=8)  # [n] logits

    catalog = catalog_with(tmp_path, reranker_card(directory, 64))
    raw, activated = run(
        catalog,
        ScoreCall("test/reranker", QUERY, DOCUMENTS, raw_scores=True),
        ScoreCall("test/reranker", QUERY, DOCUMENTS),
    )
    got = np.zeros(len(DOCUMENTS))
    for item in raw.items:
        got[item.index] = item.score
    assert np.abs(got - expected).max() <= 1e-4, (got, expected)
    # One logit: the score is its sigmoid; items come ranked, best first.
    ranked = [i.score for i in activated.items]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == len(DOCUMENTS)
    sig = {i.index: i.score for i in activated.items}
    assert max(abs(sig[i] - 1 / (1 + np.exp(-expected[i]))) for i in range(len(DOCUMENTS))) <= 1e-5
    # The long document was cut to fit; the others were not.
    assert {i.index for i in raw.items if i.truncated} == {3}


def test_bert_pairs_carry_segment_ids_as_the_reference_tokenizer_gives_them(tmp_path):
    """Scores equal the reference fed the tokenizer's segment ids, and differ from it fed none, so
    the segment ids are what makes them equal."""
    directory = tmp_path / "model"
    model = build_cross_encoder(directory, "bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(
        [QUERY] * len(DOCUMENTS), DOCUMENTS, truncation="only_second", max_length=64, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        with_segments = model(**batch).logits[:, 0].numpy()
        batch["token_type_ids"].zero_()
        without = model(**batch).logits[:, 0].numpy()
    (result,) = run(
        catalog_with(tmp_path, reranker_card(directory, 64)),
        ScoreCall("test/reranker", QUERY, DOCUMENTS, raw_scores=True),
    )
    got = np.array([next(i.score for i in result.items if i.index == k) for k in range(len(DOCUMENTS))])
    assert np.abs(got - with_segments).max() <= 1e-4
    assert np.abs(got - without).max() > 1e-2


def test_two_label_cross_encoder_scores_the_softmax_of_its_positive_label(tmp_path):
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert", labels=3)
    reference = CrossEncoder(str(directory), max_length=64, device="cpu")
    logits = torch.tensor(reference.predict(pairs(), activation_fn=torch.nn.Identity()))  # [n, 3]
    for positive, card in ((2, reranker_card(directory, 64)), (0, reranker_card(directory, 64, positive_label=0))):
        (result,) = run(catalog_with(tmp_path, card), ScoreCall("test/reranker", QUERY, DOCUMENTS))
        expected = logits.softmax(-1)[:, positive].numpy()
        got = {i.index: i.score for i in result.items}
        assert max(abs(got[i] - expected[i]) for i in range(len(DOCUMENTS))) <= 1e-5


def test_real_minilm_encoder_with_a_seeded_head_equals_cross_encoder_on_the_same_folder(tmp_path):
    """The real loading path: the packaged all-MiniLM-L6-v2 weights, as a BertForSequenceClassification
    with a seeded classifier, served from its folder."""
    directory = tmp_path / "minilm-reranker"
    build_minilm_reranker(directory)
    reference = CrossEncoder(str(directory), max_length=256, device="cpu")
    expected = reference.predict(pairs(), activation_fn=torch.nn.Sigmoid())
    catalog = catalog_with(tmp_path, reranker_card(directory, 256))
    (result,) = run(catalog, ScoreCall("test/reranker", QUERY, DOCUMENTS))
    got = {i.index: i.score for i in result.items}
    assert max(abs(got[i] - expected[i]) for i in range(len(DOCUMENTS))) <= 1e-5
    assert [i.index for i in result.items] == list(np.argsort(-expected, kind="stable"))


def test_windows_score_a_long_document_by_its_best_window(tmp_path):
    """With window_overlap_tokens, a document longer than the model takes is scored in windows;
    its score is the best of CrossEncoder's scores of those same windows."""
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 32))
    long_doc = " ".join(f"fish{i} swim near reef{i} while sharks circle" for i in range(12))
    (result,) = run(
        catalog, ScoreCall("test/reranker", "sharks", [long_doc, "sharks"], raw_scores=True, window_overlap_tokens=4)
    )
    item = next(i for i in result.items if i.index == 0)
    assert item.num_windows > 2 and not item.truncated
    # The windows, as the tokenizer cut them, through the reference model one by one.
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    windows = tokenizer(
        "sharks", long_doc, truncation="only_second", max_length=32, stride=4, return_overflowing_tokens=True
    )
    assert len(windows["input_ids"]) == item.num_windows
    assert next(i for i in result.items if i.index == 1).num_windows == 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        best = max(
            model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits.item()
            for ids, types in zip(windows["input_ids"], windows["token_type_ids"])
        )
    assert abs(item.score - best) <= 1e-4


def test_top_k_and_max_tokens_per_doc(tmp_path):
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 64))
    full, top, cut = run(
        catalog,
        ScoreCall("test/reranker", QUERY, DOCUMENTS, raw_scores=True),
        ScoreCall("test/reranker", QUERY, DOCUMENTS, raw_scores=True, top_k=2),
        ScoreCall("test/reranker", QUERY, DOCUMENTS, raw_scores=True, max_tokens_per_doc=3),
    )
    # The calls' batches differ (two lanes split them): scores agree to float32's last bits.
    assert [i.index for i in top.items] == [i.index for i in full.items[:2]]
    assert [i.score for i in top.items] == pytest.approx([i.score for i in full.items[:2]], rel=1e-5)
    # max_tokens_per_doc: each document is its first 3 tokens, as the reference sees them.
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    reference = CrossEncoder(str(directory), max_length=64, device="cpu")
    heads = [tokenizer.decode(tokenizer(d, add_special_tokens=False)["input_ids"][:3]) for d in DOCUMENTS]
    expected = reference.predict([(QUERY, h) for h in heads], activation_fn=torch.nn.Identity())
    got = {i.index: i.score for i in cut.items}
    assert max(abs(got[i] - expected[i]) for i in range(len(DOCUMENTS))) <= 1e-4
    assert {i.index for i in cut.items if i.truncated} == {0, 1, 3}  # "a" and "Predators." fit in 3 tokens


def test_bad_score_calls_are_refused_naming_the_problem(tmp_path):
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 64))

    async def go():
        engine = Engine(EngineSettings(), catalog, allow_download=False)
        await engine.start()
        try:
            cases = [
                (ScoreCall("test/reranker", "", DOCUMENTS), InvalidRequest, "query is empty"),
                (ScoreCall("test/reranker", QUERY, []), InvalidRequest, "no documents"),
                (ScoreCall("test/reranker", QUERY, DOCUMENTS, top_k=0), InvalidRequest, "top_k"),
                (ScoreCall("test/reranker", QUERY, DOCUMENTS, truncate=False), InputTooLong, "documents[3]"),
                (ScoreCall("test/reranker", QUERY, DOCUMENTS, instruction="x"), InvalidRequest, "LLM rerankers"),
                (
                    ScoreCall("test/reranker", QUERY, DOCUMENTS, window_overlap_tokens=40),
                    InvalidRequest,
                    "between 0 and half a window",
                ),
                (
                    ScoreCall("test/reranker", "long query " * 40, DOCUMENTS, truncate=False),
                    InputTooLong,
                    "the query is longer than half",
                ),
                (EncodeCall("test/reranker", ["x"]), InvalidRequest, "does not encode; it serves: score"),
                (ScoreCall(MINILM, QUERY, DOCUMENTS, window_overlap_tokens=2), InvalidRequest, "cosine"),
                (
                    ScoreCall(MINILM, "word " * 400, ["a"], truncate=False),
                    InputTooLong,
                    "^the query is longer than the model's max_length",
                ),
                (
                    ScoreCall(MINILM, QUERY, ["a", "word " * 400], truncate=False),
                    InputTooLong,
                    "^documents[1] is longer",
                ),
                (
                    ScoreCall("test/reranker", "bad \ud800 query", DOCUMENTS),
                    InvalidRequest,
                    "^query has a lone surrogate",
                ),
                (
                    ScoreCall("test/reranker", QUERY, ["ok", "bad \ud800"]),
                    InvalidRequest,
                    "^documents[1] has a lone surrogate",
                ),
            ]
            for call, error, words in cases:
                with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
                    await engine.run(call)
        finally:
            await engine.stop()

    asyncio.run(go())


def test_an_encoder_card_limited_to_encode_refuses_score_listing_its_tasks(tmp_path):
    card = f"""
id: test/encode-only
tasks: [encode]
source: {{path: {minilm_dir()}}}
max_length: 128
pooling: mean
dimensions: 384
"""
    with pytest.raises(InvalidRequest, match="does not score; it serves: encode"):
        run(catalog_with(tmp_path, card), ScoreCall("test/encode-only", QUERY, DOCUMENTS))


# --- encoders score too -------------------------------------------------------------------------


def test_a_dense_card_scores_by_the_cosine_of_its_own_embeddings():
    catalog = Catalog.load()
    score, query, docs = run(
        catalog,
        ScoreCall(MINILM, QUERY, DOCUMENTS),
        EncodeCall(MINILM, [QUERY], is_query=True),
        EncodeCall(MINILM, DOCUMENTS),
    )
    q = query.items[0].dense / np.linalg.norm(query.items[0].dense)
    expected = [float(q @ (d.dense / np.linalg.norm(d.dense))) for d in docs.items]
    got = {i.index: i.score for i in score.items}
    assert max(abs(got[i] - expected[i]) for i in range(len(DOCUMENTS))) <= 1e-5
    assert score.items[0].index == 0  # the on-topic document ranks first with real weights


def test_a_sparse_card_scores_by_the_dot_product_of_its_sparse_vectors():
    model = "rasyosef/splade-tiny"
    score, query, docs = run(
        Catalog.load(),
        ScoreCall(model, QUERY, DOCUMENTS),
        EncodeCall(model, [QUERY], outputs=("sparse",), is_query=True),
        EncodeCall(model, DOCUMENTS, outputs=("sparse",)),
    )

    def dense(sv):
        v = np.zeros(30522)
        v[sv.indices] = sv.values
        return v

    q = dense(query.items[0].sparse)
    expected = [float(q @ dense(d.sparse)) for d in docs.items]
    got = {i.index: i.score for i in score.items}
    assert max(abs(got[i] - expected[i]) / max(1.0, abs(expected[i])) for i in range(len(DOCUMENTS))) <= 1e-5
    assert score.items[0].index == 0


def test_cli_score_prints_the_ranking_and_models_lists_rerankers(capsys):
    import json

    from shoal.cli import main

    assert main(["score", MINILM, QUERY, *DOCUMENTS[:2], "--top-k", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1] and lines[0]["score"] > lines[1]["score"]
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "cross-encoder/ms-marco-MiniLM-L-6-v2" in listing and "rasyosef/splade-tiny" in listing


def test_windows_count_against_the_queue_before_and_after_tokenizing(tmp_path):
    """Windows repeat the query in every window: a long document's windows are admitted by what
    they will cost, and a request whose real tokens pass the queue's limit is refused (400), so
    windows cannot be used to slip past admission."""
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 64))

    async def go():
        engine = Engine(EngineSettings(max_queue_tokens=1000), catalog, allow_download=False)
        await engine.start()
        try:
            wordy = " ".join(f"predator{i}" for i in range(600))  # ~4 chars a token: refused by the estimate
            with pytest.raises(InvalidRequest, match="more than the queue holds"):
                await engine.score(ScoreCall("test/reranker", "fish", [wordy], window_overlap_tokens=4))
            terse = "a " * 1500  # 2 chars a token: the estimate passes, the real count does not
            with pytest.raises(InvalidRequest, match="more than the queue holds"):
                await engine.score(ScoreCall("test/reranker", "fish", [terse], window_overlap_tokens=4))
            ok = await engine.score(ScoreCall("test/reranker", "fish", ["a " * 100], window_overlap_tokens=4))
            assert ok.items[0].num_windows > 1
            assert engine.capacity().queued_tokens == 0  # nothing left counted after the refusals
        finally:
            await engine.stop()

    asyncio.run(go())


def test_a_document_longer_than_32_windows_is_cut_to_them_and_says_so(tmp_path):
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 32))
    endless = " ".join(f"reef{i}" for i in range(3000))
    (result,) = run(catalog, ScoreCall("test/reranker", "sharks", [endless, "sharks"], window_overlap_tokens=4))
    long_item = next(i for i in result.items if i.index == 0)
    assert long_item.num_windows == 32 and long_item.truncated


def test_a_query_over_half_the_length_is_cut_and_every_pair_says_truncated(tmp_path):
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 64))
    (result,) = run(catalog, ScoreCall("test/reranker", "fish " * 40, ["a", "b"]))
    assert all(i.truncated for i in result.items)


def test_a_document_behind_a_run_of_whitespace_scores_as_the_reference_sees_it(tmp_path):
    """Documents are cut by characters before tokenizing; a cut that kept too few tokens (here:
    only spaces) is widened, so the pair equals the whole text's pair."""
    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    documents = [" " * 3000 + DOCUMENTS[0], "\n" * 2000 + DOCUMENTS[3]]
    reference = CrossEncoder(str(directory), max_length=64, device="cpu")
    expected = reference.predict([(QUERY, d) for d in documents], activation_fn=torch.nn.Identity())
    (result,) = run(
        catalog_with(tmp_path, reranker_card(directory, 64)),
        ScoreCall("test/reranker", QUERY, documents, raw_scores=True),
    )
    got = {i.index: i.score for i in result.items}
    assert max(abs(got[i] - expected[i]) for i in range(2)) <= 1e-4


def test_a_request_whose_real_tokens_overflow_the_shared_backlog_gets_503_not_a_bypass(tmp_path):
    """Two requests admitted on estimates that fit; their real tokens do not. Whichever is
    tokenized second is refused as Overloaded (with Retry-After), and nothing stays counted."""
    from shoal.errors import Overloaded

    directory = tmp_path / "model"
    build_cross_encoder(directory, "bert")
    catalog = catalog_with(tmp_path, reranker_card(directory, 64))
    terse = ["a " * 25] * 20  # ~17 estimated tokens a pair, 29 real

    async def go():
        engine = Engine(EngineSettings(max_queue_tokens=1000), catalog, allow_download=False)
        await engine.start()
        try:
            await engine.score(ScoreCall("test/reranker", "fish", ["warm up"]))
            outcomes = await asyncio.gather(
                *(engine.score(ScoreCall("test/reranker", "fish", terse)) for _ in range(2)), return_exceptions=True
            )
            return outcomes, engine.capacity().queued_tokens
        finally:
            await engine.stop()

    outcomes, left = asyncio.run(go())
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    assert len(refused) == 1 and refused[0].retry_after_s >= 1.0, outcomes
    assert sum(1 for o in outcomes if not isinstance(o, BaseException)) == 1
    assert left == 0
