"""A Python client of a shoal server, torch-free: `pip install 'shoal[sdk]'`.

    from shoal.sdk import Client
    with Client("http://127.0.0.1:8080") as client:
        vectors = client.encode("sentence-transformers/all-MiniLM-L6-v2", texts).dense   # [n, 384]
        pictures = client.encode("openai/clip-vit-base-patch32", images=["cat.jpg", png_bytes]).dense
        ranking = client.score("openai/clip-vit-base-patch32", "a cat", [Image("cat.jpg"), Image(array)])

    client      AsyncClient: the one implementation (encode, score, extract, models, model)
    sync        Client: the same methods, blocking; runs AsyncClient on a private event loop
    http        the pooled connection: formats, auth, retries with back-off under the deadline
    images      Image: an image input (file path, bytes, file object, PIL image, uint8 array)
    bulk        many items as chunks of batch_size, `concurrency` at a time, order kept
    results     Encoded, Sparse, Ranking of Scored(index, score); extract gives calls.ExtractedItem

Errors raise as the server's own classes from `shoal.errors` (`Overloaded`, `UnknownModel`,
`InvalidRequest`, ...), rebuilt from the error body's code.
"""

from __future__ import annotations

from ..calls import Entity, ExtractedItem, FieldValue, LabelScore, Relation, RelationSpan
from .client import AsyncClient
from .images import Image
from .results import Encoded, Ranking, Scored, Sparse
from .sync import Client

__all__ = [
    "AsyncClient",
    "Client",
    "Encoded",
    "Entity",
    "ExtractedItem",
    "FieldValue",
    "Image",
    "LabelScore",
    "Ranking",
    "Relation",
    "RelationSpan",
    "Scored",
    "Sparse",
]
