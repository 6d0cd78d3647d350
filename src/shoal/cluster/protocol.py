"""What the gateway and the workers agree on: names on NATS, message headers, heartbeats.

    SHOAL_WORK       a work-queue stream over `shoal.work.>`: one subject and one durable pull
                     consumer per pool and model (`shoal.work.<pool>.<model>`); a message is one
                     call (msgpack, `shoal.calls`), or empty with `Shoal-Object` naming it in the
                     Object Store when it is larger than the server's message limit
    SHOAL_DEAD       the dead letters: JetStream's max-deliveries advisories for SHOAL_WORK
    shoal_payloads   the Object Store bucket of large calls and results while in flight; they
                     expire after `payload_ttl_s` (what a crashed gateway leaves behind)
    shoal.hb.<id>    a worker's heartbeat (core NATS, every `heartbeat_s`); `shoal.ping` asks every
                     worker for one at once (a gateway that starts)
    shoal.cancel     a request id whose caller went away: a worker holding its call drops it
    <reply subject>  the result (msgpack), sent by the worker to the subject in `Shoal-Reply`

Model ids and pool names become subject tokens and consumer names by `token`: letters, digits
and `-` stay, every other character is `_xx` (its UTF-8 bytes in hex), so the mapping is one-to-one.
Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl
import time

import msgspec

from ..calls import ErrorResult, Generated
from ..config import ClusterSettings
from ..errors import ShoalError
from ..service import CardProblem, ModelStatus, Token

log = logging.getLogger("shoal.cluster")

STREAM = "SHOAL_WORK"
WORK_PREFIX = "shoal.work"
DEAD_STREAM = "SHOAL_DEAD"
DEAD_SUBJECT = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{STREAM}.*"
PAYLOADS = "shoal_payloads"
HEARTBEAT_PREFIX = "shoal.hb"
BACKLOG_PREFIX = "shoal.backlog"  # shoal.backlog.<pool>: each model's queued, delivered, unacked calls
PING_SUBJECT = "shoal.ping"
CANCEL_SUBJECT = "shoal.cancel"
RPC_PREFIX = "shoal.rpc"  # shoal.rpc.<action>.<pool>.<model>: (de)tokenize (one worker), admin (each worker)

# Headers of a call's message.
REQUEST_ID = "Shoal-Request-Id"
DEADLINE = "Shoal-Deadline"  # unix seconds (the hosts' clocks are assumed in sync, as NTP keeps them)
TOKENS = "Shoal-Tokens"  # the gateway's estimate of the call's tokens (what pulling is sized by)
REPLY = "Shoal-Reply"
OBJECT = "Shoal-Object"  # the body is in the Object Store under this name
MSG_ID = "Nats-Msg-Id"  # JetStream drops a second publish of the same id (a retried publish)
# On a generation's call: send its progress to the reply inbox as it comes (a streamed chat). On a
# message to that inbox: one such update (`encode_progress`), not the answer.
PROGRESS = "Shoal-Progress"

_KEEP = re.compile(r"[A-Za-z0-9-]")


def token(name: str) -> str:
    """`name` as one NATS subject token and consumer-name part (see the module docstring)."""
    return "".join(ch if _KEEP.fullmatch(ch) else "".join(f"_{b:02x}" for b in ch.encode()) for ch in name)


def untoken(text: str) -> str:
    out = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "_":
            out.append(int(text[i + 1 : i + 3], 16))
            i += 3
        else:
            out += text[i].encode()
            i += 1
    return out.decode()


def work_subject(pool: str, model_id: str) -> str:
    return f"{WORK_PREFIX}.{token(pool)}.{token(model_id)}"


def consumer_name(pool: str, model_id: str) -> str:
    return f"{token(pool)}__{token(model_id)}"


def consumer_of(name: str) -> tuple[str, str] | None:
    """(pool, model id) of a consumer named by `consumer_name`; None for any other name."""
    pool, sep, model = name.partition("__")
    try:
        found = (untoken(pool), untoken(model))
    except (ValueError, UnicodeDecodeError):
        return None
    return found if sep and consumer_name(*found) == name else None


def rpc_subject(action: str, pool: str, model_id: str) -> str:
    return f"{RPC_PREFIX}.{action}.{token(pool)}.{token(model_id)}"


class Heartbeat(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a worker says about itself every `heartbeat_s`."""

    worker: str
    pool: str
    host: str
    devices: tuple[str, ...]
    models: list[ModelStatus]
    problems: list[CardProblem] = []
    free_tokens: int = 0  # how many more tokens it would pull now
    inflight_tokens: int = 0  # tokens it holds (queued on the host or running)
    tokens_per_s: float | None = None
    draining: bool = False  # stopping: it pulls nothing more
    sent_at: float = 0.0  # unix seconds


class RpcRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A control request to the workers serving a model: `admin` (each), `tokenize` or
    `detokenize` (one)."""

    model: str
    action: str | None = None
    texts: list[str] = []
    add_special_tokens: bool = True
    prompt_name: str | None = None
    may_download: bool = True  # tokenize, detokenize: as a call's (calls.Call)
    ids: list[list[int]] = []  # detokenize
    skip_special_tokens: bool = True


class RpcReply(msgspec.Struct, frozen=True, omit_defaults=True):
    worker: str
    status: ModelStatus | None = None
    tokens: list[list[Token]] | None = None
    texts: list[str] | None = None  # detokenize
    error: dict | None = None  # an ErrorResult's fields


async def connect(
    settings: ClusterSettings,
    name: str,
    *,
    on_disconnect=None,
    on_reconnect=None,
    connect_timeout_s: float = 2.0,
    quiet=lambda: False,
):
    """A NATS connection to `settings.nats_url`, with its credentials and TLS (`nats_auth`), that
    reconnects forever (the first attempt included: `nats.connect` gives up on a server that is
    down at start, so this retries it with a back-off; refused credentials too, for they may be
    rotated on the server). `quiet()` true: the owner is closing it, a disconnect is no news."""
    import nats

    from .nats_auth import connect_options

    url = settings.nats_url
    options = connect_options(settings)  # a ConfigError (a missing file) fails at once, never retried

    async def disconnected():
        if quiet():  # closing on purpose
            return
        log.warning("%s: NATS connection lost; reconnecting", name)
        if on_disconnect:
            await on_disconnect()

    async def reconnected():
        log.info("%s: NATS connection back", name)
        if on_reconnect:
            await on_reconnect()

    async def error(exc: Exception):
        if _refused(exc):  # credentials or permissions: the configuration is wrong, retrying will not mend it
            log.error("%s: NATS refused: %s", name, exc)
        else:
            log.debug("%s: NATS: %s", name, exc)

    delay = 0.1
    while True:
        try:
            return await nats.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=connect_timeout_s,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
                allow_reconnect=True,
                **options,
            )
        except Exception as exc:  # broad: every failure to connect is retried (unreachable, refused, DNS...)
            log.log(
                logging.ERROR if _refused(exc) else logging.WARNING,
                "%s: cannot connect to NATS at %s (%s%s); retrying in %.1f s",
                name,
                redact(url),
                exc,
                "; check its credentials (docs/operations.md, 'The bus')" if _refused(exc) else "",
                delay,
                exc_info=not (is_nats_error(exc) or isinstance(exc, ssl.SSLError)),
            )
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


async def ensure_queue(js, settings: ClusterSettings) -> None:
    """The work stream, the dead-letter stream and the payload bucket, created when missing
    (idempotent; every gateway and worker calls it on start and after a reconnect)."""
    from nats.js import api
    from nats.js.errors import BadRequestError, NotFoundError

    streams = [
        # max_age: a backstop for calls nobody will read (their gateway and its callers are gone).
        api.StreamConfig(
            name=STREAM,
            subjects=[f"{WORK_PREFIX}.>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            duplicate_window=120.0,
            max_age=24 * 3600.0,
            description="shoal calls: one subject and one pull consumer per pool and model",
        ),
        api.StreamConfig(
            name=DEAD_STREAM,
            subjects=[DEAD_SUBJECT],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=7 * 24 * 3600.0,
            description="shoal dead letters: calls delivered max_deliver times without an answer",
        ),
    ]
    for config in streams:
        try:
            await js.add_stream(config)
        except BadRequestError:  # exists with another configuration (an older version): bring it up to date
            await js.update_stream(config)
    try:
        await js.object_store(PAYLOADS)
    except NotFoundError:  # BucketNotFoundError: make it
        # Objects outlive a crashed gateway by at most payload_ttl_s.
        bucket_config = api.ObjectStoreConfig(ttl=settings.payload_ttl_s, storage=api.StorageType.FILE)
        await js.create_object_store(PAYLOADS, config=bucket_config)
    else:  # made by an older version or with another TTL: the bucket's stream expires by this one
        bucket = (await js.stream_info(f"OBJ_{PAYLOADS}")).config
        if bucket.max_age != settings.payload_ttl_s:
            ttl = settings.payload_ttl_s
            window = min(bucket.duplicate_window or ttl, ttl)  # JetStream's rule: no longer than max_age
            await js.update_stream(bucket.evolve(max_age=ttl, duplicate_window=window))


async def ensure_consumer(js, settings: ClusterSettings, pool: str, model_id: str) -> None:
    from nats.js import api

    config = api.ConsumerConfig(
        durable_name=consumer_name(pool, model_id),
        filter_subject=work_subject(pool, model_id),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=-1,
        max_waiting=4096,
        deliver_policy=api.DeliverPolicy.ALL,
        description=f"shoal workers of pool {pool} serving {model_id}",
    )
    await js.add_consumer(STREAM, config)


def now() -> float:
    return time.time()


@functools.cache
def nats_errors() -> tuple[type[BaseException], ...]:
    """What talking to NATS raises when it is away, slow or refusing: nats-py's errors (JetStream's
    API errors among them), socket errors and timeouts. (nats-py, the cluster extra, is imported
    only when asked.)"""
    import nats.errors

    return (nats.errors.Error, OSError, asyncio.TimeoutError)


def is_nats_error(exc: BaseException) -> bool:
    """Whether `exc` is one of `nats_errors()` (expected: NATS away) rather than a bug."""
    return isinstance(exc, nats_errors())


def log_swallowed(logger: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """Log what a loop or a request path swallowed: NATS being away at debug, anything else (a bug)
    as a warning with its traceback."""
    if is_nats_error(exc):
        logger.debug(message + ": %r", *args, exc)
    else:
        logger.warning(message + ": %r", *args, exc, exc_info=exc)


def _refused(exc: BaseException) -> bool:
    """Whether NATS refused the client: bad or missing credentials, or a permission violation."""
    text = str(exc).lower()
    return "authorization violation" in text or "permissions violation" in text or "authentication" in text


def redact(url: str) -> str:
    """A NATS URL fit for logs: credentials cut."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def error_of(exc: BaseException, request_id: str | None) -> ErrorResult:
    """What a worker sends back for an exception of its service."""
    if isinstance(exc, ShoalError):
        return ErrorResult.of(exc, request_id)
    return ErrorResult.of(
        ShoalError(
            f"internal error on a worker (request id {request_id}); its log has the traceback",
            details={"request_id": request_id},
        ),
        request_id,
    )


def encode_progress(update: Generated) -> bytes:
    """A generation's progress message: its whole text so far (so a lost message is made up by the
    next one) and its finish reason; the token ids stay on the worker."""
    return msgspec.msgpack.encode((update.text, update.finish_reason))


def decode_progress(data: bytes) -> Generated:
    text, finish_reason = msgspec.msgpack.decode(data, type=tuple[str, str | None])
    return Generated([], text, finish_reason)
