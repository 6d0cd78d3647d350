"""Settings: frozen dataclasses built once at the edge (CLI, tests) and passed down.

This is the only module that reads `os.environ`, and only inside `Settings.from_env`.
Measured runtime values (loaded models, queue depth) never live here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EngineSettings:
    device: str = "cpu"
    # Batches are cut by real (unpadded) tokens, then by item count.
    max_batch_tokens: int = 16384
    max_batch_items: int = 256
    # While small requests (up to 4 x min_batch_tokens) and large ones share the device, a batch is
    # also cut to what the device runs in about this long, at the model's measured token rate
    # (never below min_batch_tokens): a small request never waits long behind a bulk job's batch.
    # None: token and item limits only.
    target_batch_s: float | None = 0.1
    min_batch_tokens: int = 256
    # Admission: items and estimated tokens admitted (not yet answered) before new requests get
    # 503 + Retry-After; a single request larger than either is a 400 (split it).
    max_queue_items: int = 8192
    max_queue_tokens: int = 1_048_576
    # The deadline of a call that names none (request option `timeout_s`); work past it is dropped
    # before compute and answered 504.
    request_timeout_s: float = 300.0
    # The largest result one call may produce (estimated before compute, raw array bytes).
    max_result_bytes: int = 64 * 1024 * 1024
    # A dead device thread is restarted after this pause; stop() waits this long for a running batch.
    device_restart_delay_s: float = 1.0
    stop_timeout_s: float = 60.0
    tokenizer_threads: int = 2
    # Batches the device runs side by side, each on its share of torch's threads (engine/device.py);
    # None: 2 on a CPU with 2+ cores, 1 elsewhere. GPUs take 1.
    device_lanes: int | None = None
    # float32 CPU models run their Linears on oneDNN-packed weights (layers/packed.py); False: torch's
    # own Linear (MKL sgemm). SHOAL_ONEDNN_LINEAR=0 turns it off.
    onednn_linear: bool = True
    # Memory budget on the device (resident models, their adapters and the batch workspace);
    # None: 80 % of the RAM (or VRAM) free when the engine starts (engine/memory.py).
    memory_budget_bytes: int | None = None
    # How long a request waits for a cold model to load before 503 + Retry-After.
    load_timeout_s: float = 30.0
    # After a failed load, requests get the failure (502) without a new attempt for this long,
    # doubling per failure up to 60 s.
    load_backoff_s: float = 1.0
    # Model ids that are never evicted (cards may also say `pin: true`).
    pinned_models: tuple[str, ...] = ()
    # How often the models directories are checked for new, changed or removed cards and adapters;
    # None: never (no hot add).
    watch_interval_s: float | None = 2.0


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    max_items_per_request: int = 2048
    # HTTP limits (enforced in api/server.py, documented in docs/operations.md).
    # Request line plus headers; more gets 431.
    max_header_bytes: int = 64 * 1024
    # From a connection's start (or a kept-alive request's first byte) to the end of its headers.
    header_read_timeout_s: float = 10.0
    # Longest gap between body bytes while a body is incomplete; then 408.
    body_read_timeout_s: float = 30.0
    # An idle kept-alive connection is closed after this long.
    keep_alive_timeout_s: float = 5.0
    # Open connections (idle ones count); the next gets 503 at once. Lowered below the process's
    # file-descriptor limit when that is smaller.
    max_connections: int = 1000
    # Connections the kernel queues before the server accepts them.
    listen_backlog: int = 2048
    # Bearer tokens (api/auth.py): a YAML file, and comma-separated tokens (SHOAL_AUTH_TOKENS) and
    # admin tokens (SHOAL_ADMIN_TOKENS). None of them: no auth (loopback only, unless `no_auth`).
    auth_tokens_file: Path | None = None
    auth_tokens: str = field(default="", repr=False)
    admin_tokens: str = field(default="", repr=False)
    # Serve a non-loopback address without tokens (`--no-auth`).
    no_auth: bool = False
    # The model of routes whose bodies name none (TEI's) when the request picks none either
    # (`--default-model`); None: the first preloaded model that serves the verb.
    default_model: str | None = None


@dataclass(frozen=True)
class ClusterSettings:
    """`shoal gateway` and `shoal worker` (shoal/cluster): the NATS JetStream work queue."""

    nats_url: str = "nats://127.0.0.1:4222"
    # Workers serve the subjects `shoal.work.<pool>.<model>`; a gateway sends to any pool that serves a model.
    pool: str = "default"
    # A delivered call not acked (nor marked in progress) within this long is redelivered to another worker.
    ack_wait_s: float = 30.0
    # Deliveries of one call before it goes to the dead-letter stream and its caller gets a 5xx.
    max_deliver: int = 5
    # Workers announce themselves this often; one silent for `worker_ttl_s` serves nothing.
    heartbeat_s: float = 1.0
    worker_ttl_s: float = 5.0
    # A worker keeps about this many seconds of work (at each device's measured tokens/s) pulled and
    # in flight per device, `min_inflight_tokens` before a rate is measured: more stays in the queue
    # for whichever device frees up first (bench/cluster.py: deeper budgets make pulling no better
    # than round-robin pushing).
    prefetch_s: float = 0.2
    min_inflight_tokens: int = 4096
    # What a worker pulled beyond that comes back to the queue after this delay (nak).
    nak_delay_s: float = 0.05
    # A gateway answers 503 at once while NATS is unreachable; this long at most for a publish's ack.
    publish_timeout_s: float = 5.0
    # Calls and results larger than the server's message limit less this go through the Object Store.
    payload_headroom_bytes: int = 64 * 1024


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    # Extra directories of model cards (YAML), searched after the built-in catalog.
    models_dirs: tuple[Path, ...] = ()
    # Whether model weights may be fetched from the Hugging Face Hub when not found locally.
    allow_download: bool = True
    # `--models`: the ids or globs of the cards this server serves (lists, loads); () all.
    models: tuple[str, ...] = ()
    # `--alias NAME=MODEL` (SHOAL_ALIASES="NAME=MODEL,..."): more names for served models.
    aliases: tuple[tuple[str, str], ...] = ()
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        """Settings from SHOAL_* variables (unset ones keep their defaults)."""
        env = dict(os.environ if environ is None else environ)
        server = ServerSettings(
            host=env.get("SHOAL_HOST", ServerSettings.host),
            port=int(env.get("SHOAL_PORT", ServerSettings.port)),
            max_body_bytes=int(env.get("SHOAL_MAX_BODY_BYTES", ServerSettings.max_body_bytes)),
            max_items_per_request=int(env.get("SHOAL_MAX_ITEMS_PER_REQUEST", ServerSettings.max_items_per_request)),
            max_header_bytes=int(env.get("SHOAL_MAX_HEADER_BYTES", ServerSettings.max_header_bytes)),
            header_read_timeout_s=float(env.get("SHOAL_HEADER_READ_TIMEOUT_S", ServerSettings.header_read_timeout_s)),
            body_read_timeout_s=float(env.get("SHOAL_BODY_READ_TIMEOUT_S", ServerSettings.body_read_timeout_s)),
            keep_alive_timeout_s=float(env.get("SHOAL_KEEP_ALIVE_TIMEOUT_S", ServerSettings.keep_alive_timeout_s)),
            max_connections=int(env.get("SHOAL_MAX_CONNECTIONS", ServerSettings.max_connections)),
            listen_backlog=int(env.get("SHOAL_LISTEN_BACKLOG", ServerSettings.listen_backlog)),
            auth_tokens_file=Path(env["SHOAL_AUTH_TOKENS_FILE"]) if env.get("SHOAL_AUTH_TOKENS_FILE") else None,
            auth_tokens=env.get("SHOAL_AUTH_TOKENS", ""),
            admin_tokens=env.get("SHOAL_ADMIN_TOKENS", ""),
            no_auth=env.get("SHOAL_NO_AUTH", "").strip().lower() in ("1", "true", "yes", "on"),
            default_model=env.get("SHOAL_DEFAULT_MODEL") or None,
        )
        budget = env.get("SHOAL_MEMORY_BUDGET_BYTES")
        engine = EngineSettings(
            device=env.get("SHOAL_DEVICE", EngineSettings.device),
            max_batch_tokens=int(env.get("SHOAL_MAX_BATCH_TOKENS", EngineSettings.max_batch_tokens)),
            max_batch_items=int(env.get("SHOAL_MAX_BATCH_ITEMS", EngineSettings.max_batch_items)),
            target_batch_s=_optional_float(env.get("SHOAL_TARGET_BATCH_S"), EngineSettings.target_batch_s),
            min_batch_tokens=int(env.get("SHOAL_MIN_BATCH_TOKENS", EngineSettings.min_batch_tokens)),
            max_queue_items=int(env.get("SHOAL_MAX_QUEUE_ITEMS", EngineSettings.max_queue_items)),
            max_queue_tokens=int(env.get("SHOAL_MAX_QUEUE_TOKENS", EngineSettings.max_queue_tokens)),
            request_timeout_s=float(env.get("SHOAL_REQUEST_TIMEOUT_S", EngineSettings.request_timeout_s)),
            max_result_bytes=int(env.get("SHOAL_MAX_RESULT_BYTES", EngineSettings.max_result_bytes)),
            memory_budget_bytes=int(budget) if budget else None,
            device_lanes=int(env["SHOAL_DEVICE_LANES"]) if env.get("SHOAL_DEVICE_LANES") else None,
            onednn_linear=env.get("SHOAL_ONEDNN_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off"),
        )
        dirs = tuple(Path(p) for p in env.get("SHOAL_MODELS_DIRS", "").split(os.pathsep) if p)
        offline = env.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        models = tuple(m for m in env.get("SHOAL_MODELS", "").split(",") if m)
        pairs = [a.split("=", 1) for a in env.get("SHOAL_ALIASES", "").split(",") if "=" in a]
        aliases = tuple((name.strip(), target.strip()) for name, target in pairs if name.strip() and target.strip())
        cluster = ClusterSettings(
            nats_url=env.get("SHOAL_NATS_URL", ClusterSettings.nats_url),
            pool=env.get("SHOAL_POOL", ClusterSettings.pool),
            ack_wait_s=float(env.get("SHOAL_ACK_WAIT_S", ClusterSettings.ack_wait_s)),
            max_deliver=int(env.get("SHOAL_MAX_DELIVER", ClusterSettings.max_deliver)),
        )
        return cls(server=server, engine=engine, models_dirs=dirs, allow_download=not offline, models=models,
                   aliases=aliases, cluster=cluster)


def _optional_float(value: str | None, default: float | None) -> float | None:
    """A float setting where "" keeps the default and "none" (or "0") turns it off."""
    if value is None or value == "":
        return default
    if value.lower() in ("none", "off", "0"):
        return None
    return float(value)
