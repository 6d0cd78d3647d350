"""The OpenAPI 3.1 document of the HTTP API (`GET /openapi.json`, rendered at `/docs`), described
from the route table (`api/table.py`) and the wire types themselves.

Each operation names its request and response types (the msgspec types the handlers decode and
encode); `msgspec.json.schema_components` turns them into JSON Schema, so the description cannot
drift from what the server parses, and the app and the document read the same table, so no route
goes undescribed. Operations are grouped by the row's `tag` (the table's `TAGS`, in order).

Two things the types do not carry are written here: what the request fields mean (`FIELDS`, read
onto the generated schemas; `describe` refuses a field its type does not have, so a rename cannot
leave a stale line) and a request body to try per route (`EXAMPLES`). An example names its model
by a placeholder per verb; `with_models` puts in, at request time, a model this server serves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from .. import __version__, wire
from ..service import ModelStatus
from ..wire import JSONObject
from .table import ROUTES, TAGS, RouteSpec, Schema

# `{name}` or `{name:converter}` in a Starlette path.
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")

# --- examples -----------------------------------------------------------------------------------

VERBS = ("encode", "score", "extract", "generate")
# What an example says in place of a model id, until `with_models` names a served one. No JSON
# escape touches these characters, so the encoded document holds them as written.
PLACEHOLDERS = {verb: f"{{{verb} model}}" for verb in VERBS}
# The built-in cards an example names when the server serves no model for the verb.
FALLBACK_MODELS = {
    "encode": "sentence-transformers/all-MiniLM-L6-v2",
    "score": "cross-encoder/ms-marco-MiniLM-L-6-v2",
    "extract": "urchade/gliner_small-v2.1",
    "generate": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

_ENCODER, _SCORER, _EXTRACTOR, _GENERATOR = (PLACEHOLDERS[verb] for verb in VERBS)
_TEXTS = ["Shoal serves small models: embedders, rerankers and extractors.", "The quick brown fox jumps."]
_QUERY = "Which server runs small models?"

# A request body per route name, as a client would send it.
EXAMPLES: dict[str, JSONObject] = {
    "encode": {"model": _ENCODER, "items": [{"id": "a", "text": _TEXTS[0]}, {"id": "b", "text": _TEXTS[1]}]},
    "score": {"model": _SCORER, "query": _QUERY, "items": [{"id": "a", "text": t} for t in _TEXTS], "top_k": 2},
    "extract": {
        "model": _EXTRACTOR,
        "items": [{"id": "a", "text": "Ada Lovelace worked with Charles Babbage in London."}],
        "labels": ["person", "city"],
    },
    "embeddings": {"model": _ENCODER, "input": _TEXTS, "encoding_format": "float"},
    "chat_completions": {
        "model": _GENERATOR,
        "messages": [{"role": "user", "content": "Ada Lovelace was born in London in 1815. Who is this about?"}],
        "temperature": 0,
        "max_completion_tokens": 64,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "person",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                    "required": ["name", "born"],
                    "additionalProperties": False,
                },
            },
        },
    },
    "rerank": {"model": _SCORER, "query": _QUERY, "documents": _TEXTS, "top_n": 2, "return_documents": True},
    "rerank_v2": {"model": _SCORER, "query": _QUERY, "documents": _TEXTS, "top_n": 2},
    "cohere_embed_v1": {"model": _ENCODER, "texts": _TEXTS, "input_type": "search_document"},
    "embed_v2": {"model": _ENCODER, "texts": _TEXTS, "input_type": "search_document", "embedding_types": ["float"]},
    "tei_rerank": {"query": _QUERY, "texts": _TEXTS, "return_text": True},
    "tei_embed": {"inputs": _TEXTS, "normalize": True},
    "tei_embed_all": {"inputs": _TEXTS[0]},
    "tei_tokenize": {"inputs": _TEXTS[0], "add_special_tokens": True},
    "tei_embed_sparse": {"inputs": _TEXTS},
    "tei_similarity": {"inputs": {"source_sentence": _QUERY, "sentences": _TEXTS}},
    "tei_decode": {"ids": [101, 7592, 2088, 102], "skip_special_tokens": True},
    "tei_predict": {"inputs": [[_TEXTS[0]], [_QUERY, _TEXTS[0]]], "raw_scores": False},
    "tei_root": {"inputs": _TEXTS},
    "embeddings_unprefixed": {"model": _ENCODER, "input": _TEXTS},
    "vllm_score": {"model": _SCORER, "text_1": _QUERY, "text_2": _TEXTS},
    # No model: the server's default classifier (the extract example's model may not classify).
    "infinity_classify": {"input": _TEXTS},
}
# Routes whose body takes several shapes: an example of each, by name, with what it is; the first
# is the route's `EXAMPLES` body. They go in the document as `examples` (in place of `example`).
NAMED_EXAMPLES: dict[str, dict[str, tuple[str, JSONObject]]] = {
    "tei_root": {
        "embed": ("TEI: embed the texts (the default embedder)", EXAMPLES["tei_root"]),
        "zero_shot": (
            "Hugging Face zero-shot classification: every candidate label's score, best first, from an NLI "
            "(zero_shot), GLiClass or GLiNER2 model",
            {
                "inputs": "The striker scored twice as the home team won the league.",
                "parameters": {"candidate_labels": ["sports", "politics", "economy"], "multi_label": False},
            },
        ),
        "text_classification": (
            "Hugging Face text classification: a classifier's labels, best first",
            {"inputs": _TEXTS[0], "parameters": {"top_k": 2}},
        ),
    },
}
# An answer per route name, where the answer's schema says little (an open object).
RESPONSE_EXAMPLES: dict[str, JSONObject] = {
    "tei_info": {
        "model_id": "distilbert/distilbert-base-uncased-finetuned-sst-2-english",
        "model_sha": None,
        "model_dtype": "float32",
        "served_model_name": "distilbert/distilbert-base-uncased-finetuned-sst-2-english",
        "model_type": {
            "classifier": {"id2label": {"0": "NEGATIVE", "1": "POSITIVE"}, "label2id": {"NEGATIVE": 0, "POSITIVE": 1}}
        },
        "max_concurrent_requests": 1000,
        "max_input_length": 512,
        "max_batch_tokens": 16384,
        "max_batch_requests": None,
        "max_client_batch_size": 2048,
        "auto_truncate": False,
        "tokenization_workers": 2,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    },
}
# A path parameter's example, by route name.
_PATH_EXAMPLES = {"model": _ENCODER, "model_admin": f"{_ENCODER}/load", "docs_asset": "swagger-ui.css"}


def example_models(statuses: Sequence[ModelStatus], default: str | None = None) -> dict[str, str]:
    """The model each verb's examples name: the server's default model if it serves the verb, else
    the first loaded model that does, else the first served model that does, else a built-in card."""
    models: dict[str, str] = {}
    for verb in VERBS:
        serving = [s for s in statuses if verb in s.tasks]
        defaults = [s for s in serving if default is not None and default in (s.id, *s.aliases)]
        choices = defaults or [s for s in serving if s.loaded] or serving
        models[verb] = choices[0].id if choices else FALLBACK_MODELS[verb]
    return models


def with_models(document: bytes, models: Mapping[str, str]) -> bytes:
    """The encoded document with each verb's placeholder replaced by `models[verb]`."""
    for verb, placeholder in PLACEHOLDERS.items():
        document = document.replace(placeholder.encode(), msgspec.json.encode(models[verb])[1:-1])
    return document


