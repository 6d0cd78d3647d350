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
    # Admission: items waiting (tokenized, not yet run) before new requests get 503.
    max_queue_items: int = 8192
    tokenizer_threads: int = 2
    # Memory budget for loaded weights on the device; None means no limit.
    memory_budget_bytes: int | None = None
    # How long a request waits for a cold model to load before 503 + Retry-After.
    load_timeout_s: float = 120.0
    # Model ids that are never evicted.
    pinned_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    max_items_per_request: int = 2048


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    # Extra directories of model cards (YAML), searched after the built-in catalog.
    models_dirs: tuple[Path, ...] = ()
    # Whether model weights may be fetched from the Hugging Face Hub when not found locally.
    allow_download: bool = True

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        """Settings from SHOAL_* variables (unset ones keep their defaults)."""
        env = dict(os.environ if environ is None else environ)
        server = ServerSettings(
            host=env.get("SHOAL_HOST", ServerSettings.host),
            port=int(env.get("SHOAL_PORT", ServerSettings.port)),
            max_body_bytes=int(env.get("SHOAL_MAX_BODY_BYTES", ServerSettings.max_body_bytes)),
            max_items_per_request=int(env.get("SHOAL_MAX_ITEMS_PER_REQUEST", ServerSettings.max_items_per_request)),
        )
        budget = env.get("SHOAL_MEMORY_BUDGET_BYTES")
        engine = EngineSettings(
            device=env.get("SHOAL_DEVICE", EngineSettings.device),
            max_batch_tokens=int(env.get("SHOAL_MAX_BATCH_TOKENS", EngineSettings.max_batch_tokens)),
            max_batch_items=int(env.get("SHOAL_MAX_BATCH_ITEMS", EngineSettings.max_batch_items)),
            max_queue_items=int(env.get("SHOAL_MAX_QUEUE_ITEMS", EngineSettings.max_queue_items)),
            memory_budget_bytes=int(budget) if budget else None,
        )
        dirs = tuple(Path(p) for p in env.get("SHOAL_MODELS_DIRS", "").split(os.pathsep) if p)
        offline = env.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        return cls(server=server, engine=engine, models_dirs=dirs, allow_download=not offline)
