"""Who may talk on the cluster's bus: the NATS credentials and TLS of gateways and workers, and the
server side of them that `shoal dev-cluster` (and the Helm chart's own NATS) configures.

    client side   ClusterSettings ─ connect_options ─▶ nats.connect(user/password | creds file |
                  nkey seed file, tls=SSLContext)          (a bad file or pair is a ConfigError)
    server side   users with PERMISSIONS by role:
                    gateway  publishes calls, cancels, pings, RPCs; reads heartbeats and its inbox
                    worker   pulls and acks (JetStream API), replies to inboxes, sends heartbeats;
                             reads cancels, pings and RPCs, but no other caller's results
                  a client with no credentials is refused at connect

Secrets are read here and handed to nats-py; they are never logged (`protocol.redact` cuts them
out of URLs too). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ClusterSettings
from ..errors import ConfigError
from . import protocol as p

GATEWAY, WORKER = "gateway", "worker"

# JetStream's API (streams, consumers, pulls, deletes), its acks and flow control, the payload bucket.
_JETSTREAM = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", f"$O.{p.PAYLOADS}.>"]
_RESULTS = "_INBOX.shoal.>"  # the gateways' reply subjects (gateway.py: `_INBOX.shoal.<gateway>.<call>`)

# Role -> nats-server permissions (the `permissions` block of a user). The Helm chart's NATS
# configures the same (tests/test_helm.py compares them).
PERMISSIONS: dict[str, dict[str, Any]] = {
    GATEWAY: {
        "publish": {
            "allow": [
                f"{p.WORK_PREFIX}.>",
                p.PING_SUBJECT,
                p.CANCEL_SUBJECT,
                f"{p.RPC_PREFIX}.>",
                "_INBOX.>",  # dead letters answered to their callers (dead_letters.py)
                *_JETSTREAM,
            ]
        },
        "subscribe": {"allow": ["_INBOX.>", f"{p.HEARTBEAT_PREFIX}.>"]},
    },
    WORKER: {
        "publish": {"allow": [f"{p.HEARTBEAT_PREFIX}.>", "_INBOX.>", *_JETSTREAM]},
        "subscribe": {
            "allow": ["_INBOX.>", p.PING_SUBJECT, p.CANCEL_SUBJECT, f"{p.RPC_PREFIX}.>"],
            "deny": [_RESULTS],
        },
    },
}


def connect_options(settings: ClusterSettings) -> dict[str, Any]:
    """The keyword arguments of `nats.connect` for `settings`' credentials and TLS (none: {})."""
    options: dict[str, Any] = {}
    given = [
        name
        for name, value in (
            ("nats_user", settings.nats_user),
            ("nats_creds_file", settings.nats_creds_file),
            ("nats_nkey_seed_file", settings.nats_nkey_seed_file),
        )
        if value
    ]
    if len(given) > 1:
        raise ConfigError(f"give one kind of NATS credentials, not {' and '.join(given)}")
    if settings.nats_password and not settings.nats_user:
        raise ConfigError("SHOAL_NATS_PASSWORD is set without a NATS user (SHOAL_NATS_USER / --nats-user)")
    if settings.nats_user:
        if not settings.nats_password:
            raise ConfigError(f"NATS user {settings.nats_user!r} has no password: set SHOAL_NATS_PASSWORD")
        options.update(user=settings.nats_user, password=settings.nats_password)
    if settings.nats_creds_file:
        options["user_credentials"] = str(_readable(settings.nats_creds_file, "nats_creds_file"))
        _need_nkeys("nats_creds_file")
    if settings.nats_nkey_seed_file:
        options["nkeys_seed"] = str(_readable(settings.nats_nkey_seed_file, "nats_nkey_seed_file"))
        _need_nkeys("nats_nkey_seed_file")
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    return options


def tls_context(settings: ClusterSettings) -> ssl.SSLContext | None:
    """TLS to NATS: the CA that signed the server's certificate (none: the system's), and a client
    certificate when the server asks for one. None when nothing of TLS is set and the URL is not
    tls:// (nats-py then speaks plain TCP)."""
    cert, key, ca = settings.nats_tls_cert_file, settings.nats_tls_key_file, settings.nats_tls_ca_file
    if bool(cert) != bool(key):
        raise ConfigError("a NATS client certificate needs both nats_tls_cert_file and nats_tls_key_file")
    if not (ca or cert or settings.nats_url.startswith("tls://")):
        return None
    try:
        context = ssl.create_default_context(cafile=str(_readable(ca, "nats_tls_ca_file")) if ca else None)
        if cert and key:
            context.load_cert_chain(
                str(_readable(cert, "nats_tls_cert_file")), str(_readable(key, "nats_tls_key_file"))
            )
    except ssl.SSLError as exc:
        raise ConfigError(f"the NATS TLS files do not load: {exc}") from None
    return context


def _readable(path: Path, setting: str) -> Path:
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ConfigError(f"{setting} (SHOAL_{setting.upper()}): {path} is not a readable file")
    return path


def _need_nkeys(setting: str) -> None:
    try:
        import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
    except ImportError:
        raise ConfigError(f"{setting} needs the nkeys package: pip install 'shoal[cluster]'") from None


# --- server side: what dev-cluster generates ------------------------------------------------------


@dataclass(frozen=True)
class DevCredentials:
    """One run's credentials, made fresh: an nkey per role (its seed in a file only the owner
    reads), so no secret ever crosses the wire or a command line."""

    seed_files: dict[str, Path]  # role -> seed file
    public_keys: dict[str, str]  # role -> public nkey (what the server knows)

    @classmethod
    def make(cls, directory: Path) -> DevCredentials:
        _need_nkeys("shoal dev-cluster")
        import nkeys

        seed_files, public_keys = {}, {}
        for role in PERMISSIONS:
            seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
            path = directory / f"{role}.nk"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(seed + b"\n")
            seed_files[role] = path
            public_keys[role] = nkeys.from_seed(bytearray(seed)).public_key.decode()
        return cls(seed_files, public_keys)

    def users(self) -> list[dict[str, Any]]:
        return [{"nkey": key, "permissions": PERMISSIONS[role]} for role, key in self.public_keys.items()]


def server_config(users: list[dict[str, Any]], *, tls: dict[str, str] | None = None) -> str:
    """A nats-server configuration's authorization (and TLS) blocks: `users` as nats-server takes
    them ({"user", "password"} or {"nkey"}, each with its "permissions"). JSON values, which
    nats-server's configuration format reads as they are."""
    lines = ["authorization {", f"  users: {json.dumps(users, indent=2)}", "}"]
    if tls:
        lines += ["tls " + json.dumps(tls, indent=2)]
    return "\n".join(lines) + "\n"
