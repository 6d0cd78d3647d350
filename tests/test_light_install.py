"""A torch-free install serves the API: `create_app` over an in-memory stand-in service answers the
encode routes while torch, tokenizers and the engine stay out of `sys.modules`.

Each test runs this file as a script in a fresh interpreter (`python tests/test_light_install.py
serve --block`): the child installs an import blocker before it imports shoal, serves the app over
`standin.StandIn` with real uvicorn on a loopback port, calls the routes as clients do, and prints
one JSON summary as its last line of stdout, which the test asserts on. The tests marked `light`
also run where only `pip install shoal` is installed (CI builds `.venv-light` and runs
`pytest -m light tests/test_light_install.py` there). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

# What a torch-free install lacks; a blocked name blocks its submodules too.
BLOCKED = ("torch", "tokenizers", "safetensors", "transformers", "huggingface_hub", "shoal.engine")
MODEL = "standin/dense-16"  # normalises by default
RAW_MODEL = "standin/dense-8-raw"  # does not
TEXTS = ["the cat sat on the mat", "a feline rested", "ünïcödé text, and a fish: 🐟"]
CHILD_TIMEOUT_S = 120.0


# --- the child process ---------------------------------------------------------------------------


class Blocker(importlib.abc.MetaPathFinder):
    """Makes importing any of `names` (or a submodule) fail, as if it were not installed."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if _is_blocked(fullname, self.names):
            raise ModuleNotFoundError(f"{fullname} is blocked: a torch-free install has no {fullname}", name=fullname)
        return None


def _is_blocked(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def blocked_loaded() -> list[str]:
    return sorted(m for m in sys.modules if _is_blocked(m, BLOCKED))


def child_serve() -> dict[str, Any]:
    """Serve the app over a StandIn, call every encode route and the status routes once each."""
    import socket
    import threading

    from shoal.api import create_app
    from shoal.api.server import build_server
    from shoal.config import ServerSettings, Settings
    from standin import StandIn

    service = StandIn()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound here, so no one takes the port before uvicorn serves it
    port = sock.getsockname()[1]
    settings = Settings(server=ServerSettings(host="127.0.0.1", port=port), allow_download=False)
    app = create_app(settings, service, preload=(MODEL,))
    server = build_server(app, settings.server, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        summary = _call_routes(f"http://127.0.0.1:{port}", thread)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    summary["stopped"] = service.stopped
    summary["warmed"] = service.warmed
    return summary


def _call_routes(url: str, thread: Any) -> dict[str, Any]:
    import time

    import httpx
    import msgspec
    import numpy as np
    from prometheus_client.parser import text_string_to_metric_families

    summary: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=30.0) as http:
        deadline = time.monotonic() + 60.0
        while True:
            if not thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/readyz did not answer 200 within 60 s")
            time.sleep(0.05)
        summary["readyz"] = http.get("/readyz").status_code
        summary["healthz"] = http.get("/healthz").status_code

        items = [{"id": "a", "text": TEXTS[0]}, {"id": 7, "text": TEXTS[1]}, {"text": TEXTS[2]}]
        r = http.post("/v1/encode", json={"model": MODEL, "items": items, "options": {"dimensions": 8}})
        body = r.json()
        summary["encode_json"] = {
            "status": r.status_code,
            "ids": [item["id"] for item in body["items"]],
            "dense": [item["dense"] for item in body["items"]],
            "tokens": body["usage"]["tokens"],
        }

        request = {"model": RAW_MODEL, "items": [{"text": t} for t in TEXTS], "options": {"output_dtype": "float16"}}
        r = http.post(
            "/v1/encode",
            content=msgspec.msgpack.encode(request),
            headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
        )
        dense = [item["dense"] for item in msgspec.msgpack.decode(r.content)["items"]]
        summary["encode_msgpack"] = {
            "status": r.status_code,
            "content_type": r.headers["content-type"],
            "dtypes": [d["dtype"] for d in dense],
            "shapes": [d["shape"] for d in dense],
            "dense": [np.frombuffer(d["data"], np.dtype(d["dtype"]).newbyteorder("<")).tolist() for d in dense],
        }

        try:
            import openai
        except ImportError:
            r = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2], "dimensions": 4})
            summary["embeddings"] = {"client": "httpx", "vectors": [d["embedding"] for d in r.json()["data"]]}
        else:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30.0)
            emb = client.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=4)  # base64 on the wire
            summary["embeddings"] = {"client": "openai", "vectors": [list(d.embedding) for d in emb.data]}

        r = http.post("/v1/encode", json={"model": "no/such-model", "items": [{"text": "x"}]})
        summary["unknown_model"] = {"status": r.status_code, "code": r.json()["error"]["code"]}

        r = http.get("/v1/models")
        summary["models"] = [[m["id"], m["dimensions"], m["loaded"]] for m in r.json()["data"]]

        r = http.get("/metrics")
        samples = [s for family in text_string_to_metric_families(r.text) for s in family.samples]
        summary["metrics"] = {
            "requests": {
                f"{s.labels['route']} {s.labels['model']} {s.labels['status']}": s.value
                for s in samples
                if s.name == "shoal_requests_total"
            },
            "tokens": {s.labels["model"]: s.value for s in samples if s.name == "shoal_tokens_total"},
        }
    return summary


