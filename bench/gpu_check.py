"""Issue 12's GPU checks as one script, for the session that is lent a CUDA machine.

    python bench/gpu_check.py prepare            # here: writes .gpu/ (no weights; ~2 MB) and lists the wheels to carry
    python bench/gpu_check.py run --out DIR      # there: parity, the bf16 GEMM peak, shoal bench; figures in DIR
    python bench/gpu_check.py run --device cpu   # here: the same on the CPU (bfloat16 vs float32), to check the script

1. **Parity.** Every architecture shoal re-implements, on the random checkpoints its parity tests
   build (tests/test_*_parity.py; those tests prove the CPU float32 path equal to transformers),
   run on the device in float16 and bfloat16 and compared with the same checkpoint in float32 on
   the CPU, token by token (cosine) on a packed batch of mixed lengths. Attention runs through
   flash-attn's varlen kernel when `flash_attn` imports, else torch's SDPA over length groups; the
   line says which.
2. **Peak.** The device's bf16 GEMM peak: the best of ten 8192^3 `torch.mm`.
3. **Bench.** `shoal serve --device cuda` on "shape twins" of MiniLM-L6 and of a BERT-base-sized
   model (all-mpnet-base-v2): each model's own config.json and tokenizer (carried in .gpu/, written by
   `prepare` from the installed weight packages) with random weights drawn there (tokens/s depend on
   the shapes, not the values; the real weights do not fit the 64 MiB a device call carries), in
   bfloat16. `shoal bench` ramps closed-loop clients on Lee passages and finds the knee; the knee's
   tokens/s times FLOPs/token (shoal.bench.machine) over the bf16 peak is the share of the peak.

The device image has torch, transformers, safetensors, tokenizers, numpy, httpx and pyyaml; shoal
needs msgspec, starlette and uvicorn besides, and the Lee corpus is in gensim's wheel: `prepare`
prints the `pip download` line for them (README of the device tool: wheels go in .whl/, carried).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

GPU_DIR = ROOT / ".gpu"
TWINS = {  # name -> the card whose shapes and tokenizer the twin takes
    "minilm-l6": "sentence-transformers/all-MiniLM-L6-v2",
    "mpnet-base": "sentence-transformers/all-mpnet-base-v2",
}
TWIN_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
WHEELS = ("msgspec", "starlette", "uvicorn", "gensim")
# Per-token cosine to the CPU's float32, the least allowed: half precision keeps ~3 digits, and a
# few layers of random weights amplify it a little.
MIN_COSINE = {"float16": 0.999, "bfloat16": 0.99}


# --- the architectures, as their parity tests build them ---------------------------------------------


def cases():
    """(name, save(directory), vocab size, lengths, first id) per architecture family."""
    import test_bert_parity as bert
    import test_deberta_v2_parity as deberta
    import test_distilbert_parity as distilbert
    import test_llama_parity as llama
    import test_modernbert_parity as modernbert
    import test_mpnet_parity as mpnet
    import test_nomic_bert_parity as nomic
    import test_roberta_parity as roberta

    mixed = [1, 128, 7, 2, 63, 100, 30, 5]
    return [
        ("bert", lambda d: bert.save_random_bert(d, **bert.SHAPES["wide-3l-12h"]), bert.VOCAB, mixed, 1),
        (
            "roberta",
            lambda d: roberta.save_random_roberta(d, "roberta-3l-12h-gelu-tanh"),
            roberta.VOCAB,
            [1, roberta.MAX_LENGTH, 7, 2, 63, 30],
            roberta.PAD + 1,
        ),
        (
            "xlm-roberta",
            lambda d: roberta.save_random_roberta(d, "xlm-roberta-4l-8h-2types"),
            roberta.VOCAB,
            [1, roberta.MAX_LENGTH, 7, 2, 63, 30],
            roberta.PAD + 1,
        ),
        (
            "distilbert",
            lambda d: distilbert.save_random(d, **distilbert.SHAPES["mini-3l-8h-gelu-tanh"]),
            1000,
            [1, distilbert.MAX_LENGTH, 7, 2, 63, 30],
            1,
        ),
        (
            "mpnet",
            lambda d: mpnet.save_random_mpnet(d, **mpnet.SHAPES["mini-3l-12h"]),
            mpnet.VOCAB,
            [1, mpnet.MAX_LENGTH, 7, 2, 63, 30],
            mpnet.PAD + 1,
        ),
        (
            "deberta-v2",
            lambda d: deberta.save_random_deberta(d, **deberta.CONFIGS["v3-3l-6h-buckets16"]),
            deberta.VOCAB,
            deberta.LENGTHS,
            1,
        ),
        (
            "modernbert",
            lambda d: modernbert.save_random_modernbert(d, **modernbert.SHAPES["wide-3l-8h-gelu-tanh"]),
            modernbert.VOCAB,
            modernbert.LENGTHS,
            3,
        ),
        (
            "nomic-bert",
            lambda d: nomic.save_random_nomic_bert(d, **nomic.SHAPES["wide-3l-12h"]),
            nomic.VOCAB,
            nomic.LENGTHS,
            1,
        ),
    ] + [
        (
            name,
            lambda d, family=family, shape=shape: llama.save_random_decoder(d, family, **shape),
            llama.VOCAB,
            llama.LENGTHS,
            0,
        )
        for name, (family, shape) in llama.CASES.items()
        if name in ("llama-gqa-2l-4h-2kv", "qwen2-mha-3l-6h", "qwen3-gqa-2l-4h-2kv-hd32")
    ]


def parity(device: str, dtypes: list[str]) -> tuple[list[dict], int]:
    import torch

    from parity import packed_batch
    from shoal.layers import AttentionMeta, PackedInputs
    from shoal.layers.attention import flash_available
    from shoal.weights import build_model

    flash = any(flash_available(torch.device(device), getattr(torch, d)) for d in dtypes)
    path = "flash-attn varlen (where no score bias)" if flash else "torch SDPA (length groups)"
    print(
        f"parity on {device}: attention through {path}; per-token cosine to CPU float32, least allowed "
        + ", ".join(f"{d} {MIN_COSINE[d]}" for d in dtypes)
    )
    rows, failures = [], 0
    for name, save, vocab, lengths, first_id in cases():
        with tempfile.TemporaryDirectory() as tmp:
            save(tmp)
            batch = packed_batch(lengths, vocab, first_id=first_id)
            with torch.inference_mode():
                ref = build_model(Path(tmp), None, "cpu")(batch.inputs()).float()
                row = {"architecture": name, "tokens": int(batch.input_ids.numel())}
                for dtype in dtypes:
                    model = build_model(Path(tmp), None, device, dtype)
                    meta = AttentionMeta.build(batch.meta.cu_seqlens.to(device), batch.meta.max_seqlen)
                    inputs = PackedInputs(batch.input_ids.to(device), batch.position_ids.to(device), meta)
                    out = model(inputs).float().cpu()
                    cosine = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
                    row[dtype] = round(float(cosine.min()), 6)
                    row[f"{dtype}_max_abs"] = round(float((out - ref).abs().max()), 5)
                    ok = bool(torch.isfinite(out).all()) and row[dtype] >= MIN_COSINE[dtype]
                    failures += not ok
                    row[f"{dtype}_ok"] = ok
        rows.append(row)
        print(
            f"  {name:12s} {row['tokens']:4d} tokens  "
            + "  ".join(
                f"{d} cos>={row[d]:.5f} |d|<={row[d + '_max_abs']:.4f} {'ok' if row[d + '_ok'] else 'FAIL'}"
                for d in dtypes
            )
        )
    return rows, failures


def bf16_peak(device: str, size: int) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


# --- the shape twins ----------------------------------------------------------------------------------


def prepare() -> int:
    """Write .gpu/twins/<name>/ (config and tokenizer of each model, from its installed weights) and
    .gpu/cards/<name>.yaml; print what else to carry."""
    import msgspec
    import yaml

    from shoal.catalog import Catalog, resolve_weights

    catalog = Catalog.load()
    (GPU_DIR / "cards").mkdir(parents=True, exist_ok=True)
    for name, model_id in TWINS.items():
        card = catalog.get(model_id)
        source = resolve_weights(card, allow_download=False)
        twin = GPU_DIR / "twins" / name
        twin.mkdir(parents=True, exist_ok=True)
        for file in TWIN_FILES:
            if (source / file).exists():
                shutil.copy(source / file, twin / file)
        fields = msgspec.to_builtins(card)
        fields.update(
            id=f"gpu-twin/{name}",
            source={"path": f"../twins/{name}"},
            dtype="bfloat16",
            verified="random_weights",
            description=f"{model_id}'s shapes and tokenizer, random weights",
        )
        (GPU_DIR / "cards" / f"{name}.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
        print(f"wrote {twin} and .gpu/cards/{name}.yaml")
    print(
        "\nthen, for the device call (bench/gpu_check.py's docstring):\n"
        "  echo /.gpu/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude\n"
        "  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
        "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "
        f"-d .whl {' '.join(WHEELS)}\n"
        "  run(carry=['.gpu', '.whl'], command='python3 -m pip install -q --no-index --no-deps --target /tmp/site "
        ".whl/*.whl && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 bench/gpu_check.py run --out $OUT')"
    )
    return 0


def randomize_twin(name: str) -> None:
    """Random weights of the twin's shapes, once (transformers builds the model from its config)."""
    import transformers

    twin = GPU_DIR / "twins" / name
    if not any(twin.glob("*.safetensors")):
        config = transformers.AutoConfig.from_pretrained(twin)
        transformers.AutoModel.from_config(config).save_pretrained(twin)


