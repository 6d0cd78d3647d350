"""Image embedding throughput: shoal's engine in process against transformers' `CLIPModel` in
process, on the same JPEG files, outputs checked equal, measured in the same run.

The model is a random-initialised CLIP of ViT-B/32's shape (vision: 224 px, 32-px patches, 12
layers of 768; text: 12 layers of 512; 512-dim projection; no CLIP weights ship on PyPI), saved
once to a temporary folder that both sides read. The images are scikit-image's colour photos
(astronaut, coffee, chelsea, rocket, ...) saved as JPEG files, cycled (`shoal bench`'s images
workload draws its calls from the same files).

What is timed, per image: from the JPEG bytes to the embedding. shoal: `EncodeCall`s of
--images-per-request images from --clients concurrent callers through `Engine.run` (decode,
resize and patch rows in the tokenizer pool's threads while the device runs the previous batch).
transformers: `PIL.Image.open` + `CLIPImageProcessorPil` + `get_image_features` under
`torch.inference_mode`, at each of --batch-sizes, best reported (its best batching). The two sides
take turns (--rounds), each --duration-s a round, so a change in the machine's load falls on both.

Before timing, shoal's vectors for the first 8 images are compared with transformers' (cosine >=
0.9999, or the run exits 1 without a figure). Also printed: what decoding and preprocessing alone
cost per image on one thread (shoal's `ImageInputs.prepare`), and the share of the vision tower's
GEMM peak the forward reaches (its FLOPs over the measured time).

    python bench/image_throughput.py --duration-s 20 --rounds 3

`--save DIR` writes the model instead (DIR/clip-b32/, and its card DIR/clip-b32.yaml, id
bench/clip-b32), for the same figure over HTTP (docs/bench.md):

    python bench/image_throughput.py --save models
    shoal bench bench/clip-b32 --models-dir models --workload images --against transformers
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
import yaml
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from shoal.bench.machine import vision_flops_per_image
from shoal.bench.workloads import photos
from shoal.calls import EncodeCall, Item
from shoal.catalog import Catalog, parse_card
from shoal.config import EngineSettings

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "image_mean": MEAN,
    "image_std": STD,
}


# The card of the saved folder (its source is added where it is used).
CARD = {
    "id": "bench/clip-b32",
    "description": "A random-weight CLIP of ViT-B/32's shape (bench/image_throughput.py): for throughput only.",
    "architecture": "clip",
    "max_length": 77,
    "modalities": ["text", "image"],
    "image_tokens": 50,  # 7x7 patches of 32 pixels at 224, and the class token
    "pooling": "model",
    "normalize": True,
    "dimensions": 512,
    "outputs": ["dense"],
    "tasks": ["encode", "score"],
}


def save_model(directory: Path) -> transformers.CLIPModel:
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
        vision_config=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=32
        ),
        projection_dim=512,
    )
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).eval()
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<|startoftext|>": 49406, "<|endoftext|>": 49407}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 49406), ("<|endoftext|>", 49407)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def save(directory: Path) -> None:
    """The model in DIR/clip-b32/ and its card in DIR/clip-b32.yaml (source: that folder)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_model(directory / "clip-b32")
    card = {**CARD, "source": {"path": "clip-b32"}}  # relative to the card's file
    (directory / "clip-b32.yaml").write_text(yaml.safe_dump(card, sort_keys=False))


class Shoal:
    def __init__(self, directory: Path, clients: int, per_request: int) -> None:
        from shoal.engine import Engine
        from shoal.engine.runner import TorchBackend

        card = parse_card({**CARD, "source": {"path": str(directory)}}, "<bench>")
        self.card, self.clients, self.per_request = card, clients, per_request
        self.engine = Engine(EngineSettings(), Catalog([card]), backend=TorchBackend("cpu", allow_download=False))

    async def start(self) -> None:
        await self.engine.start()
        await self.engine.warm([self.card.id])

    async def vectors(self, files: list[bytes]) -> np.ndarray:
        result = await self.engine.run(EncodeCall(self.card.id, [Item(image=f) for f in files]))
        return np.stack(result.vectors)

    async def run_for(self, files: list[bytes], seconds: float) -> tuple[int, float]:
        done, deadline = 0, time.perf_counter() + seconds
        start = time.perf_counter()

        async def client(k: int) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                batch = [files[(k + i) % len(files)] for i in range(self.per_request)]
                await self.engine.run(EncodeCall(self.card.id, [Item(image=f) for f in batch]))
                done += len(batch)
                k += self.per_request

        await asyncio.gather(*(client(c * 7) for c in range(self.clients)))
        return done, time.perf_counter() - start