# --- what the request fields mean ---------------------------------------------------------------

_MODEL = "A model id or alias this server serves (`GET /v1/models` lists them)."
_ITEM_ID = "Any string or int64, echoed with the item's result (`null` when absent)."
_TIMEOUT = "This request's deadline in seconds; work still queued then is dropped and the answer is 504."
_ADAPTER = "A LoRA adapter of the model (`GET /v1/models/{id}` lists them)."
_TEI_INPUTS = "A text, or a list of texts."
_TEI_TRUNCATE = "Cut a text longer than the model takes (false, TEI's default: such a text is a 422)."
_TEI_DIRECTION = "Only right truncation is served: `Left` is a 400."
_PROMPT_NAME = "Prepend the card's prompt of this name (`GET /v1/models/{id}` lists its `prompts`)."
_RERANK = {
    "model": _MODEL,
    "query": "The query the documents are ranked against.",
    "documents": "Strings, or objects of string fields ranked by their `text`; echoed whole when returned.",
    "top_n": "Keep the best n results (default: all, ranked).",
    "return_documents": "Echo each document in its result (default false, as Cohere; Jina clients send true).",
    "max_tokens_per_doc": "Cut each document to this many tokens before scoring.",
    "unit_scores": "shoal's own: " + "each relevance_score in 0..1 by its model kind's bound, the ranking kept "
    "(docs/api.md, score scales).",
}
_COHERE_EMBED = {
    "model": _MODEL,
    "texts": "The texts to embed (or `images`, not both).",
    "images": "Images as data:image/...;base64,... URLs; needs `input_type: image`.",
    "input_type": "search_query: the card's query prompt; search_document: its document prompt; "
    "classification, clustering or none: no prompt; image: for `images`.",
    "embedding_types": "Any of float, int8, uint8, binary, ubinary, base64, all from one float32 forward "
    "(default: float).",
    "truncate": "END (default) cuts a long text at the model's max_length, NONE refuses it (422); START is a 400.",
}

