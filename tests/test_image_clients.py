"""Images through shoal's clients, against one server of a tiny random-weight CLIP over real HTTP:
the SDK (sync and async, msgpack and JSON, paths, bytes, file objects, PIL images and arrays,
bulk in chunks with a progress bar, score with image queries and documents, extract's zero-shot
image labels), the batch CLI
(`shoal encode MODEL --images DIR`, against the server and in process), LangChain's
`embed_image` and LlamaIndex's `MultiModalEmbedding` with the real libraries.

Random weights make "finds the right image" meaningless, so every vector (and every image's labels)
is checked against the server's own for the same file, sent by hand as base64 JSON; a retrieval
check only asks that an image finds itself (cosine 1).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from shoal.cli import main
from shoal.sdk import AsyncClient, Client, Image, bulk
from shoal.sdk.images import png_of

CLIP_ID = "test/clip-clients"
ATOL = 1e-5
# Under --images DIR, sorted by path: subfolders too; notes.txt and .hidden.png are not images of it.
NAMES = ["a.jpg", "b.png", "c.bmp", "g.gif", "sub/d.png", "sub/deep/f.png", "sub/e.png"]
LABELS = ["cat", "dog", "bird"]  # words of the tokenizer's vocabulary, so each label's prompt differs


@pytest.fixture(scope="module")
def clip(serve, tmp_path_factory) -> tuple[str, Path]:
    """(base URL, cards folder) of one server of a tiny random-weight CLIP (tests/vision_models.py)."""
    pytest.importorskip("transformers")
    from vision_models import tiny_clip

    directory, cards = tmp_path_factory.mktemp("clip-clients"), tmp_path_factory.mktemp("clip-clients-cards")
    card = tiny_clip(directory, model_id=CLIP_ID, words=LABELS, extract=True).card
    (cards / "clip-clients.yaml").write_text(json.dumps(card))  # JSON is YAML
    return serve(preload=(CLIP_ID,), cards_dirs=(cards,)), cards


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    """A folder of seven small noise images in four formats, two levels of subfolders, and two
    files that are not its images (a text file, a hidden PNG)."""
    root = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(7)
    for i, name in enumerate(NAMES):
        size = (24 + 4 * i, 40 - 2 * i) if name != "sub/d.png" else (28, 38)  # d.png: b.png's size
        pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        PILImage.fromarray(pixels).save(root / name)
    (root / "notes.txt").write_text("not an image")
    PILImage.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / ".hidden.png")
    return root


def server_encode(url: str, items: list[dict]) -> np.ndarray:
    r = httpx.post(f"{url}/v1/encode", json={"model": CLIP_ID, "items": items}, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray([item["dense"] for item in r.json()["items"]], dtype=np.float32)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.fixture(scope="module")
def reference(clip, pictures) -> dict[str, np.ndarray]:
    """The server's own vector of each picture, its file sent by hand as base64 JSON."""
    vectors = server_encode(clip[0], [{"image": b64((pictures / name).read_bytes())} for name in NAMES])
    assert len({tuple(np.round(v, 4)) for v in vectors}) == len(NAMES)  # every file embeds apart
    return dict(zip(NAMES, vectors))


def rows(reference: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.stack([reference[name] for name in names])


class Recording(httpx.AsyncBaseTransport):
    """httpx's own transport, keeping each request's body."""

    def __init__(self) -> None:
        self.transport = httpx.AsyncHTTPTransport()
        self.bodies: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(await request.aread())
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self.transport.aclose()


# --- SDK ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_sync_encode_of_paths_bytes_and_file_objects_equals_the_servers_vectors_raw_in_msgpack_base64_in_json(
    clip, pictures, reference, format
):
    names = ["a.jpg", "b.png", "c.bmp", "sub/d.png"]
    files = [(pictures / name).read_bytes() for name in names]
    recording = Recording()
    with Client(clip[0], format=format, transport=recording) as client:
        sources = [str(pictures / "a.jpg"), pictures / "b.png", files[2], io.BytesIO(files[3])]
        out = client.encode(CLIP_ID, images=sources)
    np.testing.assert_allclose(out.dense, rows(reference, names), atol=ATOL)
    assert out.num_tokens == 4 * 17  # the card's image_tokens each
    [body] = recording.bodies
    if format == "msgpack":
        sent = [item["image"] for item in msgspec.msgpack.decode(body)["items"]]
        assert sent == files  # the files' bytes as msgpack bin, not base64
    else:
        sent = [item["image"] for item in json.loads(body)["items"]]
        assert sent == [b64(f) for f in files]


