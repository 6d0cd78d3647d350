"""`shoal bench` and `shoal tune`: knees, workloads from packaged text, real load against a real
server, tuned overlays that the catalog, the engine and `shoal serve` use."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import yaml

from shoal.bench import machine, workloads
from shoal.bench.knee import Bounds, knee
from shoal.bench.load import HttpTarget, Step, closed_loop, open_loop
from shoal.bench.run import Plan, call_tokens, measure_and_close
from shoal.bench.tune import overlay_name
from shoal.catalog import Catalog, load_tuned
from shoal.catalog.card import Batching
from shoal.errors import CardError
from shoal.engine.hardware import cpu_class

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
SHOAL = [str(Path(sys.executable).with_name("shoal"))]


def _step(mode: str, offered: float, achieved_rps: float, p99_ms: float, errors: int = 0) -> Step:
    """A level that answered `achieved_rps` x 10 s requests; an open one had `offered` x 10 s arrive
    (those not answered timed out in the drain) and `errors` more."""
    duration = 10.0
    ok = int(achieved_rps * duration)
    sent = int(offered * duration) + errors if mode == "open" else ok + errors
    # 98 % of latencies at 1 ms, the slowest 2 % at p99_ms: the step's p99 is p99_ms.
    slow = max(1, ok // 50)
    return Step(mode, offered, duration, window_s=duration if mode == "open" else 0.0, sent=sent, ok=ok,
                errors=sent - ok, latencies_ms=[1.0] * (ok - slow) + [p99_ms] * slow)


def test_the_open_loop_knee_is_the_highest_rate_served_within_the_bounds():
    steps = [_step("open", 10, 10, 50), _step("open", 20, 20, 80), _step("open", 40, 40, 140),
             _step("open", 60, 45, 900),  # the rate is no longer followed (and p99 is past the bound)
             _step("open", 80, 46, 3000)]
    assert knee(steps, Bounds(p99_ms=150)).offered == 40
    assert knee(steps, Bounds(p99_ms=100)).offered == 20  # a tighter bound moves the knee down
    # Arrivals left unanswered (a backlog the drain gave up on) end the knee even with p99 in bounds.
    flat = [_step("open", 10, 10, 50), _step("open", 20, 15, 60)]
    assert knee(flat, Bounds(p99_ms=1000)).offered == 10
    # A load generator that could not send at the rate offered does not count as following it.
    behind = _step("open", 20, 10, 50)
    behind.sent, behind.errors = 100, 0
    assert knee([_step("open", 10, 10, 50), behind], Bounds(p99_ms=1000)).offered == 10
    # Errors past the share: not a knee.
    assert knee([_step("open", 10, 10, 50, errors=5)], Bounds(p99_ms=1000)) is None


def test_the_closed_loop_knee_is_the_fewest_clients_that_reach_the_plateau():
    steps = [_step("closed", 1, 50, 30), _step("closed", 4, 150, 40), _step("closed", 16, 190, 100),
             _step("closed", 32, 195, 200), _step("closed", 64, 196, 450)]
    assert knee(steps, Bounds(p99_ms=1000)).offered == 16  # 190 >= 0.95 x 196
    assert knee(steps, Bounds(p99_ms=150)).offered == 16
    assert knee(steps, Bounds(p99_ms=50)).offered == 4  # the best within 50 ms


def test_workloads_are_built_from_the_packaged_lee_corpus_and_wnut_tweets_and_repeat_for_a_seed():
    docs = workloads.lee_documents()
    assert len(docs) == 300
    passages = workloads.build("passages", num_calls=20)
    assert passages.verb == "encode" and all(len(c.texts) == 32 for c in passages.calls)
    assert all(text in docs for c in passages.calls for text in c.texts)
    assert passages.calls == workloads.build("passages", num_calls=20).calls
    assert passages.calls != workloads.build("passages", num_calls=20, seed=1).calls
    queries = workloads.build("queries", num_calls=50)
    assert all(len(c.texts) == 1 and 6 <= len(c.texts[0].split()) <= 60 for c in queries.calls)
    rerank = workloads.build("rerank", num_calls=5)
    assert rerank.verb == "score" and all(c.query and len(c.texts) == 20 for c in rerank.calls)
    extract = workloads.build("extract", num_calls=5)
    tweets = set(workloads.wnut_tweets())
    assert extract.verb == "extract" and all(t in tweets for c in extract.calls for t in c.texts)
    assert extract.calls[0].labels == workloads.WNUT_LABELS
    with pytest.raises(Exception, match="unknown workload"):
        workloads.build("nope")


def test_flops_per_token_follow_the_architecture_of_minilm(card, model_dir):
    shape = machine.shape_of(model_dir, card.architecture)
    assert (shape.hidden, shape.layers, shape.intermediate, shape.heads) == (384, 6, 1536, 12)
    # Per layer: q, k, v, o (4 x 384^2) and the MLP (2 x 384 x 1536) multiply-adds, x2 FLOPs, plus
    # QK^T and AV over a 100-token sequence (4 x 100 x 384).
    per_layer = 2 * (4 * 384 * 384 + 2 * 384 * 1536) + 4 * 100 * 384
    assert shape.flops_per_token(100) == 6 * per_layer
    assert machine.effective_seq_len([10, 30]) == (100 + 900) / 40


def test_load_against_a_real_server_counts_the_tokens_its_tokenizer_counts(base_url, card, model_dir):
    work = workloads.build("queries", num_calls=64, items=2)
    per_call, _ = call_tokens(model_dir, card.max_length, work)

    async def run() -> tuple[Step, Step]:
        target = HttpTarget("shoal", base_url, MODEL_ID, work)
        try:
            closed = await closed_loop(target, 2, 1.0)
            opened = await open_loop(target, 20.0, 1.5, seed=3, first=closed.sent)
        finally:
            await target.aclose()
        return closed, opened

    closed, opened = asyncio.run(run())
    assert closed.ok == closed.sent > 0 and closed.errors == 0
    # usage.tokens of the server equals the model's own tokenizer on exactly the calls sent.
    assert closed.tokens == sum(per_call[k % len(per_call)] for k in range(closed.sent))
    assert closed.items == 2 * closed.ok
    assert opened.errors == 0 and opened.ok == opened.sent
    assert 10 <= opened.sent <= 55  # Poisson at 20/s for 1.5 s (mean 30)
    assert opened.percentile_ms(99) >= opened.percentile_ms(50) > 0


def test_a_ramp_against_a_real_server_finds_a_knee_and_an_unserved_model_errs(base_url):
    plan = Plan(mode="closed", levels=(1, 2), step_s=1.0, warmup_s=0.5, bounds=Bounds(p99_ms=5000))
    work = workloads.build("queries", num_calls=32)
    steps, found, _ = asyncio.run(measure_and_close(HttpTarget("shoal", base_url, MODEL_ID, work), plan, log=lambda s: None))
    assert [s.offered for s in steps] == [1, 2] and found is not None and found.ok > 0
    bad = HttpTarget("shoal", base_url, "no/such-model", work)
    steps, found, _ = asyncio.run(measure_and_close(bad, plan, log=lambda s: None))
    assert found is None and all(s.ok == 0 and s.statuses.get(404) == s.sent for s in steps)


def test_shoal_bench_prints_the_knee_and_writes_json_and_a_png(base_url, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(SHOAL + ["bench", MODEL_ID, "--url", base_url, "--workload", "queries", "--mode", "closed",
                                   "--levels", "1,2", "--step-s", "1", "--p99-ms", "5000", "--json-out", str(out),
                                   "--png", str(png)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "knee shoal:" in proc.stdout and "% of the fp32-peak bound" in proc.stdout
    record = json.loads(out.read_text())
    steps = record["targets"]["shoal"]["steps"]
    assert [s["offered"] for s in steps] == [1, 2] and all(s["ok"] > 0 and s["errors"] == 0 for s in steps)
    assert record["targets"]["shoal"]["knee"]["ok"] > 0
    assert record["flops"]["flops_per_token"] > 20e6 and record["flops"]["fp32_gemm_peak_flops"] > 1e9
    assert 0 < record["ratios"]["shoal_share_of_bound"] < 1.5
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shoal_bench_refuses_a_workload_the_model_does_not_serve():
    proc = subprocess.run(SHOAL + ["bench", MODEL_ID, "--workload", "extract"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "workload extract needs extract" in proc.stderr


# --- tuned overlays -----------------------------------------------------------------------------


def _overlay(directory: Path, hardware: str, batching: dict, model: str = MODEL_ID) -> Path:
    (directory / "tuned").mkdir(parents=True, exist_ok=True)
    path = directory / "tuned" / overlay_name(model, hardware)
    path.write_text(yaml.safe_dump(dict(model=model, hardware=hardware, batching=batching, measured={"by": "test"})))
    return path


def test_a_tuned_overlay_lays_its_limits_over_the_card_for_its_hardware_field_by_field(tmp_path):
    card = Catalog.load().get(MODEL_ID)
    hardware = cpu_class()
    assert hardware.startswith("cpu")
    own = card.batching_for(hardware)
    _overlay(tmp_path, hardware, dict(max_batch_items=8, batch_wait_ms=3, threads=1))
    tuned = Catalog.load((tmp_path,)).get(MODEL_ID).batching_for(hardware)
    assert tuned == Batching(max_batch_tokens=own.max_batch_tokens, max_batch_items=8, batch_wait_ms=3, threads=1)
    # Another hardware class is untouched.
    assert Catalog.load((tmp_path,)).get(MODEL_ID).batching_for("cuda:Other GPU") == card.batching_for("cuda")


def test_a_broken_or_orphan_overlay_is_a_card_error_naming_the_file_or_listed_as_broken(tmp_path):
    bad = _overlay(tmp_path, "cpu", dict(batch_wait_ms=5000))
    with pytest.raises(CardError, match="batch_wait_ms"):
        load_tuned(bad)
    bad.unlink()
    orphan = _overlay(tmp_path, "cpu", dict(threads=1), model="no/such-model")
    with pytest.raises(CardError, match="no card serves"):
        Catalog.load((tmp_path,))
    assert str(orphan) in Catalog.load((tmp_path,), strict=False).broken


def test_the_engine_serves_with_a_tuned_overlays_wait_and_threads(serve, tmp_path, client):
    """batch_wait_ms: two requests 60 ms apart share one batch on an idle device; threads: the
    forward runs with the overlay's torch threads (on the device thread)."""
    import torch

    main_threads = torch.get_num_threads()
    _overlay(tmp_path, cpu_class(), dict(batch_wait_ms=400, threads=1))
    seen: list[tuple[int, int]] = []  # (texts in the batch, torch threads during the forward)

    def record(runner):
        forward = runner.forward

        def wrapped(batch, specs):
            out = forward(batch, specs)
            seen.append((len(specs), torch.get_num_threads()))
            return out

        runner.forward = wrapped
        return runner

    url = serve(cards_dirs=(tmp_path,), wrap_runner=record)
    import httpx

    seen.clear()
    answers = []

    def send(text: str) -> None:
        answers.append(httpx.post(f"{url}/v1/encode", json={"model": MODEL_ID, "items": [{"text": text}]}, timeout=30))

    first = threading.Thread(target=send, args=("the first text",))
    first.start()
    time.sleep(0.06)
    send("the second text")
    first.join()
    assert [a.status_code for a in answers] == [200, 200]
    assert seen == [(2, 1)]
    assert main_threads > 1 and torch.get_num_threads() == main_threads  # this thread's own count is untouched