def bench(name: str, device: str, out: Path, levels: str, step_s: float) -> dict:
    from shoal.bench import targets

    randomize_twin(name)
    model = f"gpu-twin/{name}"
    json_path = out / f"bench-{name}.json"
    with targets.shoal_serve(
        model, out / f"serve-{name}.log", args=["--device", device, "--models-dir", str(GPU_DIR / "cards")]
    ) as (url, _):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "bench",
                model,
                "--models-dir",
                str(GPU_DIR / "cards"),
                "--url",
                url,
                "--workload",
                "passages",
                "--mode",
                "closed",
                "--levels",
                levels,
                "--step-s",
                str(step_s),
                "--json-out",
                str(json_path),
            ],
            check=False,
        )
    return json.loads(json_path.read_text()) if json_path.exists() else {}


def run(args) -> int:
    import torch

    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu to check the script")
        return 2
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__} on {name}")
    dtypes = ["float16", "bfloat16"] if device.startswith("cuda") else ["bfloat16"]
    rows, failures = parity(device, dtypes)
    peak = bf16_peak(device, 8192 if device.startswith("cuda") else 1024)
    print(f"bf16 GEMM peak: {peak / 1e12:.3g} TFLOP/s")
    record = {"device": name, "torch": torch.__version__, "parity": rows, "bf16_peak_flops": peak, "bench": {}}
    if not args.skip_bench:
        for twin in TWINS:
            result = bench(twin, device, out, args.levels, args.step_s)
            knee = (result.get("targets", {}).get("shoal", {}) or {}).get("knee") or {}
            per_token = (result.get("flops") or {}).get("flops_per_token")
            tokens = knee.get("tokens_per_s")
            share = tokens * per_token / peak if tokens and per_token else None
            record["bench"][twin] = {"knee": knee, "flops_per_token": per_token, "share_of_bf16_peak": share}
            print(
                f"{twin}: knee {tokens or 0:,.0f} tokens/s"
                + (f", {100 * share:.1f} % of the bf16 peak ({per_token / 1e6:.1f} MFLOP/token)" if share else "")
            )
    (out / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / 'gpu_check.json'}; parity failures: {failures}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="write .gpu/ here (configs, tokenizers, cards)")
    run_parser = sub.add_parser("run", help="parity, peak and bench on --device")
    run_parser.add_argument("--device", default="cuda")
    run_parser.add_argument("--out", help="where the JSON and logs go (default: a temporary directory)")
    run_parser.add_argument("--levels", default="1,4,16,64", help="closed-loop clients of the bench")
    run_parser.add_argument("--step-s", type=float, default=8.0)
    run_parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    return prepare() if args.command == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
