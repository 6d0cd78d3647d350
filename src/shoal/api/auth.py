"""Bearer-token auth: who may call, which models, and who may run the admin routes.

Tokens come from a file (`--auth-tokens-file`, SHOAL_AUTH_TOKENS_FILE) and/or the environment
(SHOAL_AUTH_TOKENS and SHOAL_ADMIN_TOKENS, comma-separated). The file is YAML (JSON is YAML):

    tokens:
      - token: "a-long-random-secret"      # or sha256: "<hex digest of the token>"
        name: search-team                  # for the log; never the token itself
        models: ["BAAI/*", "intfloat/e5-small-v2"]   # optional allow-list (ids or globs)
      - token: "a-third-secret"
        name: indexer
        scopes: [download]                  # may make the server fetch a model from the Hub
      - token: "another-secret"
        name: ops
        scopes: [admin]                     # may call POST /v1/models/{id}/load|unload|pin|unpin

A model off a token's allow-list answers that token exactly as a model the server does not have
(404 `unknown_model`, suggesting only ids the token may use), so a token learns nothing of the
others. A request that would download a model's weights (the server's `allow_download` on, the
weights in no local source) needs the `download` scope; `admin` includes it (an operator loads
models), and so does auth off, where `allow_download` alone decides. SHOAL_AUTH_TOKENS' tokens
have no scope, SHOAL_ADMIN_TOKENS' the `admin` scope.

It fails closed: a file that cannot be read or parsed stops the server with one line (ConfigError).
Only SHA-256 digests are kept in memory, compared in constant time (`hmac.compare_digest`)
against every known token. No tokens at all means auth is off, which `shoal serve` allows only
on a host whose every address is loopback, unless `--no-auth` says so; admin routes are off
unless an admin token exists.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import ConfigError, Forbidden, Unauthorized

ADMIN = "admin"
DOWNLOAD = "download"
_SCOPES = (ADMIN, DOWNLOAD)
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Principal:
    """Who a request is: a token's name, scopes and model allow-list (None: every model)."""

    name: str
    scopes: frozenset[str] = frozenset()
    models: tuple[str, ...] | None = None

    def may_use(self, model_id: str) -> bool:
        return self.models is None or any(fnmatch.fnmatchcase(model_id, p) for p in self.models)

    @property
    def may_download(self) -> bool:
        """Whether its requests may make the server download a model (`admin` includes `download`)."""
        return bool(self.scopes & {DOWNLOAD, ADMIN})


ANONYMOUS = Principal("anonymous", frozenset({DOWNLOAD}))  # auth off: every model, downloads as the server allows


@dataclass(frozen=True)
class _Token:
    digest: bytes
    principal: Principal


class Auth:
    def __init__(self, tokens: list[_Token]) -> None:
        self._tokens = tokens

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def has_admin(self) -> bool:
        return any(ADMIN in t.principal.scopes for t in self._tokens)

    @classmethod
    def from_sources(cls, file: Path | None = None, tokens: str = "", admin_tokens: str = "") -> Auth:
        entries = _read_file(file) if file is not None else []
        for variable, value, scopes in (
            ("SHOAL_AUTH_TOKENS", tokens, frozenset()),
            ("SHOAL_ADMIN_TOKENS", admin_tokens, frozenset({ADMIN})),
        ):
            for i, token in enumerate(_split(value)):
                if len(token) < 16:
                    raise ConfigError(f"{variable}: token {i} is shorter than 16 characters")
                entries.append(_Token(_digest(token), Principal(f"{variable.lower()}-{i}", scopes)))
        seen: dict[bytes, str] = {}
        for entry in entries:  # one token, two sets of rights: which applies would be a guess
            if entry.digest in seen:
                raise ConfigError(f"auth tokens: {seen[entry.digest]} and {entry.principal.name} are the same token")
            seen[entry.digest] = entry.principal.name
        return cls(entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `Authorization: Bearer <token>` header; Unauthorized if none matches."""
        if not self._tokens:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthorized("this server needs a bearer token: send `Authorization: Bearer <token>`")
        digest = _digest(presented.strip())
        found = None
        for token in self._tokens:  # every token is compared, so the time says nothing about which
            if hmac.compare_digest(token.digest, digest):
                found = token.principal
        if found is None:
            raise Unauthorized("the bearer token is not valid on this server")
        return found

    def check_admin(self, principal: Principal) -> None:
        if not self.has_admin:
            raise Forbidden(
                "admin routes are off: this server has no admin token (give one the `admin` scope "
                "in the tokens file, or set SHOAL_ADMIN_TOKENS)"
            )
        if ADMIN not in principal.scopes:
            raise Forbidden("this route needs a token with the `admin` scope")


def check_bind(host: str, auth: Auth, no_auth: bool) -> None:
    """Refuse to serve a host without tokens unless every address it resolves to is loopback or
    `--no-auth` says so; a host that does not resolve is refused either way (it cannot be bound)."""
    try:
        addresses = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"--host: cannot resolve host {host!r} ({exc}); give an address or a name that resolves"
        ) from None
    if auth.enabled or no_auth:
        return
    # A scoped IPv6 address (fe80::1%eth0) is not loopback; drop the scope for ip_address.
    public = [a for a in addresses if not ipaddress.ip_address(a.partition("%")[0]).is_loopback]
    if public:
        resolves = f" (it resolves to {', '.join(public)})" if public != [host] else ""
        raise ConfigError(
            f"refusing to serve {host}{resolves} without auth: give tokens (--auth-tokens-file, SHOAL_AUTH_TOKENS) "
            "or pass --no-auth to serve it open"
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _split(tokens: str) -> list[str]:
    return [t.strip() for t in tokens.split(",") if t.strip()]


def _read_file(path: Path) -> list[_Token]:
    def fail(why: str) -> ConfigError:
        return ConfigError(f"auth tokens file {path}: {why}")

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise fail(f"is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or not data["tokens"]:
        raise fail("must be a mapping with a non-empty `tokens` list")
    entries, names = [], set()
    for i, entry in enumerate(data["tokens"]):
        where = f"tokens[{i}]"
        if not isinstance(entry, dict):
            raise fail(f"{where} must be a mapping")
        unknown = set(entry) - {"token", "sha256", "name", "scopes", "models"}
        if unknown:
            raise fail(f"{where} has unknown fields: {', '.join(sorted(unknown))}")
        token, sha = entry.get("token"), entry.get("sha256")
        if (token is None) == (sha is None):
            raise fail(f"{where} needs exactly one of `token` or `sha256`")
        if token is not None and (not isinstance(token, str) or len(token) < 16):
            raise fail(f"{where}.token must be a string of at least 16 characters")
        if sha is not None and not (isinstance(sha, str) and _HEX64.fullmatch(sha.lower())):
            raise fail(f"{where}.sha256 must be 64 hex digits")
        name = entry.get("name", f"token-{i}")
        if not isinstance(name, str) or name in names:
            raise fail(f"{where}.name must be a string, unique in the file")
        names.add(name)
        scopes = entry.get("scopes", [])
        if not isinstance(scopes, list) or any(s not in _SCOPES for s in scopes):
            raise fail(f"{where}.scopes must be a list of: {', '.join(_SCOPES)}")
        models = entry.get("models")
        if models is not None and (
            not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models)
        ):
            raise fail(f"{where}.models must be a non-empty list of model ids or globs")
        if token is not None:
            digest = _digest(token)
        elif sha is not None:
            digest = bytes.fromhex(sha.lower())
        entries.append(_Token(digest, Principal(name, frozenset(scopes), tuple(models) if models else None)))
    return entries