def test_async_encode_of_pil_images_and_uint8_arrays_embeds_their_pixels_as_the_server_embeds_the_files(
    clip, pictures, reference
):
    png = pictures / "b.png"
    pixels = np.asarray(PILImage.open(png).convert("RGB"))
    same_size = [np.asarray(PILImage.open(pictures / n).convert("RGB")) for n in ("b.png", "sub/d.png")]
    assert same_size[0].shape == same_size[1].shape

    async def main_():
        async with AsyncClient(clip[0]) as client:
            pil = await client.encode(CLIP_ID, images=[PILImage.open(pictures / "a.jpg"), PILImage.open(png)])
            arrays = await client.encode(CLIP_ID, images=[pixels, Image(pixels[:, :, ::-1][:, :, ::-1])])
            stacked = await client.encode(CLIP_ID, images=np.stack(same_size))  # [2, H, W, 3]: two images
        return pil, arrays, stacked

    pil, arrays, stacked = asyncio.run(main_())
    # PNG is lossless and a JPEG decodes to the same pixels in the client's PIL and the server's.
    np.testing.assert_allclose(pil.dense, rows(reference, ["a.jpg", "b.png"]), atol=ATOL)
    np.testing.assert_allclose(arrays.dense, rows(reference, ["b.png", "b.png"]), atol=ATOL)
    np.testing.assert_allclose(stacked.dense, rows(reference, ["b.png", "sub/d.png"]), atol=ATOL)


def test_bulk_image_encode_keeps_order_in_chunks_of_batch_size_with_a_progress_bar_of_images(
    clip, pictures, reference, capsys
):
    recording = Recording()
    with Client(clip[0], transport=recording) as client:
        out = client.encode(
            CLIP_ID, images=[pictures / n for n in NAMES], batch_size=2, concurrency=3, show_progress=True
        )
    np.testing.assert_allclose(out.dense, rows(reference, NAMES), atol=ATOL)
    sizes = [len(msgspec.msgpack.decode(body)["items"]) for body in recording.bodies]
    assert sorted(sizes) == [1, 2, 2, 2]
    bar = capsys.readouterr().err
    assert "7/7" in bar and "image" in bar