# Field descriptions by type: a dict of field name (as on the wire) -> what it means.
FIELDS: dict[type[object], dict[str, str]] = {
    wire.EncodeRequest: {
        "model": _MODEL,
        "items": "What to encode, in order: each a `text` or an `image`.",
        "options": "How to encode; every option has a default.",
        "adapter": _ADAPTER,
    },
    wire.EncodeItem: {"text": "A text to encode.", "id": _ITEM_ID},
    wire.EncodeOptions: {
        "normalize": "L2-normalise each vector, after `dimensions` (default: the card's).",
        "dimensions": "Keep the first N dimensions (Matryoshka), 1 to the model's size.",
        "output_dtype": "float32; float16; int8 (scaled per vector to ±127); ubinary (sign bits packed 8 per "
        "byte); binary (ubinary - 128, as int8).",
        "is_query": "Prepend the card's query prompt (true) or document prompt (false), if it has them.",
        "prompt_name": _PROMPT_NAME + " Overrides `is_query`.",
        "truncate": "Cut a text longer than the model's max_length tokens; false refuses it (422).",
        "outputs": "Any of the card's outputs (dense, sparse, multivector), all from one forward pass "
        "(default: the card's first).",
        "sparse_top_k": "Sparse output: keep the k heaviest terms.",
        "return_tokens": "Sparse output: also return the vocabulary token of each index.",
        "timeout_s": _TIMEOUT,
    },
    wire.ScoreRequest: {
        "model": _MODEL,
        "query": "A text, or `{text}` or `{image}`.",
        "items": "The documents to rank against the query: each a `text` or an `image`.",
        "top_k": "Keep the best k (default: every item, ranked).",
        "options": "How to score; every option has a default.",
        "adapter": _ADAPTER,
    },
    wire.ScoreQuery: {"text": "The query text."},
    wire.ScoreItem: {"text": "A document's text.", "id": _ITEM_ID},
    wire.ScoreOptions: {
        "raw_scores": "Cross-encoders and LLM rerankers: the logit, without the activation.",
        "truncate": "Cut a (query, item) pair longer than the model takes; false refuses it (422).",
        "max_tokens_per_doc": "Cut each item to this many tokens first.",
        "window_overlap_tokens": "Cross-encoders: score a long item as windows overlapping by this many tokens "
        "and keep its best window (default: truncate).",
        "instruction": "LLM rerankers: replaces the card's instruction.",
        "timeout_s": _TIMEOUT,
        "unit_scores": "Each score in 0..1 by its model kind's bound, the ranking kept (docs/api.md, score scales).",
    },
    wire.ExtractRequest: {
        "model": _MODEL,
        "items": "What to read: each a `text`, or an `image` for an image_labels model.",
        "labels": "gliner, zero_shot and image_labels: the entity types or classes (required); token_class and "
        "classify: keep only these of the model's labels.",
        "text_pairs": "classify on a pair classifier: each item's second text, one per item.",
        "schema": 'gliner2: the schema beside the entity types in `labels`: {"entity_descriptions": {type: '
        'text}, "relations": [{type: {"head": "", "tail": ""}}], "relation_descriptions": {type: text}, '
        '"classifications": [{"task", "labels" (a list, or label -> description), "multi_label", '
        '"cls_threshold", "top_k", "class_act", "prompt", "examples"}], "structures": {name: {"fields": [{"name", '
        '"dtype", "choices", "description", "threshold"} or "name::dtype::[a|b]::description"]}}}; each item then '
        "answers `relations`: per type, its instances as {head, tail}, each {text, score, start, end}, and "
        "`structures`: per structure, its records {field: value}. glirel: the entities to relate, "
        '{"entities": [[{"start", "end", "label"}, ...] per item]}.',
        "options": "How to extract; which options apply depends on the model's extract kind.",
        "adapter": _ADAPTER,
    },
    wire.native.ExtractItem: {"text": "A text to read.", "id": _ITEM_ID},
    wire.native.ExtractOptions: {
        "threshold": "The minimum score kept, 0 to 1 (default: the card's; GLiNER 0.5).",
        "flat_ner": "gliner: no overlapping entities (default true).",
        "multi_label": "gliner: a span may carry several labels; zero_shot: each class scored on its own.",
        "max_span_width": "gliner: the widest entity in words, at most the model's.",
        "hypothesis_template": "zero_shot and image_labels: the hypothesis, with `{}` for the class.",
        "aggregation": "token_class: simple, first, max or average (default: the card's).",
        "top_k": "classify: the best this many labels (default: all, best first).",
        "raw_scores": "classify: the logits, without the softmax or sigmoid the model's config implies.",
        "function_to_apply": "classify: softmax, sigmoid or none in place of the function the model's config "
        "implies (transformers' text-classification pipeline's argument).",
        "truncate": "classify: false refuses a text longer than the model takes (422) instead of cutting it.",
        "max_new_tokens": "generate: new tokens per record at most (default: the card's generate.max_new_tokens).",
        "timeout_s": _TIMEOUT,
    },
    wire.EmbeddingsRequest: {
        "model": _MODEL,
        "input": "A text or a list of texts; or token ids (cl100k_base or o200k_base: a list of ints, or a list "
        "of them), decoded to text and tokenized again by the model's own tokenizer.",
        "encoding_format": "float, or base64 of each vector's float32 little-endian bytes (null: float).",
        "dimensions": "Keep the first N dimensions (Matryoshka), normalised again when the card normalises.",
        "user": "Accepted and ignored.",
        "input_type": "shoal's own: query or search_query prepends the card's query prompt, document or "
        "search_document its document prompt (default: none).",
        "prompt_name": "shoal's own: " + _PROMPT_NAME,
        "truncate": "shoal's own: false refuses a text longer than the model takes (422) instead of cutting it "
        "at max_length; the x-shoal-truncated answer header lists the inputs cut either way.",
    },
    wire.cohere.RerankRequest: {
        **_RERANK,
        "model": _MODEL + " Optional: the server's default scoring model.",
        "rank_fields": "Object documents: rank by these fields, as `name: value` lines in this order.",
        "max_chunks_per_doc": "Accepted and ignored (documents are truncated; /v1/score has windows).",
    },
    wire.cohere.RerankV2Request: {
        **_RERANK,
        "relevant_spans": "Only `{mode: disabled}`: shoal does not compute spans.",
        "priority": "Accepted and ignored.",
    },
    wire.cohere_embed.EmbedRequest: _COHERE_EMBED,
    wire.cohere_embed.EmbedV2Request: {
        **_COHERE_EMBED,
        "inputs": "Or content parts: an input's text parts are one text, or an input is one image part.",
        "max_tokens": "At or above the model's max_length: accepted; below it: a 400.",
        "output_dimension": "Keep the first N dimensions (Matryoshka), normalised again when the card normalises.",
        "priority": "Accepted and ignored.",
    },
    wire.tei.RerankRequest: {
        "query": "The query the texts are ranked against.",
        "texts": "The texts to rank.",
        "raw_scores": "The logit, without the model's activation.",
        "return_text": "Echo each text in its result.",
        "truncate": _TEI_TRUNCATE,
        "truncation_direction": _TEI_DIRECTION,
    },
    wire.tei.EmbedRequest: {
        "inputs": _TEI_INPUTS,
        "truncate": _TEI_TRUNCATE,
        "truncation_direction": _TEI_DIRECTION,
        "prompt_name": _PROMPT_NAME,
        "normalize": "L2-normalise each vector.",
        "dimensions": "Keep the first N dimensions (Matryoshka).",
        "encoding_format": "Only float (what huggingface_hub may send).",
    },
    wire.tei.EmbedSparseRequest: {
        "inputs": _TEI_INPUTS,
        "truncate": _TEI_TRUNCATE,
        "truncation_direction": _TEI_DIRECTION,
        "prompt_name": _PROMPT_NAME,
    },
    wire.tei.TokenizeRequest: {
        "inputs": _TEI_INPUTS,
        "add_special_tokens": "Add the model's special tokens, as it reads a text.",
        "prompt_name": _PROMPT_NAME,
    },
    wire.tei.SimilarityRequest: {
        "inputs": "`source_sentence`, and the `sentences` whose cosine with it is answered, in order.",
        "parameters": "truncate, truncation_direction and prompt_name, as for /embed.",
    },
    wire.tei.DecodeRequest: {
        "ids": "One sequence of token ids, or a list of sequences: one text is answered per sequence.",
        "skip_special_tokens": "Leave the model's special tokens ([CLS], [SEP], padding) out of the text.",
    },
    wire.tei.PredictRequest: {
        "inputs": "A text, a pair [text, text_pair], or a batch: a list of [text] and [text, text_pair] lists. A list "
        "of strings is one text or pair, never a batch.",
        "truncate": _TEI_TRUNCATE,
        "truncation_direction": _TEI_DIRECTION,
        "raw_scores": "The logits, without the softmax or sigmoid the model's config implies.",
    },
    wire.infinity.ClassifyRequest: {
        "input": "The texts to classify.",
        "model": _MODEL + " Optional: the server's default text classifier.",
        "raw_scores": "The logits, without the softmax or sigmoid the model's config implies (Infinity ignores it).",
    },
    wire.infinity.RerankRequest: {
        "model": _MODEL + " Optional: the server's default scoring model.",
        "query": "The query the documents are ranked against.",
        "documents": "The texts to rank.",
        "top_n": "Keep the best n results (0 or none: all, ranked).",
        "return_documents": "Echo each document, as a string (Infinity's shape), in its result.",
        "raw_scores": "The logit, without the model's activation.",
    },
    wire.vllm.ScoreRequest: {
        "model": _MODEL + " Optional: the server's default scoring model.",
        "text_1": "A text scored against every text_2, or as many texts as text_2, scored pairwise.",
        "text_2": "A text or a list of texts; the answer keeps their order.",
        "use_activation": "false: the logit, without the model's activation (default true).",
    },
    wire.hf.TokenClassificationRequest: {
        "inputs": "The text to tag.",
        "parameters": "How to group tokens into entities; every parameter has a default.",
    },
    wire.hf.TokenClassificationParameters: {
        "aggregation_strategy": "simple, first, average or max (default: the card's); none is a 400.",
        "ignore_labels": "Leave entities of these labels out.",
        "stride": "Accepted and ignored: long texts are read in windows overlapping as the card says.",
        "labels": "shoal's own: a GLiNER model's entity types (required for one); a tagger keeps only these.",
    },
    wire.hf.ZeroShotRequest: {
        "inputs": "The text to classify.",
        "parameters": "candidate_labels (required), multi_label, hypothesis_template.",
    },
    wire.hf.TextClassificationRequest: {
        "inputs": "The text to classify.",
        "parameters": "top_k and function_to_apply; each has a default.",
    },
    wire.hf.TextClassificationParameters: {
        "function_to_apply": "softmax, sigmoid or none (the logits); default: what the model's config implies.",
        "top_k": "Keep the best k labels (default: all, best first).",
    },
    wire.hf.ZeroShotParameters: {
        "candidate_labels": "The classes.",
        "multi_label": "Score each class on its own (NLI: entailment against contradiction; GLiClass and GLiNER2: "
        "its sigmoid); default: softmax across the classes.",
        "hypothesis_template": "NLI (zero_shot) models: the hypothesis, with `{}` for the class (default: the "
        "card's); GLiClass and GLiNER2 models refuse it.",
    },
}


