"""Bearer-token sources (api/auth.py) without a server: env tokens, duplicates, digests, and the
`SHOAL_NO_AUTH` switch that lets a non-loopback address serve without tokens."""

from __future__ import annotations

import hashlib

import pytest

from shoal.api.auth import ANONYMOUS, Auth, check_bind
from shoal.config import Settings
from shoal.errors import ConfigError, Forbidden, Unauthorized


def test_env_tokens_and_a_file_digest_authenticate_with_their_own_rights(tmp_path):
    secret = "a-token-stored-only-as-its-digest"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        f"tokens:\n  - {{sha256: {hashlib.sha256(secret.encode()).hexdigest()}, name: hashed, models: ['team/*']}}\n"
    )
    auth = Auth.from_sources(tokens, "plain-token-0123456789", "admin-token-0123456789")
    hashed = auth.authenticate(f"Bearer {secret}")
    assert hashed.name == "hashed" and hashed.may_use("team/x") and not hashed.may_use("other/x")
    with pytest.raises(Forbidden, match="may not use model"):
        hashed.check_model("other/x")
    assert auth.authenticate("bearer plain-token-0123456789").models is None
    admin = auth.authenticate("Bearer admin-token-0123456789")
    auth.check_admin(admin)
    with pytest.raises(Forbidden, match="admin"):
        auth.check_admin(hashed)
    for header in (None, "", "Basic abc", "Bearer ", "Bearer nope-nope-nope-nope"):
        with pytest.raises(Unauthorized):
            auth.authenticate(header)


def test_no_tokens_is_anonymous_and_only_loopback_may_serve_it():
    auth = Auth.from_sources()
    assert auth.authenticate(None) is ANONYMOUS and not auth.enabled and not auth.has_admin
    check_bind("127.0.0.1", auth, no_auth=False)
    check_bind("::1", auth, no_auth=False)
    check_bind("0.0.0.0", auth, no_auth=True)
    with pytest.raises(ConfigError, match="--no-auth"):
        check_bind("0.0.0.0", auth, no_auth=False)


def test_the_same_token_twice_and_a_short_env_token_are_refused(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {token: shared-token-0123456789, name: limited, models: ['a/*']}\n")
    with pytest.raises(ConfigError, match="limited and shoal_auth_tokens-0 are the same token"):
        Auth.from_sources(tokens, "shared-token-0123456789")
    with pytest.raises(ConfigError, match="SHOAL_ADMIN_TOKENS: token 0 is shorter than 16"):
        Auth.from_sources(admin_tokens="short")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        ("yes", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_shoal_no_auth_is_on_only_for_a_yes(value, expected):
    assert Settings.from_env({"SHOAL_NO_AUTH": value}).server.no_auth is expected
