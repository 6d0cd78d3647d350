"""Settings: frozen dataclasses built once at the edge (CLI, tests) and passed down.

This is the one declaration of every setting: each field's name, type, default and help line (see
`shoal.settings_spec` for what is made of them: the `SHOAL_<NAME>` variable, the `--<name>` flag
of each subcommand that takes it, their parsing and the table in docs/operations.md). This is also
the only module that reads `os.environ`, and only when called. Measured runtime values (loaded
models, queue depth) never live here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .settings_spec import Declared, build, declare, given_text, parse, section, setting, text_of

# The subcommands that take each section's flags (a field may name its own).
_ONE_SHOT = ("encode", "score", "extract")
CATALOG_COMMANDS = ("serve", "gateway", "worker", "dev-cluster", "models", *_ONE_SHOT)
ENGINE_COMMANDS = ("serve", "worker", "dev-cluster", *_ONE_SHOT)
SERVER_COMMANDS = ("serve", "gateway", "dev-cluster")
CLUSTER_COMMANDS = ("gateway", "worker", "dev-cluster")
_WORKER = ("worker", "dev-cluster")
_GATEWAY = ("gateway", "dev-cluster")
# The processes that connect to NATS with credentials of their own (dev-cluster makes its own).
_NATS_CLIENTS = ("gateway", "worker")


@dataclass(frozen=True)
class EngineSettings:
    device: str = setting(
        "cpu", "cpu, cuda or cuda:N; a worker serves each device of a comma-separated list", sep=",", metavar="DEVICE"
    )
    # Batches are cut by real (unpadded) tokens, then by item count.
    max_batch_tokens: int = setting(
        16384, "tokens a batch holds at most, unless the card's batching for this hardware says otherwise"
    )
    max_batch_items: int = setting(
        256, "sequences a batch holds at most, unless the card's batching for this hardware says otherwise"
    )
    # While small requests (up to 4 x min_batch_tokens) and large ones share the device, a batch is
    # also cut to what the device runs in about this long, at the model's measured token rate
    # (never below min_batch_tokens): a small request never waits long behind a bulk job's batch.
    target_batch_s: float | None = setting(
        0.1,
        "while small and large requests share the device, a batch is also "
        "cut to about this long; none: token and item limits only",
    )
    min_batch_tokens: int = setting(256, "tokens a time-cut batch holds at least; requests up to 4x this are small")
    # Admission: a single request larger than either is a 400 (split it).
    max_queue_items: int = setting(8192, "items admitted and not yet answered before new requests get 503")
    max_queue_tokens: int = setting(
        1_048_576, "estimated tokens admitted and not yet answered before new requests get 503"
    )
    # Admission by time: the backlog (admitted, unanswered tokens at each model's measured rate)
    # plus the request may take at most this long, or the call's own timeout if shorter.
    max_queue_s: float | None = setting(
        30.0,
        "seconds of work (at the measured token rate) admitted and not yet answered before new "
        "requests get 503 with a Retry-After from that backlog; none: the token and item limits only",
    )
    request_timeout_s: float = setting(
        300.0,
        "deadline of a call that names none (its options.timeout_s); work past it is dropped and answered 504",
        commands=(*ENGINE_COMMANDS, "gateway"),
    )
    max_result_bytes: int = setting(
        64 * 1024 * 1024, "largest result one call may produce (raw array bytes, estimated before compute)"
    )
    # engine/image_inputs.py: what a client's image file may be, checked before its pixels are decoded.
    max_image_bytes: int = setting(20 * 1024 * 1024, "largest image file an item may carry; a larger one gets 413")
    max_image_pixels: int = setting(
        36_000_000, "most pixels an image's header may declare (width x height); more gets 413, before decoding"
    )
    device_restart_delay_s: float = setting(1.0, "pause before a dead device thread is restarted")
    # dev-cluster has a --stop-timeout-s of its own (how long each process has to stop).
    stop_timeout_s: float = setting(
        60.0,
        "how long stopping waits for a running batch",
        commands=tuple(c for c in ENGINE_COMMANDS if c != "dev-cluster"),
    )
    tokenizer_threads: int = setting(2, "threads of the tokenizer pool")
    # engine/device.py: each lane runs on its share of torch's threads.
    device_lanes: int | None = setting(
        None,
        "batches the device runs side by side (on a GPU each lane its own CUDA stream); none: 2, 1 on a one-core CPU",
        also=("--lanes",),
    )
    # layers/packed.py.
    onednn_linear: bool = setting(
        True, "float32 CPU models run their Linears on oneDNN-packed weights; false: torch's nn.Linear (MKL sgemm)"
    )
    # engine/precision.py.
    reduced_precision: bool = setting(
        True,
        "a float32 card whose quality gate passed in bfloat16 (its `precisions`) runs bfloat16 on a CPU "
        "with native bf16 (AMX, AVX512-BF16); false: every card runs its own dtype",
    )
    # engine/graphs.py.
    cuda_graphs: bool = setting(
        False,
        "on a CUDA device, each token bucket's forward is captured once as a CUDA graph and replayed; "
        "off by default until bench/gpu_check.py has run it on a GPU",
    )
    # engine/memory.py: resident models, their adapters and the batch workspace.
    memory_budget_bytes: int | None = setting(
        None,
        "bytes resident models may hold before the least recently used "
        "idle one is evicted; none: 80% of the RAM or VRAM free at start",
    )
    load_timeout_s: float = setting(
        30.0, "how long a request waits for a cold model to load before 503", commands=(*ENGINE_COMMANDS, "gateway")
    )
    load_backoff_s: float = setting(
        1.0,
        "after a failed load, requests get its failure (502) without a new "
        "attempt for this long, doubling per failure up to 60 s",
    )
    pinned_models: tuple[str, ...] = setting(
        (), "model ids never evicted (a card may also say pin: true)", also=("--pin",), metavar="MODEL"
    )
    watch_interval_s: float | None = setting(
        2.0, "how often the models directories are checked for new, changed or removed cards and adapters; none: never"
    )


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("127.0.0.1", "address to bind", metavar="ADDRESS")
    port: int = setting(8080, "port to listen on", metavar="PORT")
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body; a larger one gets 413")
    max_items_per_request: int = setting(2048, "items one request may carry")
    # HTTP limits (enforced in api/server.py, documented in docs/operations.md).
    max_header_bytes: int = setting(64 * 1024, "bytes of request line plus headers; more gets 431")
    header_read_timeout_s: float = setting(
        10.0, "from a connection's start (or a kept-alive request's first byte) to the end of its headers; then 408"
    )
    body_read_timeout_s: float = setting(30.0, "longest gap between body bytes while a body is incomplete; then 408")
    keep_alive_timeout_s: float = setting(5.0, "an idle kept-alive connection is closed after this long")
    max_connections: int = setting(
        1000,
        "open connections; past it a new one displaces an idle one (of the peer holding the most), "
        "else gets 503; lowered below the process's file-descriptor limit",
    )
    listen_backlog: int = setting(2048, "connections the kernel queues before the server accepts them")
    # Bearer tokens (api/auth.py). None of the three: no auth (loopback only, unless `no_auth`).
    auth_tokens_file: Path | None = setting(
        None,
        "bearer tokens, a YAML file (docs/operations.md); more tokens come "
        "from the variables SHOAL_AUTH_TOKENS and SHOAL_ADMIN_TOKENS",
        metavar="FILE",
        refuse_empty="name the tokens file, or leave the setting out to serve without tokens (loopback only)",
    )
    auth_tokens: str = setting("", "bearer tokens for every model, comma-separated", secret=True)
    admin_tokens: str = setting("", "bearer tokens with the admin scope, comma-separated", secret=True)
    no_auth: bool = setting(False, "serve a non-loopback address without tokens")
    default_model: str | None = setting(
        None,
        "the model of routes whose bodies name none (TEI's), unless ?model= "
        "or X-Shoal-Model says; none: the one preloaded model of the verb (several: 400)",
        metavar="MODEL",
    )
    auto_truncate: bool = setting(
        False,
        "TEI's routes cut texts longer than the model takes when the body does not say `truncate` "
        "(TEI's --auto-truncate); off: they are a 422, as TEI's default",
    )
    allow_origins: tuple[str, ...] = setting(
        (),
        "web origins a browser may call the API from (CORS), e.g. https://app.example; '*' any; "
        "none: no CORS headers (browsers refuse cross-origin calls)",
        also=("--allow-origin",),
        metavar="ORIGIN",
    )


@dataclass(frozen=True)
class ClusterSettings:
    """`shoal gateway` and `shoal worker` (shoal/cluster): the NATS JetStream work queue."""

    # dev-cluster starts its own NATS.
    nats_url: str = setting(
        "nats://127.0.0.1:4222", "the NATS server with JetStream", commands=_NATS_CLIENTS, metavar="URL"
    )
    # cluster/nats_auth.py: one kind of credentials (user and password, a creds file, an nkey seed).
    nats_user: str = setting(
        "",
        "the NATS user (its password: the variable SHOAL_NATS_PASSWORD)",
        commands=_NATS_CLIENTS,
        metavar="USER",
    )
    nats_password: str = setting("", "the NATS user's password", secret=True, commands=_NATS_CLIENTS)
    nats_creds_file: Path | None = setting(
        None,
        "a NATS credentials file (JWT and nkey seed, as `nsc` writes it)",
        commands=_NATS_CLIENTS,
        metavar="FILE",
    )
    nats_nkey_seed_file: Path | None = setting(
        None, "a file holding the NATS user's nkey seed (SU...)", commands=_NATS_CLIENTS, metavar="FILE"
    )
    nats_tls_ca_file: Path | None = setting(
        None,
        "the CA certificate (PEM) that signed the NATS server's; set, or a tls:// URL: TLS to NATS",
        commands=_NATS_CLIENTS,
        metavar="FILE",
    )
    nats_tls_cert_file: Path | None = setting(
        None,
        "a client certificate (PEM) for a NATS server that verifies clients",
        commands=_NATS_CLIENTS,
        metavar="FILE",
    )
    nats_tls_key_file: Path | None = setting(
        None, "the client certificate's private key (PEM)", commands=_NATS_CLIENTS, metavar="FILE"
    )
    pool: str = setting(
        "default",
        "the worker pool: workers serve the subjects shoal.work.<pool>.<model>; a "
        "gateway sends to any pool that serves a model",
        metavar="NAME",
    )
    ack_wait_s: float = setting(
        30.0, "a delivered call not acked (nor marked in progress) within this long is redelivered to another worker"
    )
    max_deliver: int = setting(
        5, "deliveries of one call before it goes to the dead-letter stream and its caller gets a 5xx"
    )
    heartbeat_s: float = setting(1.0, "how often a worker announces itself", commands=_WORKER)
    worker_ttl_s: float = setting(5.0, "a worker silent this long serves nothing", commands=_GATEWAY)
    # Shallow, so what stays in the queue goes to whichever device frees up first; 0.4 s, not 0.2:
    # deep enough for batches that amortise a batch's fixed cost (bench/cluster.py --mix --burst 1:
    # knee 147.0 vs 132.4 req/s, devices 87 % vs 75 % busy); 0.6 s and deeper lose fleets of unequal
    # devices (bench/cluster_sim.py, docs/benchmarks.md).
    prefetch_s: float = setting(
        0.4, "seconds of work (at each device's measured tokens/s) a worker keeps pulled per device", commands=_WORKER
    )
    min_inflight_tokens: int = setting(
        4096, "tokens a worker keeps pulled per device before a rate is measured", commands=_WORKER
    )
    nak_delay_s: float = setting(
        0.05, "what a worker pulled beyond that goes back to the queue after this delay", commands=_WORKER
    )
    # cluster/pulling.py: a model no device of the host has loaded costs a load (a swap) to serve,
    # so its calls are left to the workers that have it loaded, unless this host is idle.
    model_affinity: bool = setting(
        True,
        "a worker pulls the calls of models its devices have loaded while it has room, and another "
        "model's only when idle and they have waited (or, busy, when nobody takes them); false: every model alike",
        commands=_WORKER,
    )
    cold_pull_after_s: float = setting(
        0.2,
        "with model_affinity, how long calls of a model none of a worker's devices has loaded wait in the "
        "queue before an idle worker pulls them, paying the load (about a load's time)",
        commands=_WORKER,
    )
    # cluster/backlog.py: the cold looks above read this feed, not JetStream's API (one request per look).
    backlog_s: float = setting(
        0.1,
        "how often a gateway publishes each model's queued calls for the workers (about one gateway does); "
        "0: it does not, and workers ask JetStream",
    )
    publish_timeout_s: float = setting(
        5.0,
        "longest wait for a publish's ack (while NATS is unreachable a gateway answers 503 at once)",
        commands=_GATEWAY,
    )
    # Payloads outlive their call only when a gateway crashed before deleting them.
    payload_ttl_s: float = setting(
        3600.0,
        "large calls and results in the Object Store expire after this long (keep it above the longest call timeout)",
    )
    payload_headroom_bytes: int = setting(
        64 * 1024, "calls and results larger than the server's message limit less this go through the Object Store"
    )


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = section(ServerSettings, SERVER_COMMANDS)
    engine: EngineSettings = section(EngineSettings, ENGINE_COMMANDS)
    models_dirs: tuple[Path, ...] = setting(
        (),
        "more directories of model cards (*.yaml) and adapters "
        "(DIR/adapters/NAME), after the built-in catalog; a server "
        "watches them",
        also=("--models-dir",),
        sep=os.pathsep,
        metavar="DIR",
        merge=True,
    )
    allow_download: bool = setting(
        True,
        "fetch model weights from the Hugging Face Hub when not found locally (HF_HUB_OFFLINE=1 also turns it off)",
    )
    models: tuple[str, ...] = setting(
        (), "the ids or globs of the cards served (listed, loaded); none: every card", metavar="IDS"
    )
    aliases: tuple[tuple[str, str], ...] = setting(
        (),
        "more names for served models (e.g. an OpenAI model name)",
        also=("--alias",),
        metavar="NAME=MODEL",
        merge=True,
    )
    cluster: ClusterSettings = section(ClusterSettings, CLUSTER_COMMANDS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from SHOAL_* variables (unset ones keep their defaults); `environ` defaults to os.environ."""
        return cls.resolve(environ)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, flags: Mapping[str, str] | None = None) -> Settings:
        """Defaults < environment (`environ`, default os.environ) < `flags` (text keyed by field name,
        as `settings_spec.given` reads them off the command line). ConfigError names what does not parse."""
        env = os.environ if environ is None else environ
        values = {}
        for d in declared():
            text = given_text(d, env.get(d.env), d.env)
            if text is not None:
                values[d.path] = parse(d, text, d.env)
            elif d.name == "allow_download" and _offline(env.get("HF_HUB_OFFLINE", "")):
                values[d.path] = False  # huggingface_hub's own switch, read by its rule
            flag_text = given_text(d, (flags or {}).get(d.name), "/".join(d.flags))
            if flag_text is not None:
                flagged = parse(d, flag_text, "/".join(d.flags))
                merged = d.spec.merge and values.get(d.path)
                values[d.path] = values[d.path] + flagged if merged else flagged
        return build(cls, declared(), values)


@functools.cache
def declared() -> tuple[Declared, ...]:
    """Every setting, in declaration order (the sections where Settings holds them)."""
    return declare(Settings, CATALOG_COMMANDS)


def environ_of(settings: Settings) -> dict[str, str]:
    """Every setting as its SHOAL_* variable: what makes a child process resolve the same settings."""
    out = {}
    for d in declared():
        value = getattr(getattr(settings, d.section), d.name) if d.section else getattr(settings, d.name)
        out[d.env] = text_of(d, value)
    return out


def child_environ(settings: Settings, **extra: str) -> dict[str, str]:
    """This process's environment with `settings` (and `extra`) written over it, for a child shoal."""
    return {**os.environ, **environ_of(settings), **extra}


def _offline(value: str) -> bool:
    """HF_HUB_OFFLINE read as huggingface_hub reads it."""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")
