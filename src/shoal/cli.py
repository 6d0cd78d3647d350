"""`shoal` command line. Heavy imports (torch, the web stack) happen inside each subcommand, so
`shoal --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import __version__
from .config import Settings, declared
from .settings_spec import add_flags, given
from .vectors import OUTPUT_DTYPES

if TYPE_CHECKING:
    from .batch import Vectors
    from .calls import EncodeResult
    from .engine import Engine
    from .sdk.http import Http


def _settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of a subcommand: defaults < SHOAL_* variables (`environ`, default os.environ) <
    its flags (generated from the declaration in shoal/config.py)."""
    return Settings.resolve(environ, given(args, declared()))


def _engine(settings, *, strict: bool = True, metrics=None):
    """The in-process engine over the catalog `settings` admit. `strict`: a broken card in a
    models directory is an error (one-shot commands); a server logs and lists it instead."""
    from .catalog import Catalog
    from .errors import ConfigError

    try:
        from .engine import Engine
    except ImportError as exc:  # a torch-free install: the API and wire types only
        raise ConfigError(
            f"the in-process engine needs {exc.name}; install it with: pip install 'shoal[engine]'"
        ) from None

    catalog = Catalog.load(settings.models_dirs, strict=strict).restrict(settings.models)
    catalog.with_aliases(dict(settings.aliases))
    return Engine(
        settings.engine,
        catalog,
        allow_download=settings.allow_download,
        models_dirs=settings.models_dirs,
        metrics=metrics,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from .api import create_app
    from .api.auth import Auth, check_bind
    from .api.server import serve

    settings = _settings(args)
    server = settings.server
    auth = Auth.from_sources(server.auth_tokens_file, server.auth_tokens, server.admin_tokens)  # fails closed
    check_bind(server.host, auth, server.no_auth)
    engine = _engine(settings, strict=False)
    preload = tuple(dict.fromkeys([*(args.preload or []), *engine.fleet.preload_ids]))
    for model_id in preload + ((server.default_model,) if server.default_model else ()):
        engine.catalog.get(model_id)  # fail fast on a typo, before binding the port
    app = create_app(settings, engine, preload=preload, auth=auth)
    _log_to_stderr(args.log_level)
    print(_startup_summary(settings, engine, preload), file=sys.stderr, flush=True)
    serve(app, settings.server, log_level=args.log_level)
    return 0


def _log_to_stderr(level: str) -> None:
    """shoal's own log lines (loads, failed preloads, refusals) on stderr beside uvicorn's."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(name)s: %(message)s"))
    logger = logging.getLogger("shoal")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _startup_summary(settings: Settings, engine: Engine, preload: tuple[str, ...]) -> str:
    """One line: where it serves, on what, within what memory, which models (and how many can load
    without the network), what it preloads."""
    import torch

    server = settings.server
    local = sum(engine.fleet.weights(card) == "local" for card in engine.catalog)
    budget = engine.cache.budget_bytes
    parts = [
        f"http://{server.host}:{server.port}",
        f"device {settings.engine.device}, {engine.device_lanes} lane(s), {torch.get_num_threads()} torch thread(s)",
        f"memory budget {budget / 2**30:.1f} GiB" if budget else "no memory budget",
        f"{len(engine.catalog)} models, {local} with local weights (`shoal models` lists them)",
        f"preloading {', '.join(preload)} (GET /readyz says when they are ready)" if preload else "nothing preloaded",
    ]
    if server.default_model:
        parts.append(f"default model {server.default_model}")
    return "shoal serve: " + " · ".join(parts)


def cmd_models(args: argparse.Namespace) -> int:
    """The catalog, one model a line: id, architecture, tasks, outputs, where its weights are
    (local, downloadable, unavailable), how it is verified, its adapters."""
    from .catalog import Catalog
    from .catalog.resolve import weights_state

    settings = _settings(args)
    catalog = Catalog.load(settings.models_dirs, strict=False).restrict(settings.models)
    for card in catalog:
        outputs = ",".join(card.outputs) if "encode" in card.tasks else (card.score.kind if card.score else "-")
        adapters = f" adapters: {','.join(sorted(card.adapters))}" if card.adapters else ""
        kind = card.architecture or "-"
        weights = weights_state(card, settings.allow_download)
        print(f"{card.id:48} {kind:12} {','.join(card.tasks):13} {outputs:24} {weights:12} {card.verified}{adapters}")
    for _file, error in sorted(catalog.broken.items()):
        print(f"broken: {error}", file=sys.stderr)
    return 1 if catalog.broken else 0


class _Backend:
    """Where a one-shot command's calls go: a server (`--url`, through the SDK) or an in-process
    engine started for the command. A missing package (the SDK's httpx, the engine's torch) is a
    ConfigError that says what to install."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Engine | None = None
        self.http: Http | None = None  # extract's connection (`_extract_over_http`), opened at its first chunk

    async def __aenter__(self) -> _Backend:
        from .errors import ConfigError

        if self.args.url:
            try:
                from .sdk import AsyncClient
            except ImportError as exc:  # the sdk extra's httpx
                raise ConfigError(str(exc)) from None
            self.client = AsyncClient(self.args.url, api_key=self.args.api_key)
            return self
        try:
            engine = _engine(_settings(self.args))
            await engine.start()
        except ImportError as exc:  # a torch-free install: the engine extra is missing
            raise ConfigError(
                f"running {self.args.model} in process needs {exc.name or 'the engine extra'}: "
                "pip install 'shoal[engine]', or send it to a server with --url URL (or SHOAL_URL)"
            ) from None
        self.engine = engine
        return self

    async def __aexit__(self, *exc) -> None:
        if self.engine is not None:
            await self.engine.stop()
            return
        await self.client.aclose()
        if self.http is not None:
            await self.http.aclose()

    def _encode_options(self) -> dict[str, Any]:
        """The EncodeCall fields (and the SDK's encode arguments) the flags set, for texts and images."""
        a = self.args
        return {
            "dimensions": a.dimensions,
            "normalize": a.normalize,
            "output_dtype": a.output_dtype,
            "outputs": tuple(a.outputs) if a.outputs else None,
        }

    async def encode(self, texts: list[str]) -> Vectors:
        """`batch.Vectors` of `texts`, one row each."""
        from . import batch

        a = self.args
        prompts = {"is_query": a.query_prompt or None, "prompt_name": a.prompt_name}
        if self.engine is None:
            got = await self.client.encode(a.model, texts, **self._encode_options(), **prompts, batch_size=len(texts))
            return batch.vectors(a.model, got.dense, got.sparse, got.num_tokens)
        from .calls import EncodeCall

        result = await self.engine.encode(EncodeCall(model=a.model, items=texts, **self._encode_options(), **prompts))
        return self._vectors(result)

    async def encode_images(self, paths: list[Path]) -> Vectors:
        """`batch.Vectors` of the image files, one row each."""
        from . import batch

        a = self.args
        if self.engine is None:
            got = await self.client.encode(a.model, images=paths, **self._encode_options(), batch_size=len(paths))
            return batch.vectors(a.model, got.dense, got.sparse, got.num_tokens)
        from .calls import EncodeCall, Item

        files = await asyncio.to_thread(lambda: [path.read_bytes() for path in paths])
        result = await self.engine.encode(
            EncodeCall(model=a.model, items=[Item(image=data) for data in files], **self._encode_options())
        )
        return self._vectors(result)

    def _vectors(self, result: EncodeResult) -> Vectors:
        """An in-process EncodeResult as `batch.Vectors`."""
        from . import batch

        dense = [i.dense for i in result.items if i.dense is not None]
        sparse = [(i.sparse.indices, i.sparse.values) for i in result.items if i.sparse is not None]
        every = len(result.items)
        return batch.vectors(
            self.args.model,
            np.stack(dense) if len(dense) == every else None,
            sparse if len(sparse) == every else None,
            result.num_tokens,
        )

    async def score(self, documents: list[str]) -> tuple[list[tuple[int, float]], int]:
        a = self.args
        if self.engine is None:
            ranking = await self.client.score(a.model, a.query, documents, raw_scores=a.raw_scores or None)
            return [(s.index, s.score) for s in ranking], ranking.num_tokens
        from .calls import ScoreCall

        result = await self.engine.score(
            ScoreCall(model=a.model, query=a.query, documents=documents, raw_scores=a.raw_scores)
        )
        return [(item.index, item.score) for item in result.items], result.num_tokens

    async def extract_kind(self) -> str | None:
        """The extract kind of the model's card (in process: the catalog's; with --url: the
        server's `GET /v1/models/{id}`); None for a model that does not extract."""
        if self.engine is None:
            return (await self.client.model(self.args.model)).get("extract")
        card = self.engine.catalog.get(self.args.model)
        return card.extract.kind if card.extract is not None else None

    async def extract(self, texts: list[str]) -> tuple[list, int]:
        """Each text's extracted item, and the tokens they cost."""
        return await self._extract(texts, self.args.schema)

    async def extract_rows(self, rows: list[tuple[str, dict]]) -> tuple[list, int]:
        """`extract` of texts that each carry their part of the schema (`batch.row_schemas`): the
        chunk's schema holds each field's values in row order."""
        names = rows[0][1].keys() if rows else ()
        schema = {name: [part[name] for _, part in rows] for name in names}
        return await self._extract([text for text, _ in rows], schema)

    async def extract_images(self, paths: list[Path]) -> tuple[list, int]:
        """Each image file's extracted item (an image_labels model's labels), and the tokens they cost."""
        return await self._extract(await asyncio.to_thread(lambda: [path.read_bytes() for path in paths]), None)

    async def _extract(self, inputs: list[str] | list[bytes], schema: dict | None) -> tuple[list, int]:
        a = self.args
        if self.engine is None:
            return await self._extract_over_http(inputs, schema)
        from .calls import ExtractCall, Item

        result = await self.engine.extract(
            ExtractCall(
                model=a.model,
                items=[x if isinstance(x, str) else Item(image=x) for x in inputs],
                labels=a.label or [],
                threshold=a.threshold,
                multi_label=a.multi_label or None,
                top_k=a.top_k,
                raw_scores=a.raw_scores or None,
                schema=schema,
            )
        )
        return result.items, result.num_tokens

    async def _extract_over_http(self, inputs: list[str] | list[bytes], schema: dict | None) -> tuple[list, int]:
        """One POST /v1/extract of texts or image files' bytes: their items and the tokens the
        server's usage counts. Sent through the SDK's connection layer (auth, retries, error codes)
        rather than `AsyncClient.extract`, whose list of items does not carry the usage."""
        from . import wire
        from .sdk.http import Http
        from .sdk.results import extracted

        a = self.args
        if self.http is None:
            self.http = Http(
                a.url, api_key=a.api_key, timeout_s=60.0, max_retries=5, format="msgpack", transport=None, headers=None
            )
        http = self.http

        def body(timeout_s: float | None) -> wire.ExtractRequest:
            options = wire.native.ExtractOptions(
                threshold=a.threshold,
                multi_label=a.multi_label or None,
                top_k=a.top_k,
                raw_scores=a.raw_scores or None,
                timeout_s=timeout_s,
            )
            items = [
                wire.native.ExtractItem(text=x) if isinstance(x, str) else wire.native.ExtractItem(image=x)
                for x in inputs
            ]
            return wire.ExtractRequest(model=a.model, items=items, labels=a.label or [], schema=schema, options=options)

        answer = await http.post("/v1/extract", body, wire.ExtractResponse, None)
        return extracted([answer]), answer.usage.tokens


def _run_batch(args: argparse.Namespace, verb: str, work) -> int:
    """Check the output path, read the inputs, run `work(backend, records)` in chunks, write or
    print, and summarise (not with --quiet). `--url` defaults to SHOAL_URL (`--url ''`: in
    process), `--api-key` to SHOAL_API_KEY."""
    from . import batch
    from .errors import ConfigError

    if args.url is None:
        args.url = os.environ.get("SHOAL_URL") or None
    args.api_key = args.api_key or os.environ.get("SHOAL_API_KEY") or None
    batch.check_output(args.output, verb, getattr(args, "outputs", None) or ())
    images = getattr(args, "images", None)  # encode's --images DIR
    if images is None:
        records: list = batch.records_of(args.text, args.input, args.field)
    elif args.text or args.input or getattr(args, "query_prompt", False) or getattr(args, "prompt_name", None):
        doing = {"encode": "encodes", "extract": "labels"}[verb]
        raise ConfigError(
            f"--images DIR {doing} the image files in DIR: give no texts, --input, --query-prompt or --prompt-name too"
        )
    else:
        records = batch.image_files(images)

    async def main():
        async with _Backend(args) as backend:
            return await work(backend, records)

    with batch.Timer() as timer:
        rows, got, num_tokens = asyncio.run(main())
    if args.output is None:
        for row in batch.json_rows(rows, got):
            print(json.dumps(row, ensure_ascii=False))
    else:
        batch.write(args.output, rows, got)
    if not args.quiet:
        print(batch.summary(verb, len(records), num_tokens, timer.seconds), file=sys.stderr)
    return 0


def _progress(args: argparse.Namespace) -> bool:
    """A progress bar while writing a file (printed rows go to stdout instead), unless --quiet."""
    return args.output is not None and not args.quiet


def _with_id(record, row: dict) -> dict:
    return {"id": record.id, **row} if record.id is not None else row


def cmd_encode(args: argparse.Namespace) -> int:
    from . import batch

    def checked(encode):
        async def run(inputs: list) -> batch.Vectors:
            got = await encode(inputs)
            batch.check_dense(args.output, args.model, got)  # .npy of a sparse model: refused at once
            return got

        return run

    async def work(backend: _Backend, records):
        progress = _progress(args)
        if args.images is None:
            named = [_with_id(r, {"text": r.text}) for r in records]
            texts = [r.text for r in records]
            chunks = await batch.in_chunks(texts, args.batch_size, args.concurrency, checked(backend.encode), progress)
        else:  # batch.ImageFile records
            named = [{"image": r.name} for r in records]
            paths = [r.path for r in records]
            chunks = await batch.in_chunks(
                paths, args.batch_size, args.concurrency, checked(backend.encode_images), progress, unit="image"
            )
        got = batch.joined(chunks)
        return named, got, got.num_tokens

    return _run_batch(args, "encode", work)


def cmd_score(args: argparse.Namespace) -> int:
    from . import batch

    async def work(backend: _Backend, records):
        offsets = list(range(0, len(records), args.batch_size))
        chunks = await batch.in_chunks(
            [r.text for r in records], args.batch_size, args.concurrency, backend.score, _progress(args)
        )
        scored = sorted(
            ((offset + index, score) for offset, (pairs, _) in zip(offsets, chunks) for index, score in pairs),
            key=lambda pair: (-pair[1], pair[0]),
        )
        if args.top_k:
            scored = scored[: args.top_k]
        rows = [
            _with_id(records[i], {"index": i, "score": round(score, 6), "document": records[i].text})
            for i, score in scored
        ]
        return rows, None, sum(tokens for _, tokens in chunks)

    return _run_batch(args, "score", work)


def cmd_extract(args: argparse.Namespace) -> int:
    from . import batch

    args.schema = batch.read_schema(args.schema)

    async def work(backend: _Backend, records):
        # The card's kind: a check for --kind, and whether each row carries its part of the schema.
        kind = await backend.extract_kind() if args.kind is not None or args.images is None else None
        if args.kind is not None:
            _check_kind(args, kind)
        progress = _progress(args)
        if args.images is None:
            named = [_with_id(r, {"text": r.text}) for r in records]
            texts = [r.text for r in records]
            parts = batch.row_schemas(records, args.model, kind, args.schema)
            chunks = await (
                batch.in_chunks(texts, args.batch_size, args.concurrency, backend.extract, progress)
                if parts is None
                else batch.in_chunks(
                    list(zip(texts, parts)), args.batch_size, args.concurrency, backend.extract_rows, progress
                )
            )
        else:  # batch.ImageFile records
            named = [{"image": r.name} for r in records]
            chunks = await batch.in_chunks(
                [r.path for r in records], args.batch_size, args.concurrency, backend.extract_images, progress, "image"
            )
        items = [item for chunk, _ in chunks for item in chunk]
        rows = [{**row, **batch.extracted_row(item)} for row, item in zip(named, items)]
        return rows, None, sum(tokens for _, tokens in chunks)

    return _run_batch(args, "extract", work)


def _check_kind(args: argparse.Namespace, served: str | None) -> None:
    """`--kind` is a check: the model's card decides how it extracts."""
    from .errors import ConfigError

    if served is None:
        raise ConfigError(f"--kind {args.kind}: {args.model} does not extract (its card names no extract kind)")
    if served != args.kind:
        raise ConfigError(
            f"--kind {args.kind}: {args.model} extracts as kind {served} (its card decides), not {args.kind}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve small models: encode, score, extract.")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def settings(p: argparse.ArgumentParser, command: str) -> None:
        add_flags(p, declared(), command)

    serve = sub.add_parser("serve", allow_abbrev=False, help="run the HTTP server")
    serve.add_argument("--preload", action="append", metavar="MODEL", help="load MODEL before accepting requests")
    serve.add_argument("--log-level", default="info")
    settings(serve, "serve")
    serve.set_defaults(func=cmd_serve)

    from .cluster.cli import register as register_cluster

    register_cluster(sub, settings, sys.modules[__name__])

    from .bench.cli import register as register_bench

    register_bench(sub)  # bench and tune declare their own flags (--models-dir among them)

    models = sub.add_parser("models", allow_abbrev=False, help="list the model cards")
    settings(models, "models")
    models.set_defaults(func=cmd_models)

    def batch_io(p: argparse.ArgumentParser, writes: str) -> None:
        p.add_argument(
            "--url",
            help="send to this shoal server (or gateway) instead of running a model in-process "
            "(default: $SHOAL_URL; --url '' runs in process)",
        )
        p.add_argument("--api-key", help="bearer token for --url (default: $SHOAL_API_KEY)")
        p.add_argument(
            "--input", "-i", type=Path, metavar="FILE", help="more texts: .txt (a line each), .jsonl, .parquet"
        )
        p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet input (default text)")
        p.add_argument(
            "--output",
            "-o",
            type=Path,
            metavar="FILE",
            help=f"write {writes} instead of printing JSON lines (with a progress bar)",
        )
        p.add_argument("--batch-size", type=_positive, default=64, help="inputs per request (default 64)")
        p.add_argument("--concurrency", type=_positive, default=4, help="requests at once (default 4)")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")

    encode = sub.add_parser(
        "encode",
        allow_abbrev=False,
        help="embed texts (arguments or --input FILE) or images (--images DIR); print JSON lines or write a file",
    )
    batch_io(encode, ".jsonl, .npy or .parquet")
    encode.add_argument("model")
    encode.add_argument("text", nargs="*")
    encode.add_argument(
        "--images",
        type=Path,
        metavar="DIR",
        help="embed every image file in DIR and its subfolders instead of texts (a model that reads images: "
        'CLIP, SigLIP), sorted by path under DIR; each row names its file: {"image": "cats/01.png", ...}',
    )
    encode.add_argument("--dimensions", type=int, help="keep the first N dimensions (Matryoshka)")
    encode.add_argument("--query-prompt", action="store_true", help="encode as queries (the card's query prompt)")
    encode.add_argument("--prompt-name", metavar="NAME", help="prepend the card's prompt of this name")
    encode.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="L2-normalise each vector (default: as the card says)",
    )
    encode.add_argument(
        "--output-dtype",
        choices=OUTPUT_DTYPES,
        default="float32",
        help="the dense vectors' type: int8 scales each vector to +-127; ubinary packs the sign bits 8 a "
        "byte (uint8), binary is ubinary - 128 (int8) (default float32)",
    )
    encode.add_argument(
        "--outputs",
        action="append",
        choices=("dense", "sparse"),
        metavar="KIND",
        help="dense or sparse (repeat for both); default: the card's first output",
    )
    settings(encode, "encode")  # the in-process engine's (ignored with --url)
    encode.set_defaults(func=cmd_encode)

    score = sub.add_parser(
        "score", allow_abbrev=False, help="rank documents (arguments or --input FILE) against a query, best first"
    )
    batch_io(score, ".jsonl or .parquet")
    score.add_argument("model")
    score.add_argument("query")
    score.add_argument("text", nargs="*", metavar="document")
    score.add_argument("--top-k", type=int)
    score.add_argument("--raw-scores", action="store_true", help="rerankers: the logit, no activation")
    settings(score, "score")  # the in-process engine's (ignored with --url)
    score.set_defaults(func=cmd_score)

    extract = sub.add_parser(
        "extract",
        allow_abbrev=False,
        help="extract entities, relations, zero-shot labels or a classifier's labels from texts (arguments or "
        "--input) or images (--images DIR)",
    )
    batch_io(extract, ".jsonl or .parquet")
    extract.add_argument("model")
    extract.add_argument("text", nargs="*")
    extract.add_argument(
        "--kind",
        metavar="KIND",
        help="check that the model's card extracts as KIND (gliner, token_class, zero_shot, classify, gliclass, "
        "gliner2, glirel, image_labels) before sending anything; the card decides how it extracts",
    )
    extract.add_argument(
        "--images",
        type=Path,
        metavar="DIR",
        help="label every image file in DIR and its subfolders instead of texts (kind image_labels: CLIP, SigLIP), "
        'sorted by path under DIR; each row names its file: {"image": "cats/01.png", "labels": [...]}',
    )
    extract.add_argument(
        "--schema",
        metavar="JSON|FILE",
        help="gliner2: the schema beside the entity types of --label, inline JSON or a JSON file: "
        '{"relations": [{"works for": {"head": "", "tail": ""}}], "classifications": [{"task": "sentiment", '
        '"labels": ["positive", "negative"]}], "structures": {"deal": {"fields": ["buyer::str", "price::str"]}}}; '
        "glirel takes none: each .jsonl/.parquet row carries its entities, "
        '"entities": [{"start": 0, "end": 12, "label": "person"}, ...], and --label the relation types',
    )
    extract.add_argument(
        "--label",
        action="append",
        metavar="LABEL",
        help="an entity type or class to look for (repeat; token and text classifiers need none; gliner2: the "
        "entity types beside --schema)",
    )
    extract.add_argument("--threshold", type=float)
    extract.add_argument("--multi-label", action="store_true")
    extract.add_argument("--top-k", type=_positive, help="text classifiers: the best this many labels (default: all)")
    extract.add_argument(
        "--raw-scores", action="store_true", help="text classifiers: the logits, no softmax or sigmoid"
    )
    settings(extract, "extract")  # the in-process engine's (ignored with --url)
    extract.set_defaults(func=cmd_extract)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import ShoalError

    try:
        return args.func(args)
    except ShoalError as exc:
        print(f"shoal: {exc.message}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("httpx", "httpcore"):
            raise
        # --url unreachable after the SDK's retries: one line, not a traceback.
        print(f"shoal: cannot reach {getattr(args, 'url', None)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
