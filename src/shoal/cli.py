"""`shoal` command line. Heavy imports (torch, the web stack) happen inside each subcommand, so
`shoal --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from . import __version__
from .config import Settings, declared
from .settings_spec import add_flags, given


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
    serve(app, settings.server, log_level=args.log_level)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .catalog import Catalog

    settings = _settings(args)
    catalog = Catalog.load(settings.models_dirs, strict=False).restrict(settings.models)
    for card in catalog:
        outputs = ",".join(card.outputs) if "encode" in card.tasks else (card.score.kind if card.score else "-")
        adapters = f" adapters: {','.join(sorted(card.adapters))}" if card.adapters else ""
        kind = card.architecture or "-"
        print(f"{card.id:48} {kind:12} {','.join(card.tasks):13} {outputs:24} {card.verified}{adapters}")
    for _file, error in sorted(catalog.broken.items()):
        print(f"broken: {error}", file=sys.stderr)
    return 1 if catalog.broken else 0


class _Backend:
    """Where a one-shot command's calls go: a server (`--url`, through the SDK) or an in-process
    engine started for the command. `run(call)` answers a shoal call either way."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    async def __aenter__(self) -> _Backend:
        if self.args.url:
            from .sdk import AsyncClient

            self.client = AsyncClient(self.args.url, api_key=self.args.api_key)
            self.engine = None
        else:
            self.engine = _engine(_settings(self.args))
            await self.engine.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.engine is not None:
            await self.engine.stop()
        else:
            await self.client.aclose()

    async def encode(self, texts: list[str]) -> tuple[np.ndarray, int]:
        a = self.args
        if self.engine is None:
            got = await self.client.encode(
                a.model, texts, dimensions=a.dimensions, is_query=a.query_prompt or None, batch_size=len(texts)
            )
            return got.dense_rows(), got.num_tokens
        from .calls import EncodeCall

        result = await self.engine.run(
            EncodeCall(model=a.model, items=texts, dimensions=a.dimensions, is_query=a.query_prompt or None)
        )
        return np.stack(result.vectors), result.num_tokens

    async def encode_images(self, paths: list[Path]) -> tuple[np.ndarray, int]:
        a = self.args
        if self.engine is None:
            got = await self.client.encode(a.model, images=paths, dimensions=a.dimensions, batch_size=len(paths))
            return got.dense_rows(), got.num_tokens
        from .calls import EncodeCall, Item

        files = await asyncio.to_thread(lambda: [path.read_bytes() for path in paths])
        result = await self.engine.run(
            EncodeCall(model=a.model, items=[Item(image=data) for data in files], dimensions=a.dimensions)
        )
        return np.stack(result.vectors), result.num_tokens

    async def score(self, documents: list[str]) -> tuple[list[tuple[int, float]], int]:
        a = self.args
        if self.engine is None:
            ranking = await self.client.score(a.model, a.query, documents, raw_scores=a.raw_scores or None)
            return [(s.index, s.score) for s in ranking], ranking.num_tokens
        from .calls import ScoreCall

        result = await self.engine.run(
            ScoreCall(model=a.model, query=a.query, documents=documents, raw_scores=a.raw_scores)
        )
        return [(item.index, item.score) for item in result.items], result.num_tokens

    async def extract(self, texts: list[str]) -> tuple[list, int]:
        a = self.args
        if self.engine is None:
            items = await self.client.extract(
                a.model,
                texts,
                a.label or [],
                threshold=a.threshold,
                multi_label=a.multi_label or None,
                batch_size=len(texts),
            )
            return items, 0
        from .calls import ExtractCall

        result = await self.engine.run(
            ExtractCall(
                model=a.model,
                items=texts,
                labels=a.label or [],
                threshold=a.threshold,
                multi_label=a.multi_label or None,
            )
        )
        return result.items, result.num_tokens


