"""CORS (issue 34): off by default; `--allow-origin` lets a browser page on that origin call the
API, preflight included. A real server on loopback, driven as a browser drives it (the preflight's
OPTIONS, then the call with its Origin)."""

from __future__ import annotations

import httpx
import pytest

from conftest import MODEL_ID
from shoal.config import ServerSettings

APP = "https://app.example"
PREFLIGHT = {
    "origin": APP,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}
BODY = {"model": MODEL_ID, "items": [{"text": "a shoal of fish"}]}


@pytest.fixture(scope="module")
def cors_url(serve) -> str:
    return serve(server=ServerSettings(allow_origins=(APP,)))


def test_an_allowed_origin_passes_the_preflight_and_reads_the_answer_and_its_headers(cors_url):
    preflight = httpx.options(f"{cors_url}/v1/encode", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == APP
    assert {"POST"} <= set(preflight.headers["access-control-allow-methods"].replace(" ", "").split(","))
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed
    call = httpx.post(f"{cors_url}/v1/encode", json=BODY, headers={"origin": APP}, timeout=60)
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == APP
    exposed = call.headers["access-control-expose-headers"].lower()
    assert "x-shoal-model" in exposed and "x-request-id" in exposed


def test_another_origin_is_refused_at_the_preflight_and_gets_no_allow_header(cors_url):
    other = {**PREFLIGHT, "origin": "https://evil.example"}
    assert httpx.options(f"{cors_url}/v1/encode", headers=other).status_code == 400
    call = httpx.post(f"{cors_url}/v1/encode", json=BODY, headers={"origin": other["origin"]}, timeout=60)
    assert "access-control-allow-origin" not in call.headers  # the browser keeps the answer from the page


def test_without_the_option_no_cors_headers_are_sent(base_url):
    assert "access-control-allow-origin" not in httpx.options(f"{base_url}/v1/encode", headers=PREFLIGHT).headers
    call = httpx.post(f"{base_url}/v1/encode", json=BODY, headers={"origin": APP}, timeout=60)
    assert call.status_code == 200 and "access-control-allow-origin" not in call.headers


def test_the_flag_repeats_and_the_variable_takes_a_list():
    from shoal.cli import _settings, build_parser
    from shoal.config import Settings

    args = build_parser().parse_args(["serve", "--allow-origin", APP, "--allow-origin", "http://localhost:3000"])
    assert _settings(args, {}).server.allow_origins == (APP, "http://localhost:3000")
    env = {"SHOAL_ALLOW_ORIGINS": f"{APP},http://localhost:3000"}
    assert Settings.from_env(env).server.allow_origins == (APP, "http://localhost:3000")