def test_requests_of_images_end_before_4_mib_of_files_and_a_larger_file_goes_alone():
    mib = 2**20
    images = [Image(bytes(n)) for n in (3 * mib, mib // 2, mib // 2, 5 * mib, 1000, 1000, 1000)]
    chunks = bulk.chunks_of(images, 2, max_chunk_bytes=bulk.IMAGE_BYTES_PER_REQUEST, num_bytes=Image.num_bytes)
    assert [[len(image.source) for image in chunk] for chunk in chunks] == [  # type: ignore[arg-type]
        [3 * mib, mib // 2],
        [mib // 2],
        [5 * mib],
        [1000, 1000],
        [1000],
    ]


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_score_takes_image_queries_and_documents_and_ranks_as_the_server_does(clip, pictures, format):
    a, b = (pictures / "a.jpg").read_bytes(), (pictures / "b.png").read_bytes()
    by_hand = httpx.post(
        f"{clip[0]}/v1/score",
        json={
            "model": CLIP_ID,
            "query": {"image": b64(a)},
            "items": [{"text": "cat"}, {"image": b64(b)}, {"image": b64(a)}],
        },
        timeout=60,
    ).json()["items"]
    text_query = httpx.post(
        f"{clip[0]}/v1/score",
        json={"model": CLIP_ID, "query": "dog", "items": [{"image": b64(b)}, {"image": b64(a)}]},
        timeout=60,
    ).json()["items"]
    with Client(clip[0], format=format) as client:
        ranking = client.score(CLIP_ID, Image(pictures / "a.jpg"), ["cat", Image(b), Image(str(pictures / "a.jpg"))])
        texts_to_images = client.score(CLIP_ID, "dog", [Image(b), Image(io.BytesIO(a))])
    assert [s.index for s in ranking] == [item["index"] for item in by_hand]
    np.testing.assert_allclose([s.score for s in ranking], [item["score"] for item in by_hand], atol=ATOL)
    assert ranking[0].index == 2  # the query's own file: cosine 1, times CLIP's logit scale
    assert [(s.index, round(s.score, 5)) for s in texts_to_images] == [
        (item["index"], round(item["score"], 5)) for item in text_query
    ]


def labelled(items: list) -> list[list[tuple[str, float]]]:
    """(label, score) pairs of each item, best first: the server's JSON items or the SDK's."""
    rows = [item["labels"] if isinstance(item, dict) else item.labels for item in items]
    return [[(s["label"], s["score"]) if isinstance(s, dict) else (s.label, s.score) for s in row] for row in rows]


@pytest.mark.parametrize("format", ["msgpack", "json"])
def test_extract_labels_images_as_the_server_labels_their_files_sync_and_async_raw_in_msgpack_base64_in_json(
    clip, pictures, format
):
    names = ["a.jpg", "b.png", "c.bmp", "sub/d.png"]
    files = [(pictures / name).read_bytes() for name in names]
    by_hand = httpx.post(
        f"{clip[0]}/v1/extract",
        json={"model": CLIP_ID, "items": [{"image": b64(f)} for f in files], "labels": LABELS},
        timeout=60,
    )
    assert by_hand.status_code == 200, by_hand.text
    want = labelled(by_hand.json()["items"])
    assert len({tuple(np.round([score for _, score in row], 4)) for row in want}) == len(names)  # each file apart

    recording = Recording()
    with Client(clip[0], format=format, transport=recording) as client:
        sync = client.extract(
            CLIP_ID, images=[pictures / name for name in names], labels=LABELS, batch_size=3, concurrency=1
        )
    sources = [files[0], io.BytesIO(files[1]), PILImage.open(pictures / "c.bmp"), Image(pictures / "sub/d.png")]

    async def main_():
        async with AsyncClient(clip[0], format=format) as client:
            return await client.extract(CLIP_ID, images=sources, labels=LABELS)

    for got in (sync, asyncio.run(main_())):
        assert [[label for label, _ in row] for row in labelled(got)] == [[label for label, _ in row] for row in want]
        np.testing.assert_allclose(
            [[score for _, score in row] for row in labelled(got)], [[p for _, p in row] for row in want], atol=ATOL
        )
        assert all(item.entities is None for item in got)
    decode = msgspec.msgpack.decode if format == "msgpack" else json.loads
    sent = [item["image"] for body in recording.bodies for item in decode(body)["items"]]
    assert [len(decode(body)["items"]) for body in recording.bodies] == [3, 1]  # batch_size 3, one at a time
    assert sent == (files if format == "msgpack" else [b64(f) for f in files])


def refuses_without_sending():
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a request was sent: {request.url}")

    return Client("http://shoal.invalid", transport=httpx.MockTransport(handler), max_retries=0)


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda c, p: c.encode(CLIP_ID, ["cat"], images=[p]), ValueError, "texts or images, not both in one call"),
        (lambda c, p: c.encode(CLIP_ID), TypeError, "encode needs texts (a list of strings) or images"),
        (lambda c, p: c.encode(CLIP_ID, images=str(p)), TypeError, "not one str: pass [image]"),
        (lambda c, p: c.encode(CLIP_ID, images=np.zeros((4, 4, 3), np.uint8)), TypeError, "pass [image]"),
        (lambda c, p: c.encode(CLIP_ID, images=[p, 3]), TypeError, "images[1]: an image is a file path"),
        (lambda c, p: c.encode(CLIP_ID, images=["https://x/cat.png"]), ValueError, "images[0]: Image takes a file"),
        (lambda c, p: c.encode(CLIP_ID, images=[p.parent / "missing.png"]), FileNotFoundError, "missing.png"),
        (lambda c, p: c.encode(CLIP_ID, images=[np.zeros((4, 4, 3))]), TypeError, "must be uint8, not float64"),
        (lambda c, p: c.encode(CLIP_ID, images=[np.zeros((4, 4, 2), np.uint8)]), ValueError, "[H, W, 3]"),
        (lambda c, p: c.score(CLIP_ID, "cat", [p.read_bytes()]), TypeError, "documents[0] is bytes: score takes"),
        (lambda c, p: c.score(CLIP_ID, p, ["cat"]), TypeError, "query is PosixPath"),
        (lambda c, p: c.extract(CLIP_ID, ["a"], LABELS, images=[p]), ValueError, "extract takes texts or images, not"),
        (
            lambda c, p: c.extract(CLIP_ID, labels=LABELS),
            TypeError,
            "extract needs texts (a list of strings) or images",
        ),
        (lambda c, p: c.extract(CLIP_ID, images=[p, 3], labels=LABELS), TypeError, "images[1]: an image is a file"),
    ],
)
def test_unclear_or_broken_image_calls_raise_before_anything_is_sent(pictures, call, error, fragment):
    with refuses_without_sending() as client, pytest.raises(error) as raised:
        call(client, pictures / "b.png")
    assert fragment in str(raised.value), raised.value


def test_png_of_writes_gray_rgb_and_rgba_arrays_that_pillow_reads_back_exactly():
    rng = np.random.default_rng(0)
    for shape, mode in [((5, 7), "L"), ((6, 9, 3), "RGB"), ((4, 3, 4), "RGBA"), ((3, 2, 1), "L")]:
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        read = PILImage.open(io.BytesIO(png_of(pixels)))
        assert read.format == "PNG" and read.mode == mode
        np.testing.assert_array_equal(np.asarray(read), pixels.reshape(read.height, read.width, -1).squeeze())
    strided = rng.integers(0, 256, (8, 10, 3), dtype=np.uint8)[::2, ::-1]  # not contiguous
    np.testing.assert_array_equal(np.asarray(PILImage.open(io.BytesIO(png_of(strided)))), strided)


def test_the_sdk_sends_paths_bytes_and_arrays_without_importing_pil(tmp_path):
    (tmp_path / "x.png").write_bytes(png_of(np.full((4, 4, 3), 9, np.uint8)))
    code = f"""
import sys, httpx, msgspec
from shoal.sdk import Client
from shoal.wire import array_to_msgpack
import numpy as np
seen = []
def answer(request):
    items = msgspec.msgpack.decode(request.content)["items"]
    seen.extend(item["image"][:4] for item in items)
    dense = [{{"id": None, "dense": array_to_msgpack(np.zeros(2, np.float32))}} for _ in items]
    body = {{"model": "m", "items": dense, "usage": {{"tokens": 1}},
            "timings": {{"tokenize_ms": 0, "queue_ms": 0, "inference_ms": 0, "total_ms": 0}}}}
    return httpx.Response(200, content=msgspec.msgpack.encode(body), headers={{"content-type": "application/msgpack"}})
with Client("http://shoal.invalid", transport=httpx.MockTransport(answer)) as client:
    client.encode("m", images=[{str(tmp_path / "x.png")!r}, b"\\x89PNGbytes", np.zeros((3, 3, 3), np.uint8)])
print(seen == [b"\\x89PNG"] * 3, sorted(m for m in sys.modules if m.split(".")[0] == "PIL"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True []"


# --- the batch CLI --------------------------------------------------------------------------------


def test_cli_encodes_an_image_folder_recursively_sorted_against_the_server_and_in_process(
    clip, pictures, reference, tmp_path, capsys
):
    url, cards = clip
    out = tmp_path / "vectors.jsonl"
    assert main(["encode", CLIP_ID, "--images", str(pictures), "--url", url, "-o", str(out), "--batch-size", "3"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["image"] for row in written] == NAMES and set(written[0]) == {"image", "dense"}
    np.testing.assert_allclose([row["dense"] for row in written], rows(reference, NAMES), atol=ATOL)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"shoal encode: 7 items, {7 * 17} tokens")

    assert main(["encode", CLIP_ID, "--images", str(pictures), "--url", url, "-o", str(tmp_path / "v.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), rows(reference, NAMES), atol=ATOL)

    table = tmp_path / "vectors.parquet"
    in_process = ["encode", CLIP_ID, "--images", str(pictures), "--models-dirs", str(cards), "-o", str(table)]
    assert main([*in_process, "--batch-size", "4", "--no-allow-download"]) == 0
    columns = pq.read_table(table).to_pydict()
    assert columns["image"] == NAMES
    np.testing.assert_allclose(columns["dense"], rows(reference, NAMES), atol=ATOL)


def test_cli_refuses_images_with_texts_and_a_folder_without_images(clip, pictures, tmp_path, capsys):
    url = clip[0]
    assert main(["encode", CLIP_ID, "a cat", "--images", str(pictures), "--url", url]) == 2
    assert "--images DIR encodes the image files in DIR: give no texts" in capsys.readouterr().err
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.md").write_text("no pictures")
    assert main(["encode", CLIP_ID, "--images", str(tmp_path / "empty"), "--url", url]) == 2
    assert "no image files (.png, .jpg" in capsys.readouterr().err


# --- LangChain and LlamaIndex ---------------------------------------------------------------------


def test_langchain_embed_image_and_its_text_methods_equal_the_servers_vectors(clip, pictures, reference):
    from shoal.integrations.langchain import ShoalEmbeddings

    embeddings = ShoalEmbeddings(url=clip[0], model=CLIP_ID, batch_size=3)
    uris = [str(pictures / name) for name in NAMES]
    np.testing.assert_allclose(embeddings.embed_image(uris), rows(reference, NAMES), atol=ATOL)
    np.testing.assert_allclose(asyncio.run(embeddings.aembed_image(uris[:2])), rows(reference, NAMES[:2]), atol=ATOL)
    assert embeddings.embed_image([]) == []
    texts = server_encode(clip[0], [{"text": "cat"}, {"text": "dog cat"}])
    np.testing.assert_allclose(embeddings.embed_documents(["cat", "dog cat"]), texts, atol=ATOL)
    np.testing.assert_allclose(embeddings.embed_query("cat"), texts[0], atol=ATOL)


def test_llamaindex_multimodal_embedding_batches_images_through_get_image_embedding_batch(
    clip, pictures, reference, monkeypatch
):
    from llama_index.core.embeddings import MultiModalEmbedding

    from shoal.integrations.llamaindex import ShoalMultiModalEmbedding

    embedding = ShoalMultiModalEmbedding(url=clip[0], model=CLIP_ID, embed_batch_size=3)
    assert isinstance(embedding, MultiModalEmbedding)
    batches: list[int] = []
    batched = ShoalMultiModalEmbedding._get_image_embeddings

    def spy(self, img_file_paths):
        batches.append(len(img_file_paths))
        return batched(self, img_file_paths)

    monkeypatch.setattr(ShoalMultiModalEmbedding, "_get_image_embeddings", spy)
    paths = [str(pictures / name) for name in NAMES]
    np.testing.assert_allclose(embedding.get_image_embedding_batch(paths), rows(reference, NAMES), atol=ATOL)
    assert batches == [3, 3, 1]  # LlamaIndex cut the batches and shoal sent each as one request
    together = asyncio.run(embedding.aget_image_embedding_batch(paths))
    np.testing.assert_allclose(together, rows(reference, NAMES), atol=ATOL)
    one = embedding.get_image_embedding(io.BytesIO((pictures / "c.bmp").read_bytes()))
    np.testing.assert_allclose(one, reference["c.bmp"], atol=ATOL)
    texts = server_encode(clip[0], [{"text": "cat"}])
    np.testing.assert_allclose(embedding.get_text_embedding("cat"), texts[0], atol=ATOL)
    np.testing.assert_allclose(embedding.get_query_embedding("cat"), texts[0], atol=ATOL)


def test_llamaindex_multimodal_index_embeds_image_nodes_with_shoal_and_an_image_finds_itself(clip, pictures):
    from llama_index.core.indices import MultiModalVectorStoreIndex
    from llama_index.core.schema import ImageNode, TextNode

    from shoal.integrations.llamaindex import ShoalMultiModalEmbedding

    embedding = ShoalMultiModalEmbedding(url=clip[0], model=CLIP_ID, embed_batch_size=4)
    # A node without text is skipped by the index: each names its file.
    nodes = [ImageNode(text=name, image_path=str(pictures / name), id_=name) for name in NAMES]
    index = MultiModalVectorStoreIndex(
        [*nodes, TextNode(text="cat", id_="text")], embed_model=embedding, image_embed_model=embedding
    )
    retriever = index.as_retriever(similarity_top_k=1, image_similarity_top_k=2)
    for name in ("c.bmp", "sub/e.png"):
        found = retriever.image_to_image_retrieve(str(pictures / name))
        assert found[0].node.node_id == name and found[0].score == pytest.approx(1.0, abs=1e-4)
    assert retriever.text_retrieve("cat")[0].node.node_id == "text"