def _run_batch(args: argparse.Namespace, verb: str, work) -> int:
    """Read the inputs, run `work(backend, records)` in chunks, write or print, and summarise."""
    from . import batch
    from .errors import ConfigError

    images = getattr(args, "images", None)  # encode's --images DIR
    if images is None:
        records: list = batch.records_of(args.text, args.input, args.field)
    elif args.text or args.input or getattr(args, "query_prompt", False):
        raise ConfigError("--images DIR encodes the image files in DIR: give no texts, --input or --query-prompt too")
    else:
        records = batch.image_files(images)
    batch.check_output(args.output, verb)

    async def main():
        async with _Backend(args) as backend:
            return await work(backend, records)

    with batch.Timer() as timer:
        rows, dense, num_tokens = asyncio.run(main())
    if args.output is None:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False))
    else:
        batch.write(args.output, verb, rows, dense)
    print(batch.summary(verb, len(records), num_tokens, timer.seconds), file=sys.stderr)
    return 0


def _with_id(record, row: dict) -> dict:
    return {"id": record.id, **row} if record.id is not None else row


def cmd_encode(args: argparse.Namespace) -> int:
    from . import batch

    async def work(backend: _Backend, records):
        progress = args.output is not None
        if args.images is None:
            named = [_with_id(r, {"text": r.text}) for r in records]
            texts = [r.text for r in records]
            chunks = await batch.in_chunks(texts, args.batch_size, args.concurrency, backend.encode, progress)
        else:  # batch.ImageFile records
            named = [{"image": r.name} for r in records]
            paths = [r.path for r in records]
            chunks = await batch.in_chunks(
                paths, args.batch_size, args.concurrency, backend.encode_images, progress, unit="image"
            )
        dense = np.concatenate([vectors for vectors, _ in chunks])
        rows = [{**row, "dense": [round(float(x), 6) for x in v]} for row, v in zip(named, dense)]
        return rows, dense, sum(tokens for _, tokens in chunks)

    return _run_batch(args, "encode", work)


def cmd_score(args: argparse.Namespace) -> int:
    from . import batch

    async def work(backend: _Backend, records):
        offsets = list(range(0, len(records), args.batch_size))
        chunks = await batch.in_chunks(
            [r.text for r in records], args.batch_size, args.concurrency, backend.score, args.output is not None
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

    async def work(backend: _Backend, records):
        chunks = await batch.in_chunks(
            [r.text for r in records], args.batch_size, args.concurrency, backend.extract, args.output is not None
        )
        items = [item for chunk, _ in chunks for item in chunk]
        rows = []
        for record, item in zip(records, items):
            out: dict = {"text": record.text}
            if item.entities is not None:
                out["entities"] = [
                    {"text": e.text, "label": e.label, "score": round(e.score, 6), "start": e.start, "end": e.end}
                    for e in item.entities
                ]
            if item.labels is not None:
                out["labels"] = [{"label": s.label, "score": round(s.score, 6)} for s in item.labels]
            rows.append(_with_id(record, out))
        return rows, None, sum(tokens for _, tokens in chunks)

    return _run_batch(args, "extract", work)


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
        p.add_argument("--url", help="send to this shoal server (or gateway) instead of running a model in-process")
        p.add_argument("--api-key", help="bearer token for --url")
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
    encode.add_argument("--dimensions", type=int)
    encode.add_argument("--query-prompt", action="store_true", help="encode as queries (the card's query prompt)")
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
        "extract", allow_abbrev=False, help="extract entities (or zero-shot labels) from texts (arguments or --input)"
    )
    batch_io(extract, ".jsonl or .parquet")
    extract.add_argument("model")
    extract.add_argument("text", nargs="*")
    extract.add_argument(
        "--label",
        action="append",
        metavar="LABEL",
        help="an entity type or class to look for (repeat; token classifiers need none)",
    )
    extract.add_argument("--threshold", type=float)
    extract.add_argument("--multi-label", action="store_true")
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