def test_shoal_tune_writes_an_overlay_that_serve_reads(tmp_path):
    out = tmp_path / "models"
    proc = subprocess.run(SHOAL + ["tune", MODEL_ID, "--out", str(out), "--workload", "queries", "--items", "2", "--knobs",
                                   "max_batch_items", "--grid", "max_batch_items=8,16", "--clients", "1,2", "--confirm", "1",
                                   "--step-s", "1", "--p99-ms", "5000"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = (out / "tuned").iterdir()
    tuned = load_tuned(path)
    assert tuned.model == MODEL_ID and tuned.hardware == cpu_class()
    assert tuned.measured["description"] == "2 Lee sentence(s) per call"  # --items reached the workload
    trials = tuned.measured["trials"]
    # The card's own limits first, then each grid value of the one knob.
    assert [t["settings"]["max_batch_items"] for t in trials[:3]] == [64, 8, 16]
    assert all(t["best_tokens_per_s"] > 0 and len(t["levels"]) == 2 for t in trials)
    scores = {t["settings"]["max_batch_items"]: t["best_tokens_per_s"] for t in trials[:3]}
    # The rules, read off the recorded trials: a value is picked for a 3 % gain over the best so far,
    # then confirmed (one more turn each) only if its mean still gains 3 % over the card's mean.
    picked = 64
    for value in (8, 16):
        if scores[value] > 1.03 * scores[picked]:
            picked = value
    chosen = tuned.batching.max_batch_items
    written = {k for k, v in msgspec.to_builtins(tuned.batching).items() if v is not None}
    assert written <= {"max_batch_items"}  # only what was searched
    if picked == 64:
        assert len(trials) == 3 and chosen is None
    else:
        assert [t["settings"]["max_batch_items"] for t in trials[3:]] == [64, picked]
        ours = (scores[picked] + trials[4]["best_tokens_per_s"]) / 2
        theirs = (scores[64] + trials[3]["best_tokens_per_s"]) / 2
        assert chosen == (picked if ours > 1.03 * theirs else None)
        assert tuned.measured["confirmed"] == (chosen is not None)
    served = Catalog.load((out,)).get(MODEL_ID).batching_for(cpu_class())
    card_limits = Catalog.load().get(MODEL_ID).batching_for(cpu_class())
    assert served.max_batch_items == (chosen or card_limits.max_batch_items)
    assert served.max_batch_tokens == card_limits.max_batch_tokens


def test_shoal_tune_refuses_a_bad_grid_before_measuring_anything(tmp_path):
    proc = subprocess.run(SHOAL + ["tune", MODEL_ID, "--out", str(tmp_path), "--grid", "batch_wait_ms=5000"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "batch_wait_ms" in proc.stderr and "between 0 and 1000" in proc.stderr
    assert not (tmp_path / "tuned").exists()


@pytest.mark.parametrize("argv, message", [
    (["--levels", "inf"], "finite"), (["--levels", "nan"], "finite"), (["--step-s", "0"], "> 0"),
    (["--mode", "closed", "--levels", "0.5"], "whole numbers"), (["--items", "0"], ">= 1"),
    (["--workload", "passages", "--items", "400"], "there are 300"),
])
def test_shoal_bench_refuses_bad_flags_with_a_message(argv, message):
    proc = subprocess.run(SHOAL + ["bench", MODEL_ID, "--url", "http://127.0.0.1:9", *argv], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_packaged_tuned_overlays_name_served_models_record_their_knee_and_are_applied():
    import shoal.catalog

    catalog = Catalog.load()
    paths = sorted((Path(shoal.catalog.__file__).parent / "tuned").glob("*.yaml"))
    assert paths, "the package ships tuned CPU values"
    for path in paths:
        tuned = load_tuned(path)
        assert tuned.model in catalog and tuned.measured["best_tokens_per_s"] > 0
        applied = catalog.get(tuned.model).batching_for(tuned.hardware)
        for name, value in msgspec.to_builtins(tuned.batching).items():
            if value is not None:
                assert getattr(applied, name) == value
