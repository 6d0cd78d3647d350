"""ColSmol (ColIdefics3) page retrieval served by the engine, against colpali-engine's ColIdefics3
and ColIdefics3Processor on the same random-weight folder (tests/page_models.py): page images
sent as PNG and JPEG bytes of real photos (scikit-image's) through shoal's decode, tiling and
prompt give the reference's vectors for `process_images`; text queries its vectors for
`process_queries` (the ten `<end_of_utterance>` included); text documents `process_texts`; and
score is MaxSim as `score_multi_vector` computes it. The built-in card's fields are checked
against the reference processor's."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as photos

if importlib.util.find_spec("colpali_engine") is None:  # not imported: see page_models.colpali
    pytest.skip("colpali-engine (requirements/test-references.txt) is not installed", allow_module_level=True)

import engine_calls
import page_models
from shoal.calls import EncodeCall, Item, ScoreCall
from shoal.catalog import Catalog, parse_card
from shoal.errors import InvalidRequest, ModelLoadError

ATOL = 1e-4
QUERIES = ["a page about cats", "tax", "dogs and cats"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tiny = page_models.tiny_colsmol(tmp_path_factory.mktemp("colsmol"), model_id="test/colsmol")
    return tiny.reference, tiny.processor, parse_card(tiny.card, "<test>"), tiny.card


def run(card, *calls, **options):
    return engine_calls.run(Catalog([card]), *calls, **options)


def page_files() -> list[bytes]:
    """Photos as a client sends them: a wide PNG (4 x 3 tiles and the whole), a JPEG, and a small
    square-ish PNG (scaled up, as the processor scales it, to 4 x 4 tiles and the whole)."""
    out = []
    small = Image.fromarray(photos.chelsea()).resize((24, 20))
    for image, fmt in (
        (Image.fromarray(photos.astronaut()).crop((0, 0, 512, 300)), "PNG"),
        (Image.fromarray(photos.coffee()), "JPEG"),
        (small, "PNG"),
    ):
        buffer = io.BytesIO()
        image.save(buffer, format=fmt)
        out.append(buffer.getvalue())
    return out


def reference_vectors(model, batch) -> list[np.ndarray]:
    """Each sequence's vectors as ColIdefics3 gives them, its padding positions left out."""
    with torch.no_grad():
        out = model(**batch)
    mask = batch["attention_mask"].bool()
    return [out[i][mask[i]].numpy() for i in range(out.shape[0])]


def test_pages_queries_and_text_documents_encode_as_colpali_engine_encodes_them(served):
    reference, processor, card, _ = served
    files = page_files()
    pages = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    encoded_pages, encoded_queries, encoded_texts = run(
        card,
        EncodeCall(model=card.id, items=[Item(image=f) for f in files], outputs=("multivector",)),
        EncodeCall(model=card.id, items=QUERIES, is_query=True, outputs=("multivector",)),
        EncodeCall(model=card.id, items=QUERIES, is_query=False, outputs=("multivector",)),
    )
    for got, page in zip(encoded_pages.items, pages):  # one page a batch: no padding in the reference
        (want,) = reference_vectors(reference, processor.process_images([page]))
        assert got.multivector.shape == want.shape
        np.testing.assert_allclose(got.multivector, want, atol=ATOL)
    for got, want in zip(encoded_queries.items, reference_vectors(reference, processor.process_queries(QUERIES))):
        np.testing.assert_allclose(got.multivector, want, atol=ATOL)
    for got, want in zip(encoded_texts.items, reference_vectors(reference, processor.process_texts(QUERIES))):
        np.testing.assert_allclose(got.multivector, want, atol=ATOL)
    # A page has vectors for its prompt and every tile's image tokens: fewer tiles, fewer vectors.
    assert encoded_pages.items[0].multivector.shape[0] < encoded_pages.items[2].multivector.shape[0]


def test_score_ranks_pages_for_a_query_by_colpali_engines_maxsim(served):
    reference, processor, card, _ = served
    files = page_files()
    pages = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    page_vectors = [torch.from_numpy(reference_vectors(reference, processor.process_images([p]))[0]) for p in pages]
    for query in QUERIES[:2]:
        (result,) = run(card, ScoreCall(model=card.id, query=query, documents=[Item(image=f) for f in files]))
        (query_vectors,) = reference_vectors(reference, processor.process_queries([query]))
        q = torch.from_numpy(query_vectors)
        # One page at a time: score_multi_vector pads a batch of pages with zero vectors.
        want = [float(processor.score_multi_vector([q], [d])[0, 0]) for d in page_vectors]
        assert [item.index for item in result.items] == sorted(range(len(want)), key=lambda i: -want[i])
        for item in result.items:
            assert item.score == pytest.approx(want[item.index], abs=ATOL * len(q))


def test_a_bad_page_is_refused_naming_it(served):
    _, _, card, _ = served
    good = page_files()[2]
    (refused,) = run(
        card,
        EncodeCall(model=card.id, items=[Item(image=good), Item(image=b"\x89PNG\r\n\x1a\nbroken")]),
        catch=(InvalidRequest,),
    )
    assert isinstance(refused, InvalidRequest)
    assert "items[1]" in str(refused)