# --- the document -------------------------------------------------------------------------------


def describe(routes: Sequence[RouteSpec] = ROUTES) -> JSONObject:
    """The OpenAPI 3.1 document of `routes` (by default, the app's table)."""
    types = [m for route in routes for t in (route.request, route.response) if t is not None for m in _members(t)]
    described = list(FIELDS)
    schemas, components = msgspec.json.schema_components(
        [*types, *described, wire.ErrorResponse], schema_hook=_array_schema, ref_template="#/components/schemas/{name}"
    )
    of_type = dict(zip(map(id, types), schemas))
    error_schema = schemas[-1]
    for t, ref in zip(described, schemas[len(types) :]):
        _describe_fields(t, components[ref["$ref"].rsplit("/", 1)[1]])

    def schema(t: Schema) -> JSONObject:
        return {"anyOf": [of_type[id(m)] for m in t]} if isinstance(t, tuple) else of_type[id(t)]

    paths: dict[str, dict[str, JSONObject]] = {}
    for route in routes:
        path, method = _PARAM.sub(r"{\1}", route.path), route.method.lower()
        entry: JSONObject = {
            "tags": [route.tag],
            "summary": route.summary,
            "operationId": _operation_id(path, method),
        }
        params: list[JSONObject] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAM.findall(route.path)
        ]
        if params:
            if route.name in _PATH_EXAMPLES:
                params[0]["example"] = _PATH_EXAMPLES[route.name]
            entry["parameters"] = params
        if route.request is not None:
            body: JSONObject = {"schema": schema(route.request)}
            if route.name in NAMED_EXAMPLES:
                body["examples"] = {
                    name: {"summary": summary, "value": value}
                    for name, (summary, value) in NAMED_EXAMPLES[route.name].items()
                }
            elif route.name in EXAMPLES:
                body["example"] = EXAMPLES[route.name]
            entry["requestBody"] = {
                "required": True,
                "content": {"application/json": body, "application/msgpack": {"schema": body["schema"]}},
            }
        if route.plain is None:  # through `app.endpoint`, which checks the bearer token when auth is on
            entry["security"] = [{"bearer": []}, {}]
        ok: JSONObject = {"description": "OK"}
        if route.response is not None:
            answer: JSONObject = {"schema": schema(route.response)}
            if route.name in RESPONSE_EXAMPLES:
                answer["example"] = RESPONSE_EXAMPLES[route.name]
            ok["content"] = {"application/json": answer}
        elif route.media != "application/json":
            ok["content"] = {route.media: {"schema": {"type": "string"}}}
        entry["responses"] = {
            "200": ok,
            "default": {
                "description": "An error: {error: {code, message, details}} (docs/api.md#errors)",
                "content": {"application/json": {"schema": error_schema}},
            },
        }
        paths.setdefault(path, {})[method] = entry
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shoal",
            "version": __version__,
            "description": "Serve small models: encode, score, extract, natively and through the OpenAI, "
            "Cohere, TEI, Infinity, vLLM and Hugging Face Inference APIs (docs/api.md). Bodies are JSON, or "
            "msgpack with `Content-Type: application/msgpack`; `Accept: application/msgpack` answers msgpack. "
            "A server with tokens takes `Authorization: Bearer <token>` on every route but the probes, metrics "
            "and this document.",
        },
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()],
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _describe_fields(t: type[object], schema: dict[str, Any]) -> None:
    """Write `FIELDS[t]` onto `t`'s generated schema, refusing a field `t` does not have."""
    properties = schema["properties"]
    for field, text in FIELDS[t].items():
        if field not in properties:
            raise ValueError(f"openapi.FIELDS describes {t.__qualname__}.{field}, which it does not have")
        properties[field]["description"] = text


def _array_schema(t: type[object]) -> JSONObject:
    if t is np.ndarray:  # a vector or matrix: nested lists in JSON, {dtype, shape, data} in msgpack
        return {
            "description": "an array: nested lists of numbers in JSON; in msgpack a map of dtype, shape and "
            "raw little-endian bytes (docs/api.md)"
        }
    raise NotImplementedError(f"no JSON schema for {t!r}")


def _members(t: Schema) -> tuple[type[object], ...]:
    return t if isinstance(t, tuple) else (t,)


def _operation_id(path: str, method: str) -> str:
    name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "") or "root"
    return f"{method}_{name}"