def child_import(modules: list[str]) -> dict[str, Any]:
    """Import each module; the errors by module, as `ExceptionType: message`."""
    import importlib

    errors = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            errors[module] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors}


def child_main(argv: list[str]) -> None:
    """`serve [--block]` or `import MODULE... [--block]`; prints the JSON summary last."""
    block = "--block" in argv
    args = [a for a in argv if a != "--block"]
    if block:
        sys.meta_path.insert(0, Blocker(BLOCKED))  # before anything of shoal is imported
    summary = child_serve() if args[0] == "serve" else child_import(args[1:])
    summary["blocked_loaded"] = blocked_loaded()
    print(json.dumps(summary))


# --- the tests -----------------------------------------------------------------------------------


def run_child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.light
def test_the_standin_is_a_service_whose_vectors_differ_by_text_model_and_options():
    # The serve test compares answers with these vectors: equal ones would prove nothing.
    from shoal.service import Service
    from standin import StandIn

    assert isinstance(StandIn(), Service)
    a, b = StandIn.vector(MODEL, TEXTS[0]), StandIn.vector(MODEL, TEXTS[1])
    assert a.shape == (16,) and a.dtype.name == "float32" and abs(float((a * a).sum()) - 1.0) < 1e-5
    assert not (a == b).all()
    assert not (StandIn.vector(RAW_MODEL, TEXTS[0]) == a[:8]).all()
    raw = StandIn.vector(RAW_MODEL, TEXTS[0])
    assert abs(float((raw * raw).sum()) - 1.0) > 1e-3  # not normalised by default
    assert StandIn.vector(MODEL, TEXTS[0], dimensions=8).tolist() != a[:8].tolist()  # truncate, then normalise
    assert StandIn.vector(MODEL, TEXTS[0], output_dtype="int8").dtype.name == "int8"


@pytest.mark.light
@pytest.mark.parametrize("block", [True, False], ids=["blocked", "not-blocked"])
def test_the_api_serves_a_standin_without_torch_tokenizers_or_the_engine(block):
    """blocked: they cannot be imported (as in a torch-free install). not-blocked: where they are
    installed (the main venv), the app still imports none of them."""
    from standin import MODELS, StandIn, count_tokens

    summary = run_child("serve", *(["--block"] if block else []))

    assert summary["readyz"] == 200 and summary["healthz"] == 200
    encode = summary["encode_json"]
    assert encode["status"] == 200
    assert encode["ids"] == ["a", 7, None]
    assert encode["dense"] == [StandIn.vector(MODEL, t, dimensions=8).tolist() for t in TEXTS]
    assert encode["tokens"] == sum(count_tokens(t) for t in TEXTS)

    packed = summary["encode_msgpack"]
    assert packed["status"] == 200 and packed["content_type"].startswith("application/msgpack")
    assert packed["dtypes"] == ["float16"] * 3 and packed["shapes"] == [[8]] * 3
    assert packed["dense"] == [StandIn.vector(RAW_MODEL, t, output_dtype="float16").tolist() for t in TEXTS]

    embeddings = summary["embeddings"]
    assert embeddings["client"] == ("openai" if importlib.util.find_spec("openai") else "httpx")
    assert embeddings["vectors"] == [StandIn.vector(MODEL, t, dimensions=4).tolist() for t in TEXTS[:2]]

    assert summary["unknown_model"] == {"status": 404, "code": "unknown_model"}
    assert summary["models"] == [[m.id, m.dimensions, m.id == MODEL] for m in MODELS]  # MODEL was preloaded
    assert summary["warmed"] == [MODEL] and summary["stopped"] is True

    assert summary["metrics"]["requests"] == {
        f"encode {MODEL} 200": 1.0,
        f"encode {RAW_MODEL} 200": 1.0,
        f"embeddings {MODEL} 200": 1.0,
        "encode - 404": 1.0,  # an unknown model is labelled "-"
        "models - 200": 1.0,
    }
    assert summary["metrics"]["tokens"] == {
        MODEL: float(sum(count_tokens(t) for t in TEXTS + TEXTS[:2])),
        RAW_MODEL: float(sum(count_tokens(t) for t in TEXTS)),
    }

    assert summary["blocked_loaded"] == []


@pytest.mark.light
def test_the_blocker_makes_the_engine_stack_unimportable():
    # Proves the blocked run above is real: under the blocker these imports fail.
    summary = run_child("import", "shoal.engine", "torch", "tokenizers", "shoal.layers", "--block")
    errors = summary["errors"]
    assert errors["shoal.engine"].startswith("ModuleNotFoundError: shoal.engine is blocked")
    assert errors["torch"].startswith("ModuleNotFoundError: torch is blocked")
    assert errors["tokenizers"].startswith("ModuleNotFoundError: tokenizers is blocked")
    assert errors["shoal.layers"].startswith("ModuleNotFoundError: torch is blocked")  # it needs torch
    assert summary["blocked_loaded"] == []


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the engine extra (torch)")
def test_the_summary_would_name_the_engine_stack_if_a_module_imported_it():
    # Proves the not-blocked run's `blocked_loaded == []` can fail: importing the runner shows up.
    summary = run_child("import", "shoal.engine.runner")
    assert summary["errors"] == {}
    assert {"torch", "tokenizers", "shoal.engine", "shoal.engine.runner"} <= set(summary["blocked_loaded"])


if __name__ == "__main__":
    child_main(sys.argv[1:])
