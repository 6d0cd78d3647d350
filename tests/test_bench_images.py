"""`shoal bench --workload images`: calls of scikit-image's JPEG photos sent as native /v1/encode
image items (base64 in JSON, raw bytes in msgpack) to a tiny random-weight CLIP served from a folder,
images/s and the share of the vision tower's fp32 bound, and `--against transformers`: CLIPModel in
this process on the same photos, its ratio printed only when its vectors equal shoal's."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from shoal.bench import machine, workloads
from shoal.bench.load import _body

pytestmark = pytest.mark.timeout(120)

CLIP_ID = "test/clip-bench"
SHOAL = [str(Path(sys.executable).with_name("shoal"))]


def _tiny_clip(directory: Path, cards: Path, *, moved: bool = False) -> None:
    """A tiny random CLIP (tests/vision_models.py's shapes and weights) in `directory`, and its card
    (id CLIP_ID) in `cards`; `moved`: one bias of the vision tower shifted, a different model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from vision_models import EOS, IMAGE, PAD, PATCH, TEXT_SHAPE, VISION_SHAPE, VOCAB, save_random

    bos = VOCAB - 2
    config = transformers.CLIPConfig(
        text_config=dict(TEXT_SHAPE, eos_token_id=EOS, bos_token_id=bos, pad_token_id=PAD),
        vision_config=VISION_SHAPE,
        projection_dim=24,
    )
    model = save_random(transformers.CLIPModel, config, directory)
    if moved:
        with torch.no_grad():
            model.vision_model.post_layernorm.bias.add_(0.05)
        model.save_pretrained(directory)
    processor = {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": IMAGE},
        "crop_size": {"height": IMAGE, "width": IMAGE},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    vocab = {"<unk>": 0, "<pad>": PAD, "<|endoftext|>": EOS, "<|startoftext|>": bos, "cat": 10}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", EOS)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    card = {
        "id": CLIP_ID,
        "architecture": "clip",
        "source": {"path": str(directory)},
        "max_length": TEXT_SHAPE["max_position_embeddings"],
        "modalities": ["text", "image"],
        "image_tokens": (IMAGE // PATCH) ** 2 + 1,
        "pooling": "model",
        "dimensions": 24,
        "outputs": ["dense"],
        "tasks": ["encode", "score"],
    }
    (cards / "clip-bench.yaml").write_text(json.dumps(card))  # JSON is YAML


@pytest.fixture(scope="module")
def clip_cards(tmp_path_factory) -> tuple[Path, Path]:
    """(cards folder of the tiny CLIP, cards folder of the same id over a moved copy)."""
    pytest.importorskip("transformers")
    folders = []
    for moved in (False, True):
        directory, cards = tmp_path_factory.mktemp("clip-bench"), tmp_path_factory.mktemp("clip-bench-cards")
        _tiny_clip(directory, cards, moved=moved)
        folders.append(cards)
    return folders[0], folders[1]


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        SHOAL + ["bench", CLIP_ID, *argv],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_the_images_workload_draws_jpeg_photos_per_call_and_sends_base64_in_json_and_raw_bytes_in_msgpack():
    files = workloads.photos()
    assert len(files) == len(workloads.PHOTOS) and all(f[:3] == b"\xff\xd8\xff" for f in files)  # JPEG files
    work = workloads.build("images", items=5, num_calls=64)
    assert work.verb == "encode" and work.modality == "image" and work.items_per_call == 5
    assert all(not c.texts and len(c.images) == 5 and set(c.images) <= set(files) for c in work.calls)
    assert work.calls == workloads.build("images", items=5, num_calls=64).calls
    assert work.calls != workloads.build("images", items=5, num_calls=64, seed=1).calls
    call = work.calls[0]
    as_json = json.loads(msgspec.json.encode(_body("native", "m", "encode", call)))
    assert [base64.b64decode(item["image"]) for item in as_json["items"]] == list(call.images)
    as_msgpack = msgspec.msgpack.decode(msgspec.msgpack.encode(_body("native", "m", "encode", call, raw_bytes=True)))
    assert [item["image"] for item in as_msgpack["items"]] == list(call.images)


def test_flops_per_image_are_what_torch_counts_in_transformers_vision_tower_and_projection(clip_cards):
    """The vision tower's matmuls, the patch convolution and the projection, as torch's FLOP counter
    counts them in transformers' own forward of one image."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from vision_models import CHANNELS, IMAGE, PATCH

    folder = Path(json.loads((clip_cards[0] / "clip-bench.yaml").read_text())["source"]["path"])
    model = transformers.CLIPModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.get_image_features(pixel_values=torch.randn(1, CHANNELS, IMAGE, IMAGE))
    tokens = (IMAGE // PATCH) ** 2 + 1
    assert machine.vision_flops_per_image(folder, tokens) == counter.get_total_flops()


def test_shoal_bench_images_prints_images_per_s_the_vision_bound_and_the_ratio_to_transformers(clip_cards, tmp_path):
    """The documented path: a spawned `shoal serve --models-dir` of a folder's card, JSON bodies."""
    out = tmp_path / "bench.json"
    proc = _bench(
        "--models-dir", str(clip_cards[0]), "--workload", "images", "--items", "4", "--mode", "closed",
        "--levels", "2", "--step-s", "1", "--against", "transformers", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "images/s" in proc.stdout and "shoal knee / transformers:" in proc.stdout
    record = json.loads(out.read_text())
    steps = record["targets"]["shoal"]["steps"]
    assert [s["offered"] for s in steps] == [2] and steps[0]["ok"] > 0 and steps[0]["errors"] == 0
    knee = record["targets"]["shoal"]["knee"]
    assert knee["items_per_s"] == pytest.approx(4 * knee["achieved_rps"], rel=0.02)  # 4 images a call
    assert knee["tokens_per_s"] == pytest.approx(17 * knee["items_per_s"], rel=0.02)  # the card's image_tokens
    assert record["equality"]["min_cosine"] >= 0.9999 and record["equality"]["images"] == 4
    baseline = record["baseline"]
    assert baseline["batch_size"] in (8, 16, 32) and set(baseline["items_per_s_by_batch_size"]) == {"8", "16", "32"}
    assert baseline["items_per_s"] == pytest.approx(max(baseline["items_per_s_by_batch_size"].values()), rel=0.01)
    ratio = record["ratios"]["shoal_over_transformers_images"]
    assert ratio == pytest.approx(knee["items_per_s"] / baseline["items_per_s"], rel=0.02)
    flops = record["flops"]
    assert flops["tokens_per_image"] == 17 and flops["flops_per_image"] > 0
    assert flops["bound_images_per_s"] == pytest.approx(flops["fp32_gemm_peak_flops"] / flops["flops_per_image"], 0.01)
    share = record["ratios"]["shoal_share_of_bound"]
    assert share == pytest.approx(knee["items_per_s"] / flops["bound_images_per_s"], rel=0.02, abs=1e-4)
    assert "% of the fp32-peak bound" in proc.stdout


def test_the_transformers_baseline_refuses_a_ratio_when_its_outputs_differ_from_shoals(serve, clip_cards, tmp_path):
    """shoal serves the tiny CLIP; the bench's card of the same id points at a moved copy, so
    transformers loads a different model: no figure, no ratio, exit 1. The load itself (msgpack, raw
    bytes) was served."""
    url = serve(preload=(CLIP_ID,), cards_dirs=(clip_cards[0],))
    out = tmp_path / "bench.json"
    proc = _bench(
        "--url", url, "--models-dir", str(clip_cards[1]), "--workload", "images", "--items", "2", "--msgpack",
        "--mode", "closed", "--levels", "1", "--step-s", "1", "--against", "transformers", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "outputs differ" in proc.stdout and "shoal knee / transformers" not in proc.stdout
    record = json.loads(out.read_text())
    assert record["equality"]["min_cosine"] < 0.9999 and record["baseline"] is None
    assert "shoal_over_transformers_images" not in record["ratios"]
    step = record["targets"]["shoal"]["steps"][0]
    assert step["ok"] > 0 and step["errors"] == 0


@pytest.mark.parametrize(
    "model, argv, message",
    [
        ("sentence-transformers/all-MiniLM-L6-v2", ["--workload", "images"], "reads text; workload images sends image"),
        (CLIP_ID, ["--workload", "images", "--against", "st"], "is compared with transformers"),
        (CLIP_ID, ["--workload", "queries", "--against", "transformers"], "compared with shoal-float32 and/or st"),
    ],
)
def test_shoal_bench_refuses_images_for_a_text_model_and_baselines_of_the_other_modality(
    clip_cards, model, argv, message
):
    proc = subprocess.run(
        SHOAL + ["bench", model, "--url", "http://127.0.0.1:9", "--models-dir", str(clip_cards[0]), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
