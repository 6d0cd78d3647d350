"""Issue 12's GPU checks as one script, for the session that is lent a CUDA machine.

    python bench/gpu_check.py prepare            # here: writes .gpu/ (no weights; ~2 MB) and lists the wheels to carry
    python bench/gpu_check.py run --out DIR      # there: parity, the bf16 GEMM peak, shoal bench; figures in DIR
    python bench/gpu_check.py run --device cpu   # here: the same on the CPU (bfloat16 vs float32), to check the script

1. **Parity.** Every architecture shoal re-implements, on the random checkpoints its parity tests
   build (tests/test_*_parity.py; those tests prove the CPU float32 path equal to transformers),
   run on the device in float16 and bfloat16, token by token (cosine) on a packed batch of mixed
   lengths, against two references: the same checkpoint in float32 on the CPU (shoal's own, at
   0.999 fp16 / 0.99 bf16), and transformers' model of the checkpoint on the device in the same
   dtype over the right-padded batch (at 0.999 both). Attention runs through flash-attn's varlen
   kernel when `flash_attn` imports, else torch's SDPA over length groups; the line says which.
   Then the same model's forward replayed from a captured CUDA graph (engine/graphs.py: the batch
   padded into its token bucket, on a lane's own stream) against its eager forward, at cosine
   0.999; an architecture whose forward cannot be captured (a score bias reads the device back:
   MPNet, DeBERTa) says so and runs eagerly, as the server would.
2. **Peak.** The device's bf16 GEMM peak: the best of ten 8192^3 `torch.mm`.
3. **Bench.** `shoal serve --device cuda` on "shape twins" of MiniLM-L6 and of a BERT-base-sized
   model (all-mpnet-base-v2): each model's own config.json and tokenizer (carried in .gpu/, written by
   `prepare` from the installed weight packages) with random weights drawn there (tokens/s depend on
   the shapes, not the values; the real weights do not fit the 64 MiB a device call carries), in
   bfloat16. `shoal bench` ramps closed-loop clients on Lee passages and finds the knee (tokens/s
   and p99); the knee's tokens/s times FLOPs/token (shoal.bench.machine) over the bf16 peak is the
   share of the peak (MFU). Beside it, on the same device and texts, in process: sentence-
   transformers in bfloat16 (one `encode` per call, the call's texts as its batch) where it imports,
   else its recipe on transformers (AutoModel in bfloat16 over length-sorted padded batches, mean
   pooling, normalising) — the line says which. The MiniLM twin is also served with one lane
   (`--lanes 1`: no second stream overlapping host work) and with `--cuda-graphs`, each beside the
   default (two lanes, eager).

Everything lands in one JSON file, `<out>/gpu_check.json`; the defaults finish in about five minutes
on one GPU (parity under a minute, each twin's ramp 4 levels x 8 s plus the server's start and the
baseline's 15 s).

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
WHEELS = ("msgspec", "starlette", "uvicorn", "gensim", "sentence-transformers")
# Per-token cosine to the CPU's float32, the least allowed: half precision keeps ~3 digits, and a
# few layers of random weights amplify it a little.
MIN_COSINE = {"float16": 0.999, "bfloat16": 0.99}
# Against transformers on the device in the same dtype: both round alike, so closer.
MIN_COSINE_SAME_DTYPE = 0.999
# A replayed graph against the same model's eager forward: the same kernels on the same inputs.
MIN_COSINE_GRAPH = 0.999
# The twin served besides as it is by default (two lanes, eager): `shoal serve` arguments by name.
VARIANTS = {"minilm-l6": {"one-lane": ["--lanes", "1"], "cuda-graphs": ["--cuda-graphs"]}}


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
    pads = {"roberta": roberta.PAD, "xlm-roberta": roberta.PAD, "mpnet": mpnet.PAD}  # else 0, as the tests pad
    return [
        (*case, pads.get(case[0], 0))
        for case in _cases(bert, deberta, distilbert, llama, modernbert, mpnet, nomic, roberta, mixed)
    ]


def _cases(bert, deberta, distilbert, llama, modernbert, mpnet, nomic, roberta, mixed):
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


def _transformers_states(reference, seqs: list, pad_id: int, device: str):
    """transformers' model on the sequences right-padded with `pad_id`, with an attention mask, on
    `device`: the real tokens' states, packed `[T, hidden]` in float32."""
    import torch

    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad(seqs, batch_first=True, padding_value=pad_id).to(device)
    mask = pad([torch.ones_like(s) for s in seqs], batch_first=True).to(device)
    with torch.inference_mode():
        out = reference(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu()
    return torch.cat([out[i, : len(s)] for i, s in enumerate(seqs)])


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
    for name, save, vocab, lengths, first_id, pad_id in cases():
        with tempfile.TemporaryDirectory() as tmp:
            reference = save(tmp)  # transformers' model of the checkpoint (float32, CPU)
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
                    theirs = _transformers_states(
                        reference.to(device=device, dtype=getattr(torch, dtype)), batch.seqs, pad_id, device
                    )
                    same = float(torch.nn.functional.cosine_similarity(out, theirs, dim=-1).min())
                    row[f"{dtype}_vs_transformers"] = round(same, 6)
                    graph_ok = _graphed(model, batch, device, out, row, dtype)
                    ok = (
                        bool(torch.isfinite(out).all())
                        and row[dtype] >= MIN_COSINE[dtype]
                        and same >= MIN_COSINE_SAME_DTYPE
                        and graph_ok
                    )
                    failures += not ok
                    row[f"{dtype}_ok"] = ok
        rows.append(row)
        print(
            f"  {name:12s} {row['tokens']:4d} tokens  "
            + "  ".join(
                f"{d} cos>={row[d]:.5f} |d|<={row[d + '_max_abs']:.4f} "
                f"vs transformers {d} {row[d + '_vs_transformers']:.5f} graph {row[d + '_graph']} "
                f"{'ok' if row[d + '_ok'] else 'FAIL'}"
                for d in dtypes
            )
        )
    return rows, failures


def _graphed(model, batch, device: str, eager, row: dict, dtype: str) -> bool:
    """The model's forward replayed from its bucket's captured graph (engine/graphs.py; on a CPU a
    capture that re-runs the function, to check the script), against its eager states `eager`;
    row[dtype + "_graph"] says the cosine, or why the model runs eagerly. False: a replay differs."""
    import numpy as np
    import torch

    from shoal.engine.graphs import Graphs, cuda_capture
    from shoal.engine.streams import LaneStreams
    from shoal.engine.types import Batch, Encoded

    def rerun(fn, pool):
        states = fn()
        return states, lambda: states.copy_(fn())

    if not getattr(model, "graphable", True):  # the server never captures it (engine/graphs.py)
        row[f"{dtype}_graph"] = "eager (graphable = False: its forward reads the device back)"
        return True
    on_cuda = device.startswith("cuda")
    graphs = Graphs(
        model,
        max_length=max(len(s) for s in batch.seqs),
        max_tokens=1 << 16,
        capture=cuda_capture if on_cuda else rerun,
        new_pool=torch.cuda.graph_pool_handle if on_cuda else (lambda: None),
    )
    packed = Batch.pack([Encoded(ids=s.numpy().astype(np.int64)) for s in batch.seqs])
    lane = LaneStreams(torch.device(device)).current()
    with torch.inference_mode(), lane.running():
        graphs.forward(packed, lane)  # captured here
        states = graphs.forward(packed, lane)  # replayed
        states = None if states is None else states.float().cpu()
    if states is None:
        row[f"{dtype}_graph"] = f"eager ({graphs.broken or 'does not fit'})"[:120]
        return True  # the server runs such a model eagerly: nothing to compare
    cosine = float(torch.nn.functional.cosine_similarity(states, eager, dim=-1).min())
    row[f"{dtype}_graph"] = round(cosine, 6)
    return cosine >= MIN_COSINE_GRAPH


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


def bench(
    name: str, device: str, out: Path, levels: str, step_s: float, variant: tuple[str, list[str]] = ("", [])
) -> dict:
    from shoal.bench import targets

    randomize_twin(name)
    model = f"gpu-twin/{name}"
    suffix = f"-{variant[0]}" if variant[0] else ""
    json_path = out / f"bench-{name}{suffix}.json"
    with targets.shoal_serve(
        model,
        out / f"serve-{name}{suffix}.log",
        args=["--device", device, "--models-dir", str(GPU_DIR / "cards"), *variant[1]],
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


def baseline(name: str, device: str, duration_s: float) -> dict:
    """Sentence embedding in process on the device in bfloat16, on the bench's passages calls (one
    encode per call, its texts as the batch): sentence-transformers where it imports, else its
    recipe on transformers. Tokens are the library's own, truncated at the card's max_length."""
    import torch
    import transformers

    from shoal.bench import workloads

    twin = GPU_DIR / "twins" / name
    calls = workloads.build("passages", seed=0).calls
    limit = min(512, transformers.AutoConfig.from_pretrained(twin).max_position_embeddings - 2)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(twin), device=device, model_kwargs={"torch_dtype": torch.bfloat16})
        st.max_seq_length = limit
        what = "sentence-transformers, bfloat16"

        def encode(texts: list[str]) -> None:
            st.encode(texts, batch_size=len(texts), convert_to_tensor=True)

    except ImportError:
        tokenizer = transformers.AutoTokenizer.from_pretrained(twin)
        model = transformers.AutoModel.from_pretrained(twin, torch_dtype=torch.bfloat16).to(device).eval()
        what = "sentence-transformers' recipe on transformers, bfloat16 (sentence-transformers does not import here)"

        def encode(texts: list[str]) -> None:
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            batch = tokenizer(
                [texts[i] for i in order], padding=True, truncation=True, max_length=limit, return_tensors="pt"
            )
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.inference_mode():
                states = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
                pooled = (states * mask).sum(1) / mask.sum(1)
                torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    counter = transformers.AutoTokenizer.from_pretrained(twin)
    encode(list(calls[0].texts))  # warm-up
    sync()
    done = items = tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        texts = list(calls[done % len(calls)].texts)
        encode(texts)
        done += 1
        items += len(texts)
    sync()
    wall = time.perf_counter() - start
    for k in range(done):  # counted after the clock
        texts = list(calls[k % len(calls)].texts)
        tokens += sum(len(ids) for ids in counter(texts, truncation=True, max_length=limit)["input_ids"])
    return {"what": what, "calls": done, "items": items, "tokens_per_s": tokens / wall, "items_per_s": items / wall}


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
            base = baseline(twin, device, args.baseline_s)
            ratio = tokens / base["tokens_per_s"] if tokens and base["tokens_per_s"] else None
            record["bench"][twin] = {
                "knee": knee,
                "precision": result.get("precision"),
                "flops_per_token": per_token,
                "share_of_bf16_peak": share,
                "baseline": base,
                "shoal_over_baseline_tokens": ratio,
            }
            print(
                f"{twin}: knee {tokens or 0:,.0f} tokens/s, p99 {knee.get('p99_ms') or 0:.0f} ms"
                + (f", {100 * share:.1f} % of the bf16 peak ({per_token / 1e6:.1f} MFLOP/token)" if share else "")
                + f"; {base['what']}: {base['tokens_per_s']:,.0f} tokens/s"
                + (f" ({ratio:.2f}x)" if ratio else "")
            )
            for label, serve_args in VARIANTS.get(twin, {}).items() if not args.skip_variants else ():
                other = bench(twin, device, out, args.levels, args.step_s, (label, serve_args))
                other_knee = (other.get("targets", {}).get("shoal", {}) or {}).get("knee") or {}
                other_tokens = other_knee.get("tokens_per_s")
                record["bench"][twin][label] = {
                    "serve_args": serve_args,
                    "knee": other_knee,
                    "over_default_tokens": other_tokens / tokens if other_tokens and tokens else None,
                }
                print(
                    f"{twin} {label} ({' '.join(serve_args)}): knee {other_tokens or 0:,.0f} tokens/s, "
                    f"p99 {other_knee.get('p99_ms') or 0:.0f} ms"
                    + (f" ({other_tokens / tokens:.2f}x the default)" if other_tokens and tokens else "")
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
    run_parser.add_argument("--skip-variants", action="store_true", help="only the default serve of each twin")
    run_parser.add_argument("--baseline-s", type=float, default=15.0, help="seconds of the in-process baseline")
    args = parser.parse_args()
    return prepare() if args.command == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
