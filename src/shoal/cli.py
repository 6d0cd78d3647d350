"""`shoal` command line. Heavy imports (torch, the web stack) happen inside each subcommand, so
`shoal --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path


def _settings(args: argparse.Namespace):
    from .config import Settings

    settings = Settings.from_env()
    server, engine = settings.server, settings.engine
    if getattr(args, "host", None):
        server = replace(server, host=args.host)
    if getattr(args, "port", None):
        server = replace(server, port=args.port)
    if getattr(args, "device", None):
        engine = replace(engine, device=args.device)
    if getattr(args, "memory_budget_bytes", None):
        engine = replace(engine, memory_budget_bytes=args.memory_budget_bytes)
    if getattr(args, "pin", None):
        engine = replace(engine, pinned_models=tuple(args.pin))
    if getattr(args, "auth_tokens_file", None):
        server = replace(server, auth_tokens_file=Path(args.auth_tokens_file))
    if getattr(args, "no_auth", False):
        server = replace(server, no_auth=True)
    if getattr(args, "default_model", None):
        server = replace(server, default_model=args.default_model)
    models = tuple(m for spec in (getattr(args, "models", None) or []) for m in spec.split(",") if m)
    aliases = list(settings.aliases)
    for spec in getattr(args, "alias", None) or []:
        name, sep, target = spec.partition("=")
        if not (sep and name.strip() and target.strip()):
            from .errors import ConfigError

            raise ConfigError(f"--alias {spec!r}: write NAME=MODEL (e.g. text-embedding-3-small=BAAI/bge-small-en-v1.5)")
        aliases.append((name.strip(), target.strip()))
    dirs = settings.models_dirs + tuple(Path(d) for d in (args.models_dir or []))
    return replace(settings, server=server, engine=engine, models_dirs=dirs, models=models or settings.models,
                   aliases=tuple(aliases))


def _engine(settings, *, strict: bool = True):
    """The in-process engine over the catalog `settings` admit. `strict`: a broken card in a
    models directory is an error (one-shot commands); a server logs and lists it instead."""
    from .catalog import Catalog
    from .errors import ConfigError

    try:
        from .engine import Engine
    except ImportError as exc:  # a torch-free install: the API and wire types only
        raise ConfigError(f"the in-process engine needs {exc.name}; install it with: pip install 'shoal[engine]'") from None

    catalog = Catalog.load(settings.models_dirs, strict=strict).restrict(settings.models)
    catalog.with_aliases(dict(settings.aliases))
    return Engine(settings.engine, catalog, allow_download=settings.allow_download, models_dirs=settings.models_dirs)


def cmd_serve(args: argparse.Namespace) -> int:
    from .api import create_app
    from .api.auth import Auth, check_bind
    from .api.server import serve

    settings = _settings(args)
    limits = {name: getattr(args, name, None) for name in _SERVE_LIMIT_FLAGS}
    limits = {name: value for name, value in limits.items() if value is not None}
    settings = replace(settings, server=replace(settings.server, **limits))
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


# `shoal serve` flags that override a ServerSettings field of the same name (docs/operations.md).
_SERVE_LIMIT_FLAGS: dict[str, tuple[type, str]] = {
    "max_header_bytes": (int, "bytes of request line plus headers before 431 (default 65536)"),
    "header_read_timeout_s": (float, "seconds to receive a request's headers before 408 (default 10)"),
    "body_read_timeout_s": (float, "longest gap between request body bytes before 408 (default 30)"),
    "keep_alive_timeout_s": (float, "seconds an idle kept-alive connection stays open (default 5)"),
    "max_connections": (int, "open connections before new ones get 503 (default 1000)"),
    "listen_backlog": (int, "connections the kernel queues before accept (default 2048)"),
}


def cmd_models(args: argparse.Namespace) -> int:
    from .catalog import Catalog

    settings = _settings(args)
    catalog = Catalog.load(settings.models_dirs, strict=False).restrict(settings.models)
    for card in catalog:
        outputs = ",".join(card.outputs) if "encode" in card.tasks else (card.score.kind if card.score else "-")
        adapters = f" adapters: {','.join(sorted(card.adapters))}" if card.adapters else ""
        print(f"{card.id:48} {card.architecture or '-':12} {','.join(card.tasks):13} {outputs:24} {card.verified}{adapters}")
    for file, error in sorted(catalog.broken.items()):
        print(f"broken: {error}", file=sys.stderr)
    return 1 if catalog.broken else 0


def _run_once(args: argparse.Namespace, call):
    """One call through an in-process engine, started and stopped around it."""
    settings = _settings(args)

    async def run():
        engine = _engine(settings)
        await engine.start()
        try:
            return await engine.run(call)
        finally:
            await engine.stop()

    return asyncio.run(run())


def cmd_encode(args: argparse.Namespace) -> int:
    from .engine import EncodeCall

    result = _run_once(args, EncodeCall(model=args.model, texts=args.text, dimensions=args.dimensions))
    for text, vector in zip(args.text, result.vectors):
        print(json.dumps({"text": text, "dense": [round(float(x), 6) for x in vector]}))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from .engine import ScoreCall

    result = _run_once(args, ScoreCall(model=args.model, query=args.query, documents=args.document,
                                       top_k=args.top_k, raw_scores=args.raw_scores))
    for item in result.items:
        print(json.dumps({"index": item.index, "score": round(item.score, 6), "document": args.document[item.index]}))
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from .engine import ExtractCall

    result = _run_once(args, ExtractCall(model=args.model, texts=args.text, labels=args.label or [],
                                         threshold=args.threshold, multi_label=args.multi_label or None))
    for text, item in zip(args.text, result.items):
        out: dict = {"text": text}
        if item.entities is not None:
            out["entities"] = [{"text": e.text, "label": e.label, "score": round(e.score, 6), "start": e.start,
                                "end": e.end} for e in item.entities]
        if item.labels is not None:
            out["labels"] = [{"label": s.label, "score": round(s.score, 6)} for s in item.labels]
        print(json.dumps(out, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve small models: encode, score, extract.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--models-dir", action="append", metavar="DIR",
                       help="add the model cards (*.yaml) and adapters (DIR/adapters/NAME) in DIR; a server watches it")
        p.add_argument("--models", action="append", metavar="IDS",
                       help="serve only these model ids or globs (comma-separated, repeatable)")
        p.add_argument("--alias", action="append", metavar="NAME=MODEL",
                       help="let requests name MODEL as NAME too (e.g. an OpenAI model name; repeatable)")

    serve = sub.add_parser("serve", help="run the HTTP server")
    common(serve)
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080)")
    serve.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    serve.add_argument("--memory-budget-bytes", type=int,
                       help="bytes resident models may hold before the least recently used are evicted "
                            "(default: 80%% of the RAM or VRAM free at start)")
    serve.add_argument("--pin", action="append", metavar="MODEL", help="never evict MODEL")
    serve.add_argument("--preload", action="append", metavar="MODEL", help="load MODEL before accepting requests")
    serve.add_argument("--auth-tokens-file", metavar="FILE", help="bearer tokens (YAML; see docs/operations.md)")
    serve.add_argument("--no-auth", action="store_true", help="serve a non-loopback address without tokens")
    serve.add_argument("--default-model", metavar="MODEL",
                       help="the model of routes whose bodies name none (TEI's), unless ?model= or X-Shoal-Model says")
    serve.add_argument("--log-level", default="info")
    for name, (kind, help_text) in _SERVE_LIMIT_FLAGS.items():
        serve.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the model cards")
    common(models)
    models.set_defaults(func=cmd_models)

    encode = sub.add_parser("encode", help="embed texts in-process and print JSON lines")
    common(encode)
    encode.add_argument("model")
    encode.add_argument("text", nargs="+")
    encode.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    encode.add_argument("--dimensions", type=int)
    encode.set_defaults(func=cmd_encode)

    score = sub.add_parser("score", help="rank documents against a query in-process and print JSON lines, best first")
    common(score)
    score.add_argument("model")
    score.add_argument("query")
    score.add_argument("document", nargs="+")
    score.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    score.add_argument("--top-k", type=int)
    score.add_argument("--raw-scores", action="store_true", help="rerankers: the logit, no activation")
    score.set_defaults(func=cmd_score)

    extract = sub.add_parser("extract", help="extract entities (or zero-shot labels) in-process and print JSON lines")
    common(extract)
    extract.add_argument("model")
    extract.add_argument("text", nargs="+")
    extract.add_argument("--label", action="append", metavar="LABEL",
                         help="an entity type or class to look for (repeat; token classifiers need none)")
    extract.add_argument("--threshold", type=float)
    extract.add_argument("--multi-label", action="store_true")
    extract.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    extract.set_defaults(func=cmd_extract)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import ShoalError

    try:
        return args.func(args)
    except ShoalError as exc:
        print(f"shoal: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