class Reference:
    def __init__(self, model: transformers.CLIPModel) -> None:
        self.model = model
        self.processor = transformers.CLIPImageProcessorPil(**PROCESSOR)

    @torch.inference_mode()
    def vectors(self, files: list[bytes]) -> np.ndarray:
        images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
        pixel_values = torch.from_numpy(np.asarray(self.processor(images, return_tensors="np")["pixel_values"]))
        out = self.model.get_image_features(pixel_values=pixel_values).pooler_output
        return torch.nn.functional.normalize(out, dim=-1).numpy()

    def run_for(self, files: list[bytes], seconds: float, batch_size: int) -> tuple[int, float]:
        done, k, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.vectors([files[(k + i) % len(files)] for i in range(batch_size)])
            done += batch_size
            k += batch_size
        return done, time.perf_counter() - start


def decode_cost(directory: Path, files: list[bytes]) -> float:
    """Seconds per image of shoal's decode + preprocessing on this thread."""
    from shoal.engine.image_inputs import load_image_inputs

    card = parse_card({**CARD, "source": {"path": str(directory)}}, "<bench>")
    inputs = load_image_inputs(card, directory, patch_size=32, num_patches=49, tokens_per_image=50)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 2.0:
        inputs.prepare(files, True, first_index=0, what="items")
        n += len(files)
    return (time.perf_counter() - start) / n


async def main(args: argparse.Namespace) -> int:
    if args.save:
        save(Path(args.save))
        print(f"wrote {args.save}/clip-b32/ and its card {args.save}/clip-b32.yaml (id {CARD['id']})")
        return 0
    files = photos()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        reference = Reference(save_model(directory))
        shoal = Shoal(directory, args.clients, args.images_per_request)
        await shoal.start()
        try:
            got, want = await shoal.vectors(files[:8]), reference.vectors(files[:8])
            cosine = float(np.min(np.sum(got * want, axis=1)))
            print(f"equality: min cosine over {len(got)} images {cosine:.6f}")
            if cosine < 0.9999:
                print("outputs differ: no figure", file=sys.stderr)
                return 1
            per_image = decode_cost(directory, files)
            print(f"decode + preprocess: {per_image * 1000:.1f} ms per image on one thread")
            flops = vision_flops_per_image(directory, CARD["image_tokens"])
            ours, theirs = [], {b: [] for b in args.batch_sizes}
            for round_ in range(args.rounds):
                n, s = await shoal.run_for(files, args.duration_s)
                ours.append(n / s)
                for b in args.batch_sizes:
                    n, s = reference.run_for(files, args.duration_s / len(args.batch_sizes), b)
                    theirs[b].append(n / s)
                best = max(args.batch_sizes, key=lambda b: theirs[b][-1])
                print(
                    f"round {round_ + 1}: shoal {ours[-1]:.1f} images/s; transformers "
                    + ", ".join(f"b{b} {theirs[b][-1]:.1f}" for b in args.batch_sizes)
                    + f" images/s; ratio {ours[-1] / theirs[best][-1]:.2f}x its best (b{best})"
                )
        finally:
            await shoal.engine.stop()
    shoal_rate = float(np.median(ours))
    best = max(args.batch_sizes, key=lambda b: np.median(theirs[b]))
    their_rate = float(np.median(theirs[best]))
    print(
        f"median: shoal {shoal_rate:.1f} images/s ({shoal_rate * flops / 1e9:.1f} GFLOP/s of vision tower), "
        f"transformers {their_rate:.1f} images/s at batch {best}; shoal / transformers {shoal_rate / their_rate:.2f}x"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--images-per-request", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--save", metavar="DIR", help="write the model folder and its card to DIR, then exit")
    sys.exit(asyncio.run(main(parser.parse_args())))
