"""`/docs` works with no network: Swagger UI's files come from the server itself (the
swagger-ui-bundle-v2 package, under `/docs/assets/`, an allow-list of three names), the operations
are grouped by family (the route table's `TAGS`), the request fields are described, and each body
route's example names a model the server serves.

The browser test runs Debian's `chromium` headless with no network but a loopback of its own. It
runs in a new network namespace (`unshare --net --map-root-user`: the user namespace lets a
non-root user make one where the kernel allows it), whose only interface is a loopback that
`ip link set lo up` brings up: no route, no DNS, nothing on another host is reachable from it. The
test's own loopback is another namespace's, so the helper that starts the browser first binds a
listening socket on 127.0.0.1 inside the namespace and hands its file descriptor to the test over
a Unix socket pair (SCM_RIGHTS); uvicorn, in the test process, accepts on it, and the browser's
connections to 127.0.0.1:PORT reach it. A page that loads Swagger UI from a CDN renders no
operations there (the page that did so rendered an empty `<div id="ui">`).
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import need_tool, running_server

pytestmark = pytest.mark.timeout(240)

# The virtual time the page gets to load and render (Chromium runs its clock ahead when idle).
VIRTUAL_TIME_MS = 20_000
BROWSER_TIMEOUT_S = 120.0
# The model the browser test's server preloads: the examples name it, the first listed model not.
PRELOADED = "standin/dense-8-raw"
# In the namespace: bind the listening socket, hand it over, wait for the server, become the browser.
#   argv: CHANNEL_FD PATH BROWSER ARGS...  (the browser gets ARGS and http://127.0.0.1:PORT/PATH)
_IN_NAMESPACE = r"""
import os, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
listener = socket.create_server(("127.0.0.1", 0))
socket.send_fds(channel, [b"listening"], [listener.fileno()])
channel.recv(1)
url = f"http://127.0.0.1:{listener.getsockname()[1]}{sys.argv[2]}"
os.execvp(sys.argv[3], [*sys.argv[3:], url])
"""


def offline_browser() -> str:
    """chromium's path, once this machine can run it in a network namespace of its own."""
    chromium = shutil.which("chromium")
    need_tool(chromium is not None, "chromium is not installed: apt-get install chromium (.ci/run does)")
    assert chromium is not None
    need_tool(shutil.which("unshare") is not None and shutil.which("ip") is not None, "unshare or ip is missing")
    probe = subprocess.run(
        ["unshare", "--net", "--map-root-user", "ip", "link", "set", "lo", "up"], capture_output=True
    )
    need_tool(probe.returncode == 0, f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    return chromium


def dump_dom_offline(app, path: str, profile: Path) -> str:
    """The DOM of `path` as headless Chromium leaves it, the browser cut off from every network but
    the loopback the app is served on (the module's docstring says how)."""
    from shoal.api.server import build_server
    from shoal.config import ServerSettings

    browser_args = [
        offline_browser(),
        "--headless",
        "--no-sandbox",  # the namespace's root may not set up Chromium's own sandbox
        "--disable-gpu",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--dump-dom",
    ]
    in_namespace = [sys.executable, "-c", _IN_NAMESPACE]
    ours, theirs = socket.socketpair()
    command = ["unshare", "--net", "--map-root-user", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    command += [*in_namespace, str(theirs.fileno()), path, *browser_args]
    with (
        ours,
        subprocess.Popen(
            command, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as browser,
    ):
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 16, 1)
        if not fds:
            _, err = browser.communicate(timeout=BROWSER_TIMEOUT_S)
            raise AssertionError(f"the namespace helper handed over no socket: {err[-2000:]}")
        listener = socket.socket(fileno=fds[0])
        server = build_server(app, ServerSettings(), log_level="warning")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="uvicorn", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30.0
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            ours.send(b"go")
            try:
                dom, err = browser.communicate(timeout=BROWSER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                browser.kill()
                raise
        finally:
            server.should_exit = True
            thread.join(30)
            listener.close()
    assert browser.returncode == 0, err[-2000:]
    return dom


def standin_app(preload: tuple[str, ...] = (), auth_tokens: str = ""):
    from shoal.api import create_app
    from shoal.config import ServerSettings, Settings
    from standin import StandIn

    return create_app(Settings(server=ServerSettings(auth_tokens=auth_tokens)), StandIn(), preload=preload)


def test_docs_renders_every_family_of_routes_in_a_browser_with_no_network(tmp_path):
    # The deep link opens /v1/encode, so its example body is in the DOM too.
    dom = dump_dom_offline(standin_app((PRELOADED,)), "/docs#/native/post_v1_encode", tmp_path / "profile")

    paths = ("/v1/encode", "/v1/embeddings", "/v1/rerank", "/v2/embed", "/embed", "/docs")
    rendered = [path for path in paths if f'data-path="{path}"' in dom]
    assert len(rendered) == len(paths), f"operations rendered: {rendered}; the DOM:\n{dom[:3000]}"
    assert 'data-path="/v1/models/{model_path}"' in dom
    from shoal.api.table import TAGS

    tags = [part.split('"', 1)[0] for part in dom.split('data-tag="')[1:]]
    assert list(dict.fromkeys(tags)) == list(TAGS)  # each family once, in the table's order
    assert 'id="operations-native-post_v1_encode"' in dom and f'"{PRELOADED}"' in dom
    assert "{encode model}" not in dom and "Unable to render" not in dom


# --- the same server, over httpx ----------------------------------------------------------------


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(standin_app(("standin/dense-16", "standin/rerank"))) as base:
        yield base


@pytest.fixture(scope="module")
def document(url) -> dict:
    return httpx.get(f"{url}/openapi.json").json()


def test_the_docs_page_loads_only_files_this_server_serves_from_the_package(url):
    from swagger_ui_bundle import swagger_ui_path

    from shoal.api.plain import DOCS_ASSETS

    page = httpx.get(f"{url}/docs")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    refs = [part.split('"', 1)[0] for attr in ('src="', 'href="') for part in page.text.split(attr)[1:]]
    assert refs and not [ref for ref in refs if "//" in ref or ref.startswith("/")]  # relative, this host
    assets = sorted(ref for ref in refs if ref.startswith("docs/assets/"))
    assert [ref.split("?")[0].rsplit("/", 1)[1] for ref in assets] == sorted(DOCS_ASSETS)
    for ref in assets:
        name = ref.split("?")[0].rsplit("/", 1)[1]
        response = httpx.get(f"{url}/{ref}")
        assert response.status_code == 200
        assert response.headers["content-type"] == DOCS_ASSETS[name]
        assert response.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert response.headers["x-content-type-options"] == "nosniff"
        digest = hashlib.sha256(Path(swagger_ui_path, name).read_bytes()).hexdigest()
        assert hashlib.sha256(response.content).hexdigest() == digest


def test_an_asset_without_the_version_is_revalidated_by_its_etag(url):
    first = httpx.get(f"{url}/docs/assets/swagger-ui.css")
    assert first.status_code == 200 and first.headers["cache-control"] == "no-cache"
    again = httpx.get(f"{url}/docs/assets/swagger-ui.css", headers={"if-none-match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == first.headers["etag"]


@pytest.mark.parametrize(
    "path",
    [
        "/docs/assets/index.html",  # in the package, not on the list
        "/docs/assets/swagger-ui-bundle.js.map",
        "/docs/assets/..%2F..%2F..%2Fpyproject.toml",
        "/docs/assets/%2e%2e",
        "/docs/assets/swagger-ui.css%00",
    ],
)
def test_docs_assets_serves_only_its_allow_list(url, path):
    response = httpx.get(f"{url}{path}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_every_operation_is_tagged_with_a_family_the_document_lists(document):
    from shoal.api.table import TAGS

    assert [tag["name"] for tag in document["tags"]] == list(TAGS)
    used = [op["tags"] for ops in document["paths"].values() for op in ops.values()]
    assert all(len(tags) == 1 and tags[0] in TAGS for tags in used)
    assert {tags[0] for tags in used} == set(TAGS)
    assert document["paths"]["/v1/models/{model_path}"]["post"]["tags"] == ["admin"]
    assert document["paths"]["/v1/embeddings"]["post"]["tags"] == ["OpenAI"]


def test_every_field_of_a_described_type_has_a_description(document):
    import msgspec

    from shoal.api.openapi import FIELDS

    schemas = document["components"]["schemas"]
    for t in FIELDS:
        name = t.__name__ if t.__name__ in schemas else f"{t.__module__}.{t.__name__}"
        properties = schemas[name]["properties"]
        wire_names = {field.encode_name for field in msgspec.structs.fields(t)}
        assert set(properties) == wire_names
        undescribed = [field for field, schema in properties.items() if not schema.get("description")]
        assert not undescribed, f"{name}: {undescribed}"


def test_a_description_of_a_field_its_type_lacks_stops_the_document(monkeypatch):
    from shoal import wire
    from shoal.api import openapi

    monkeypatch.setitem(openapi.FIELDS, wire.EncodeOptions, {"normalise": "a misspelt field"})
    with pytest.raises(ValueError, match="EncodeOptions.normalise"):
        openapi.describe()


def test_every_body_route_has_an_example_its_schema_accepts(document):
    import jsonschema

    from shoal.api.table import ROUTES

    for route in ROUTES:
        if route.request is None:
            continue
        path = route.path.replace(":path}", "}")
        body = document["paths"][path][route.method.lower()]["requestBody"]["content"]["application/json"]
        assert ("example" in body) != ("examples" in body), route.name  # OpenAPI allows one of them
        examples = [body["example"]] if "example" in body else [e["value"] for e in body["examples"].values()]
        assert examples and all(isinstance(e, dict) for e in examples), route.name
        for example in examples:
            jsonschema.validate(example, {**body["schema"], "components": document["components"]})


@pytest.mark.parametrize(
    "path",
    [
        "/v1/encode",
        "/v1/score",
        "/v1/embeddings",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/embed",
        "/v2/embed",
        "/rerank",
        "/embed",
        "/tokenize",
        "/similarity",
    ],
)
def test_the_example_is_answered_by_the_server_whose_models_it_names(url, document, path):
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
    assert body.get("model") in (None, "standin/dense-16", "standin/rerank")
    response = httpx.post(f"{url}{path}", json=body)
    assert response.status_code == 200, response.text


def test_examples_name_the_default_model_then_a_loaded_one_then_any_then_a_built_in_card():
    from shoal.api.openapi import FALLBACK_MODELS, example_models
    from shoal.catalog import Catalog
    from shoal.service import ModelStatus

    def status(model_id: str, tasks: tuple[str, ...], loaded: bool = False, aliases=()) -> ModelStatus:
        return ModelStatus(model_id, tasks, (), 128, "unverified", loaded, aliases=aliases)

    statuses = [status("a/first", ("encode",)), status("a/loaded", ("encode", "score"), loaded=True)]
    assert example_models(statuses) == {
        "encode": "a/loaded",
        "score": "a/loaded",
        "extract": FALLBACK_MODELS["extract"],
        "generate": FALLBACK_MODELS["generate"],
    }
    with_alias = [*statuses, status("a/default", ("encode",), aliases=("text-embedding-3-small",))]
    assert example_models(with_alias, default="text-embedding-3-small")["encode"] == "a/default"
    assert example_models(with_alias, default="a/first")["encode"] == "a/first"
    assert example_models([status("b/x", ("score",))])["score"] == "b/x"
    catalog = Catalog.load()
    for verb, model_id in FALLBACK_MODELS.items():
        assert verb in catalog.get(model_id).tasks


def test_the_served_document_names_no_placeholder_and_the_built_one_only_placeholders(url, document):
    from shoal.api import openapi

    served = httpx.get(f"{url}/openapi.json").content
    assert not [p for p in openapi.PLACEHOLDERS.values() if p.encode() in served]
    assert document["paths"]["/v1/models/{model_path}"]["post"]["parameters"][0]["example"] == "standin/dense-16/load"
    built = str(openapi.describe())
    assert "standin/" not in built and all(p in built for p in openapi.PLACEHOLDERS.values())


def test_a_server_with_tokens_names_built_in_cards_not_its_models_in_the_examples():
    from shoal.api.openapi import FALLBACK_MODELS

    with running_server(standin_app(("standin/dense-16",), auth_tokens="a-long-random-secret")) as base:
        served = httpx.get(f"{base}/openapi.json").text
    assert "standin/" not in served
    assert all(f'"{model_id}"' in served for model_id in FALLBACK_MODELS.values())


def test_the_namespace_the_browser_runs_in_has_only_a_loopback():
    """Its one interface is `lo`, and every route it has goes through `lo`: no default route."""
    offline_browser()
    probe = subprocess.run(
        ["unshare", "--net", "--map-root-user", "sh", "-c", "ip link set lo up; ip -o link; ip route show table all"],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    lines = probe.stdout.splitlines()
    links = [line.split(":")[1].strip() for line in lines if ": <" in line]
    routes = [line for line in lines if ": <" not in line and not line.startswith(" ")]
    assert links == ["lo"]
    assert routes and all(" dev lo " in route and not route.startswith("default") for route in routes), routes
