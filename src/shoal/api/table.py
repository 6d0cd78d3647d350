"""The route table: every operation the app serves, listed once.

`create_app` builds its Starlette routes from `ROUTES` and `openapi.describe` builds the OpenAPI
document from it, so the two cannot disagree. A row is one operation, a path and a method:

    path       Starlette's pattern; `{name:path}` takes the rest of the path (model ids contain `/`)
    name       the route's name: the `route` label of its request metrics
    summary    the operation's summary in the document
    tag        the family the document lists it under (a key of `TAGS`)
    handler    a verb's handler (`routes`, `tei`): takes a `routes.Context` and runs inside
               `app.endpoint`, which checks auth, reads the body, picks the formats, maps errors and
               records the metrics and the timing header
    plain      or a handler served as it is (`plain`: probes, metrics, the document itself)
    request    the body type the handler decodes (a msgspec type; a tuple: any one of them);
               None: the route reads no body
    response   the 200 body's type (a tuple: any one of them); None: not JSON, or empty
    media      the 200 body's media type when `response` is None
    admin      needs a token with the admin scope
    verb       the verb of the call it makes (a `verbs.KINDS` verb); None for the routes that make
               none (models, probes, /tokenize, /decode) and TEI's root, which makes one of several

The order is the app's match order (Starlette takes the first route whose path and method match)
and the document's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from starlette.requests import Request
from starlette.responses import Response

from .. import wire
from ..service import Token
from . import chat, peers, plain, routes, tei

# A verb's handler: the decoded request's answer (a wire Struct, or a bare list as TEI answers).
Handler: TypeAlias = Callable[[routes.Context], Awaitable[object]]
# A handler served as it is, outside `app.endpoint`.
Plain: TypeAlias = Callable[[Request], Awaitable[Response]]
# A body's type as msgspec reads it (for the schema), or a tuple of them: any one of them.
Schema: TypeAlias = type[object] | tuple[type[object], ...]
# An open JSON object (/v1/models entries, TEI's /info): msgspec's schema of it is {"type": "object"}.
OPEN_OBJECT: type[object] = dict[str, Any]


# The families the document groups the routes in: its `tags`, in this order, each with what it says.
TAGS: dict[str, str] = {
    "native": "shoal's own verbs: encode (dense, sparse and multi-vector outputs), score (rerank) and extract "
    "(entities, zero-shot labels); in msgpack, arrays travel as their raw little-endian bytes.",
    "OpenAI": "OpenAI's embeddings and chat completions APIs: the `openai` client, LangChain's OpenAIEmbeddings "
    "and the like.",
    "Cohere": "Cohere's embed and rerank APIs, v1 and v2 (`/v1/rerank` also reads Jina's rerank request).",
    "TEI": "Hugging Face text-embeddings-inference's routes. Their bodies name no model: `?model=ID` or the "
    "`X-Shoal-Model` header names one, else the server's default model for the verb serves. `/rerank` also "
    "reads Infinity's and vLLM's body (`documents`), and `POST /` the Hugging Face Inference API's token, "
    "zero-shot and text classification bodies.",
    "Infinity/vLLM": "Routes of Infinity and vLLM that shoal's others lack: `/embeddings` (OpenAI's body without "
    "`/v1`), Infinity's `/classify` and vLLM's `/score` (vLLM's `/v1/score` is shoal's native score here).",
    "models": "The models this server serves, in OpenAI's list shape with shoal's fields (tasks, outputs, "
    "dimensions, state).",
    "admin": "Load, unload, pin and unpin a model: tokens with the admin scope.",
    "operations": "Probes, metrics, and this document.",
}


@dataclass(frozen=True)
class RouteSpec:
    """One operation of the HTTP API (the module's docstring says what each field is)."""

    path: str
    method: Literal["GET", "POST"]
    name: str
    summary: str
    tag: str
    handler: Handler | None = None
    plain: Plain | None = None
    request: Schema | None = None
    response: Schema | None = None
    media: str = "application/json"
    admin: bool = False
    verb: Literal["encode", "score", "extract", "generate"] | None = None

    def __post_init__(self) -> None:
        if self.tag not in TAGS:
            raise TypeError(f"route {self.method} {self.path}: tag {self.tag!r} is none of {', '.join(TAGS)}")
        if (self.handler is None) == (self.plain is None):
            raise TypeError(f"route {self.method} {self.path}: give exactly one of `handler` and `plain`")
        if self.plain is not None and (self.request is not None or self.admin):
            raise TypeError(f"route {self.method} {self.path}: a plain route reads no body and checks no token")

    @property
    def reads_body(self) -> bool:
        return self.request is not None


_TEI_PREDICT_RESPONSE = (list[wire.tei.Prediction], list[list[wire.tei.Prediction]])
_TEI_ROOT_REQUEST = (
    wire.tei.EmbedRequest,
    wire.tei.SimilarityRequest,
    wire.tei.RerankRequest,
    wire.tei.PredictRequest,
    wire.hf.TokenClassificationRequest,
    wire.hf.ZeroShotRequest,
    wire.hf.TextClassificationRequest,
)
_TEI_ROOT_RESPONSE = (
    list[list[float]],
    list[float],
    list[wire.tei.Rank],
    *_TEI_PREDICT_RESPONSE,
    list[wire.hf.TokenEntity],
    list[wire.hf.LabelScore],
    list[list[wire.hf.LabelScore]],
)

# One row per route, read as a table (the formatter would give each argument its own line).
# fmt: off
ROUTES: tuple[RouteSpec, ...] = (
    # Native verbs (wire/native.py).
    RouteSpec("/v1/encode", "POST", "encode", "Encode texts: dense, sparse and multi-vector outputs", "native",
              routes.encode, request=wire.EncodeRequest, response=wire.EncodeResponse, verb="encode"),
    RouteSpec("/v1/score", "POST", "score", "Score documents against a query (rerank)", "native",
              routes.score, request=wire.ScoreRequest, response=wire.ScoreResponse, verb="score"),
    RouteSpec("/v1/extract", "POST", "extract", "Extract entities or zero-shot labels", "native",
              routes.extract, request=wire.ExtractRequest, response=wire.ExtractResponse, verb="extract"),
    # OpenAI (wire/openai.py), Cohere and Jina (wire/cohere.py, wire/cohere_embed.py).
    RouteSpec("/v1/embeddings", "POST", "embeddings", "OpenAI-compatible embeddings", "OpenAI",
              routes.embeddings, request=wire.EmbeddingsRequest, response=wire.EmbeddingsResponse, verb="encode"),
    RouteSpec("/v1/chat/completions", "POST", "chat_completions", "OpenAI-compatible chat completions on a "
              "generating model: response_format json_schema / json_object, streamed as server-sent events with "
              "`stream`", "OpenAI", chat.chat_completions, request=wire.openai_chat.ChatRequest,
              response=wire.openai_chat.ChatResponse, verb="generate"),
    RouteSpec("/v1/rerank", "POST", "rerank", "Cohere v1 (and Jina) rerank", "Cohere",
              routes.rerank, request=wire.cohere.RerankRequest, response=wire.cohere.RerankResponse, verb="score"),
    RouteSpec("/v2/rerank", "POST", "rerank_v2", "Cohere v2 rerank", "Cohere",
              routes.rerank_v2, request=wire.cohere.RerankV2Request, response=wire.cohere.RerankV2Response,
              verb="score"),
    RouteSpec("/v1/embed", "POST", "cohere_embed_v1", "Cohere v1 embed", "Cohere",
              routes.cohere_embed_v1, request=wire.cohere_embed.EmbedRequest,
              response=(wire.cohere_embed.EmbedFloatsResponse, wire.cohere_embed.EmbedByTypeResponse),
              verb="encode"),
    RouteSpec("/v2/embed", "POST", "embed_v2", "Cohere v2 embed", "Cohere",
              routes.embed_v2, request=wire.cohere_embed.EmbedV2Request,
              response=wire.cohere_embed.EmbedByTypeResponse, verb="encode"),
    # TEI, text-embeddings-inference (wire/tei.py): bodies name no model (api/tei.py).
    RouteSpec("/rerank", "POST", "tei_rerank", "TEI rerank (`texts`), or Infinity's and vLLM's (`documents`)",
              "TEI", peers.rerank, request=(wire.tei.RerankRequest, wire.infinity.RerankRequest),
              response=(list[wire.tei.Rank], wire.infinity.RerankResponse), verb="score"),
    RouteSpec("/embed", "POST", "tei_embed", "TEI embed", "TEI",
              tei.embed, request=wire.tei.EmbedRequest, response=list[list[float]], verb="encode"),
    RouteSpec("/embed_all", "POST", "tei_embed_all", "TEI token states (unpooled)", "TEI",
              tei.embed_all, request=wire.tei.EmbedSparseRequest, response=list[list[list[float]]], verb="encode"),
    RouteSpec("/tokenize", "POST", "tei_tokenize", "TEI tokenize", "TEI",
              tei.tokenize, request=wire.tei.TokenizeRequest, response=list[list[Token]]),
    RouteSpec("/decode", "POST", "tei_decode", "TEI decode: token ids to text", "TEI",
              tei.decode, request=wire.tei.DecodeRequest, response=list[str]),
    RouteSpec("/embed_sparse", "POST", "tei_embed_sparse", "TEI sparse embed", "TEI",
              tei.embed_sparse, request=wire.tei.EmbedSparseRequest, response=list[list[wire.tei.SparseValue]],
              verb="encode"),
    RouteSpec("/similarity", "POST", "tei_similarity", "TEI sentence similarity", "TEI",
              tei.similarity, request=wire.tei.SimilarityRequest, response=list[float], verb="encode"),
    RouteSpec("/predict", "POST", "tei_predict", "TEI predict: a text classifier's labels for a text, a pair or a "
              "batch", "TEI", tei.predict, request=wire.tei.PredictRequest, response=_TEI_PREDICT_RESPONSE,
              verb="extract"),
    RouteSpec("/", "POST", "tei_root",
              "TEI's root: embed, similarity, rerank or predict, or a Hugging Face token, zero-shot or text "
              "classification, by the body", "TEI", tei.root, request=_TEI_ROOT_REQUEST, response=_TEI_ROOT_RESPONSE),
    RouteSpec("/info", "GET", "tei_info", "TEI model info", "TEI", tei.info, response=OPEN_OBJECT),
    # Infinity and vLLM (wire/openai.py, wire/vllm.py): the routes the families above lack.
    RouteSpec("/embeddings", "POST", "embeddings_unprefixed", "OpenAI-compatible embeddings without `/v1` "
              "(Infinity's path)", "Infinity/vLLM", routes.embeddings, request=wire.EmbeddingsRequest,
              response=wire.EmbeddingsResponse, verb="encode"),
    RouteSpec("/classify", "POST", "infinity_classify", "Infinity's classify: a text classifier's labels for "
              "each text", "Infinity/vLLM", peers.infinity_classify, request=wire.infinity.ClassifyRequest,
              response=wire.infinity.ClassifyResponse, verb="extract"),
    RouteSpec("/score", "POST", "vllm_score", "vLLM's score: text_1 against text_2", "Infinity/vLLM",
              peers.vllm_score, request=wire.vllm.ScoreRequest, response=wire.vllm.ScoreResponse, verb="score"),
    # Models (OpenAI's list shape, and shoal's admin actions).
    RouteSpec("/v1/models", "GET", "models", "The models this server serves (OpenAI list shape)", "models",
              routes.models, response=OPEN_OBJECT),
    RouteSpec("/v1/models/{model_path:path}", "GET", "model", "One model (ids contain `/`)", "models",
              routes.model, response=OPEN_OBJECT),
    RouteSpec("/v1/models/{model_path:path}", "POST", "model_admin",
              "Admin: `{id}/load`, `/unload`, `/pin`, `/unpin` (admin scope)", "admin",
              routes.model_admin, response=OPEN_OBJECT, admin=True),
    # Served as they are (api/plain.py).
    RouteSpec("/healthz", "GET", "healthz", "Process up", "operations", plain=plain.healthz),
    RouteSpec("/health", "GET", "health", "Process up (TEI's name)", "TEI", plain=plain.healthz),
    RouteSpec("/", "GET", "root", "Process up (TEI's root)", "TEI", plain=plain.healthz),
    RouteSpec("/readyz", "GET", "readyz", "Engine ready (503 otherwise)", "operations", plain=plain.readyz),
    RouteSpec("/metrics", "GET", "metrics", "Prometheus metrics", "operations", plain=plain.metrics,
              media="text/plain"),
    RouteSpec("/openapi.json", "GET", "openapi", "This document", "operations", plain=plain.openapi_json,
              response=OPEN_OBJECT),
    RouteSpec("/docs", "GET", "docs", "This document, rendered (Swagger UI, served from this server)",
              "operations", plain=plain.docs, media="text/html"),
    RouteSpec("/docs/assets/{name}", "GET", "docs_asset", "Swagger UI's script, stylesheet and icon for /docs",
              "operations", plain=plain.docs_asset, media="*/*"),
)
# fmt: on