def test_a_card_without_an_image_prompt_does_not_load(served):
    _, _, _, fields = served
    no_prompt = parse_card({k: v for k, v in fields.items() if k != "image_prompt"}, "<test>")
    (failed,) = run(no_prompt, EncodeCall(model=no_prompt.id, items=["tax"]), catch=(ModelLoadError,))
    assert isinstance(failed, ModelLoadError)
    assert "image_prompt" in str(failed)


def test_the_built_in_card_frames_queries_and_pages_as_colpali_engine_does(served):
    _, processor, _, _ = served
    built_in = Catalog.load().get("vidore/colSmol-256M")
    assert built_in.image_prompt == processor.visual_prompt_prefix
    assert built_in.multivector is not None
    assert built_in.multivector.query_suffix == processor.query_augmentation_token * 10
    assert built_in.multivector.dim == 128


def test_one_packed_batch_of_pages_and_queries_equals_colpali_engine_one_by_one(served, tmp_path):
    """The model alone: two pages (13 and 17 tiles) and a query packed in one forward, as the
    scheduler packs them, against ColIdefics3 on each alone."""
    from shoal.layers import AttentionMeta, PackedInputs
    from shoal.weights import build_model

    reference, processor, card, _ = served
    model = build_model(Path(card.source.path), "idefics3", "cpu")
    pages = [Image.open(io.BytesIO(f)).convert("RGB") for f in page_files()[::2]]
    batches = [processor.process_images([p]) for p in pages] + [processor.process_queries(QUERIES[:1])]
    wants = [reference_vectors(reference, b)[0] for b in batches]
    side = page_models.TILE // page_models.PATCH
    rows = [  # [tiles, C, H, W] -> patch rows [tiles * side², C * p * p], row-major patches
        b["pixel_values"][0]
        .reshape(-1, 3, side, page_models.PATCH, side, page_models.PATCH)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(-1, 3 * page_models.PATCH**2)
        for b in batches[:2]
    ]
    ids = torch.cat([b["input_ids"][0] for b in batches])
    lengths = [b["input_ids"].shape[1] for b in batches]
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    meta = AttentionMeta.build(cu, max(lengths))
    cu_rows = torch.tensor(
        [0, rows[0].shape[0], rows[0].shape[0] + rows[1].shape[0], rows[0].shape[0] + rows[1].shape[0]]
    )
    inputs = PackedInputs(ids, meta.pos_in_seq, meta, features={"pixels": torch.cat(rows), "pixels_cu_rows": cu_rows})
    with torch.no_grad():
        states = model(inputs)
        vectors = torch.nn.functional.normalize(
            torch.nn.functional.linear(states, reference.linear.weight, reference.linear.bias), dim=-1
        )
    for i, want in enumerate(wants):
        np.testing.assert_allclose(vectors[cu[i] : cu[i + 1]].numpy(), want, atol=ATOL)


@pytest.fixture(scope="module")
def colsmol_server(serve, served, tmp_path_factory) -> str:
    """The base URL of a server of the folder's card."""
    _, _, card, fields = served
    cards = tmp_path_factory.mktemp("colsmol-cards")
    (cards / "colsmol.yaml").write_text(json.dumps(fields))  # JSON is YAML
    return serve(preload=(card.id,), cards_dirs=(cards,))


def test_pages_over_http_and_through_the_sdk_give_colpali_engines_vectors_and_ranking(served, colsmol_server):
    from shoal.sdk import Client
    from shoal.sdk import Image as SdkImage

    reference, processor, card, _ = served
    files = page_files()
    pages = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    wants = [reference_vectors(reference, processor.process_images([p]))[0] for p in pages]
    kinds = ["jpeg" if f.startswith(b"\xff\xd8") else "png" for f in files]
    urls = [f"data:image/{k};base64,{base64.b64encode(f).decode()}" for k, f in zip(kinds, files)]
    with httpx.Client(base_url=colsmol_server, timeout=120) as http:
        encoded = http.post(
            "/v1/encode",
            json={"model": card.id, "items": [{"image": u} for u in urls], "options": {"outputs": ["multivector"]}},
        )
        ranked = http.post(
            "/v1/score", json={"model": card.id, "query": QUERIES[0], "items": [{"image": u} for u in urls]}
        )
    assert encoded.status_code == 200, encoded.text
    assert ranked.status_code == 200, ranked.text
    for item, want in zip(encoded.json()["items"], wants):
        np.testing.assert_allclose(np.asarray(item["multivector"], dtype=np.float32), want, atol=ATOL)
    (query_vectors,) = reference_vectors(reference, processor.process_queries(QUERIES[:1]))
    q = torch.from_numpy(query_vectors)
    scores = [float(processor.score_multi_vector([q], [torch.from_numpy(w)])[0, 0]) for w in wants]
    assert [item["index"] for item in ranked.json()["items"]] == sorted(range(3), key=lambda i: -scores[i])

    with Client(colsmol_server, timeout_s=120) as client:
        through_sdk = client.encode(card.id, images=files, outputs=["multivector"])
        sdk_ranking = client.score(card.id, QUERIES[0], [SdkImage(f) for f in files])
    assert through_sdk.multivector is not None
    for got, want in zip(through_sdk.multivector, wants):
        np.testing.assert_allclose(got, want, atol=ATOL)
    assert [s.index for s in sdk_ranking] == [item["index"] for item in ranked.json()["items"]]
