"""`shoal bench` and `shoal tune`: knees, workloads from packaged text, real load against a real
server, tuned overlays that the catalog, the engine and `shoal serve` use."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml

from conftest import need_tool
from shoal.bench import machine, tune_gate, workloads
from shoal.bench import tune as tune_module
from shoal.bench.knee import Bounds, knee
from shoal.bench.load import HttpTarget, Outcome, Step, closed_loop, open_loop
from shoal.bench.run import Plan, call_tokens, measure_and_close
from shoal.bench.tune import overlay_name
from shoal.bench.tune_gate import QualityGate, min_cosine
from shoal.bench.tune_search import search
from shoal.catalog import Catalog, load_tuned, parse_card
from shoal.catalog.card import Batching
from shoal.cpuinfo import cpu_flags
from shoal.engine.hardware import cpu_class, cpu_isa
from shoal.errors import CardError, ConfigError

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
    return Step(
        mode,
        offered,
        duration,
        window_s=duration if mode == "open" else 0.0,
        sent=sent,
        ok=ok,
        errors=sent - ok,
        latencies_ms=[1.0] * (ok - slow) + [p99_ms] * slow,
    )


def test_the_open_loop_knee_is_the_highest_rate_served_within_the_bounds():
    steps = [
        _step("open", 10, 10, 50),
        _step("open", 20, 20, 80),
        _step("open", 40, 40, 140),
        _step("open", 60, 45, 900),  # the rate is no longer followed (and p99 is past the bound)
        _step("open", 80, 46, 3000),
    ]
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
    steps = [
        _step("closed", 1, 50, 30),
        _step("closed", 4, 150, 40),
        _step("closed", 16, 190, 100),
        _step("closed", 32, 195, 200),
        _step("closed", 64, 196, 450),
    ]
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


def test_the_load_generators_client_keeps_connections_alive_reads_chunks_and_drops_broken_ones():
    """The bench's own HTTP/1.1 client (load.py's _Pool) against a plain asyncio server on loopback
    whose answer each call's text chooses."""
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            body = await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I)[1]))
            kind = json.loads(body)["items"][0]["text"]
            reply = b'{"usage": {"tokens": 7}}'
            if kind == "chunked":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (reply[:5], reply[5:]))
                    + b"0\r\n\r\n"
                )
            elif kind == "slow":  # answers past the client's timeout
                await asyncio.sleep(1.5)
                with contextlib.suppress(ConnectionError):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
                    await writer.drain()
                writer.close()
                return
            else:
                status = b"404 Not Found" if kind == "missing" else b"200 OK"
                reply = b"<html>not json" if kind == "garbled" else reply
                close = kind == "close"
                writer.write(
                    b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s"
                    % (status, len(reply), b"connection: close\r\n" if close else b"", reply)
                )
                if close:
                    await writer.drain()
                    writer.close()
                    return
            await writer.drain()

    kinds = ("plain", "chunked", "close", "slow", "missing", "garbled")
    work = workloads.Workload("kinds", "encode", tuple(workloads.Call((k,)) for k in kinds), "one answer each")

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        target = HttpTarget("stub", f"http://127.0.0.1:{port}", "m", work, timeout_s=1.0)
        try:
            plain, chunked, close, slow, missing, garbled = range(6)
            assert await target.send(plain) == Outcome(True, 7, 200)
            assert await target.send(chunked) == Outcome(True, 7, 200)  # de-chunked, on the same connection
            assert await target.send(plain) == Outcome(True, 7, 200) and len(accepted) == 1
            assert await target.send(close) == Outcome(True, 7, 200)
            assert await target.send(plain) == Outcome(True, 7, 200) and len(accepted) == 2  # a new one
            assert await target.send(slow) == Outcome(False, status=0)  # timed out: an error, not a hang
            assert await target.send(missing) == Outcome(False, status=404)
            assert len(accepted) == 3  # the timed-out connection was not reused
            assert await target.send(plain) == Outcome(True, 7, 200) and len(accepted) == 3  # the 404's was
            assert await target.send(garbled) == Outcome(False, status=200)  # a body that is not the reply
            answers = await asyncio.gather(*(target.send(plain) for _ in range(4)))
            assert answers == [Outcome(True, 7, 200)] * 4 and len(accepted) == 6  # one per exchange in flight
        finally:
            await target.aclose()
            server.close()

    asyncio.run(run())
    for url in ("ftp://127.0.0.1:1", "127.0.0.1:8080", "http://127.0.0.1:port"):
        with pytest.raises(ConfigError, match="http"):
            HttpTarget("stub", url, "m", work)


def test_a_ramp_against_a_real_server_finds_a_knee_and_an_unserved_model_errs(base_url):
    plan = Plan(mode="closed", levels=(1, 2), step_s=1.0, warmup_s=0.5, bounds=Bounds(p99_ms=5000))
    work = workloads.build("queries", num_calls=32)
    steps, found, _ = asyncio.run(
        measure_and_close(HttpTarget("shoal", base_url, MODEL_ID, work), plan, log=lambda s: None)
    )
    assert [s.offered for s in steps] == [1, 2] and found is not None and found.ok > 0
    bad = HttpTarget("shoal", base_url, "no/such-model", work)
    steps, found, _ = asyncio.run(measure_and_close(bad, plan, log=lambda s: None))
    assert found is None and all(s.ok == 0 and s.statuses.get(404) == s.sent for s in steps)


def test_shoal_bench_prints_the_knee_and_writes_json_and_a_png(base_url, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        SHOAL
        + [
            "bench",
            MODEL_ID,
            "--url",
            base_url,
            "--workload",
            "queries",
            "--mode",
            "closed",
            "--levels",
            "1,2",
            "--step-s",
            "1",
            "--p99-ms",
            "5000",
            "--json-out",
            str(out),
            "--png",
            str(png),
            "--against",
            "st",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "knee shoal:" in proc.stdout and "% of the fp32-peak bound" in proc.stdout
    # sentence-transformers in this process on the same calls, and the ratio printed and recorded
    assert "shoal knee / sentence-transformers:" in proc.stdout
    record = json.loads(out.read_text())
    steps = record["targets"]["shoal"]["steps"]
    assert [s["offered"] for s in steps] == [1, 2] and all(s["ok"] > 0 and s["errors"] == 0 for s in steps)
    assert record["targets"]["shoal"]["knee"]["ok"] > 0
    assert record["flops"]["flops_per_token"] > 20e6 and record["flops"]["fp32_gemm_peak_flops"] > 1e9
    # probed before and after the load; the better probe is the peak
    probes = record["flops"]["fp32_gemm_probes_flops"]
    assert len(probes) == 2 and record["flops"]["fp32_gemm_peak_flops"] == max(probes)
    assert 0 < record["ratios"]["shoal_share_of_bound"] < 1.5
    assert record["ratios"]["shoal_over_st_tokens"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shoal_bench_measures_a_float32_server_beside_shoal_in_the_same_run_and_prints_per_core(base_url, tmp_path):
    """`--against shoal-float32` starts a second `shoal serve` with reduced precision off and ramps it
    on the same calls; the run ends with every figure per usable core (the one-run table)."""
    from shoal.cpuinfo import usable_cores

    out = tmp_path / "bench.json"
    proc = subprocess.run(
        SHOAL
        + ["bench", MODEL_ID, "--url", base_url, "--workload", "queries", "--mode", "closed", "--levels", "1"]
        + ["--step-s", "1", "--p99-ms", "5000", "--json-out", str(out), "--against", "shoal-float32"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["precisions"]["shoal-float32"] == "float32"
    assert record["precisions"]["shoal"] == record["precision"]
    knees = {name: record["targets"][name]["knee"] for name in ("shoal", "shoal-float32")}
    assert all(knee and knee["ok"] > 0 for knee in knees.values())
    assert record["targets"]["shoal-float32"]["url"] != base_url  # its own server
    ratio = knees["shoal"]["tokens_per_s"] / knees["shoal-float32"]["tokens_per_s"]
    assert record["ratios"]["shoal_over_float32_tokens"] == pytest.approx(ratio, rel=1e-3)
    cores = usable_cores()
    for name, found in knees.items():
        assert record["per_core_tokens"][name] == pytest.approx(found["tokens_per_s"] / cores, abs=0.1)
    assert f"per core ({cores} usable)" in proc.stdout and "shoal-float32" in proc.stdout


INFINITY_VENV = Path(__file__).resolve().parents[1] / ".tools" / "infinity"
INFINITY = INFINITY_VENV / "bin" / "infinity_emb"


@pytest.mark.timeout(480)
def test_shoal_bench_runs_infinity_beside_shoal_on_the_same_calls_and_prints_the_ratio(base_url, tmp_path):
    """Infinity 0.0.78 from its own venv (`make tools`), serving MiniLM's packaged folder offline."""
    need_tool((INFINITY_VENV / ".installed").exists(), "Infinity's virtualenv (.tools/infinity, `make tools`)")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        SHOAL
        + [
            "bench",
            MODEL_ID,
            "--url",
            base_url,
            "--workload",
            "queries",
            "--mode",
            "closed",
            "--levels",
            "2",
            "--step-s",
            "2",
            "--p99-ms",
            "5000",
            "--json-out",
            str(out),
            "--against",
            "infinity",
            "--infinity",
            str(INFINITY),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "knee infinity:" in proc.stdout and "shoal / infinity at the knee:" in proc.stdout
    record = json.loads(out.read_text())
    shoal, infinity = record["targets"]["shoal"], record["targets"]["infinity"]
    assert infinity["url"] != base_url
    for target in (shoal, infinity):
        assert [s["offered"] for s in target["steps"]] == [2]
        assert all(s["ok"] > 0 and s["errors"] == 0 and s["tokens_per_s"] > 0 for s in target["steps"])
    ratio = shoal["knee"]["achieved_rps"] / infinity["knee"]["achieved_rps"]
    assert record["ratios"]["shoal_over_infinity_rps"] == pytest.approx(ratio, rel=0.02)


def test_shoal_bench_refuses_a_workload_the_model_does_not_serve():
    proc = subprocess.run(
        SHOAL + ["bench", MODEL_ID, "--workload", "extract"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
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


def test_a_cpu_class_names_its_isa_and_limits_fall_back_from_it_to_the_model_name_then_the_kind(tmp_path):
    assert cpu_isa({"avx2", "fma"}) == "avx2" and cpu_isa({"avx2", "avx_vnni"}) == "avx2-vnni"
    assert cpu_isa({"avx2", "avx512f"}) == "avx512" and cpu_isa({"avx512f", "avx512_vnni"}) == "avx512-vnni"
    assert cpu_isa({"avx512f", "amx_tile", "amx_int8"}) == "amx" and cpu_isa({"sse4_2"}) is None
    here = cpu_class()
    isa = cpu_isa(cpu_flags())
    assert here.endswith(f"+{isa}") if isa and here != "cpu" else "+" not in here
    text = (
        "id: test/isa\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\nbatching:\n"
        "  cpu: {max_batch_tokens: 4096, max_batch_items: 64}\n  'cpu:Some CPU': {max_batch_items: 32, threads: 2}\n"
        "  'cpu:Some CPU+avx2': {threads: 1, attention: padded}\n"
    )
    card = parse_card(yaml.safe_load(text), "isa.yaml")
    assert card.batching_for("cpu:Some CPU+avx2") == Batching(4096, 32, threads=1, attention="padded")
    assert card.batching_for("cpu:Some CPU+avx512") == Batching(4096, 32, threads=2)  # the name alone
    assert card.batching_for("cpu:Other CPU+avx2") == Batching(4096, 64)
    with pytest.raises(CardError, match="not a hardware class"):
        parse_card(yaml.safe_load(text.replace("'cpu:Some CPU+avx2'", "'cuda:Some GPU+x'")), "isa.yaml")


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

    from shoal.config import EngineSettings

    # One lane: with two, the lane that ends the wait takes half of what it gathered.
    url = serve(cards_dirs=(tmp_path,), wrap_runner=record, engine=EngineSettings(device_lanes=1))
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
    proc = subprocess.run(
        SHOAL
        + [
            "tune",
            MODEL_ID,
            "--out",
            str(out),
            "--workload",
            "queries",
            "--items",
            "2",
            "--knobs",
            "max_batch_items",
            "--grid",
            "max_batch_items=8,16",
            "--clients",
            "1,2",
            "--confirm",
            "1",
            "--step-s",
            "1",
            "--p99-ms",
            "5000",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
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
    # then confirmed (one more turn each) only if that turn still gains 3 % over the card's turn (the
    # search's own trials are not counted: the pick's was chosen for being high).
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
        ours, theirs = trials[4]["best_tokens_per_s"], trials[3]["best_tokens_per_s"]
        assert chosen == (picked if ours > 1.03 * theirs else None)
        assert tuned.measured["confirmed"] == (chosen is not None)
    served = Catalog.load((out,)).get(MODEL_ID).batching_for(cpu_class())
    card_limits = Catalog.load().get(MODEL_ID).batching_for(cpu_class())
    assert served.max_batch_items == (chosen or card_limits.max_batch_items)
    assert served.max_batch_tokens == card_limits.max_batch_tokens


def test_tune_searches_one_lane_and_two_on_a_gpu_and_a_cpu_of_two_cores_and_none_on_one_core():
    assert tune_module._grid([], 2, cpu_class())["lanes"] == (1, 2)
    assert tune_module._grid([], 1, cpu_class())["lanes"] == ()
    assert tune_module._grid([], 16, "cuda:NVIDIA H200")["lanes"] == (1, 2)
    assert tune_module._grid(["lanes=1,3"], 4, cpu_class())["lanes"] == (1, 3)
    assert tune_module._grid(["lanes=1,3"], 1, "cuda:NVIDIA H200")["lanes"] == (1, 3)
    with pytest.raises(ConfigError, match="lanes are 1 or more"):
        tune_module._grid(["lanes=0,2"], 16, "cuda:NVIDIA H200")


def test_tune_skips_threads_values_that_give_each_lane_the_same_threads():
    assert tune_module._distinct_threads((1, 1, 2), None, 2, 2) == ()  # a thread per lane, whatever the value
    assert tune_module._distinct_threads((1, 2, 4), None, 4, 2) == (1,)  # 1 and 2: a thread a lane; 4: two, as unset
    assert tune_module._distinct_threads((1, 2), None, 2, 1) == (1,)  # one lane: 2 is the cores, as unset
    assert tune_module._distinct_threads((1, 2, 4), 1, 4, 1) == (2, 4)


def test_shoal_tune_searches_the_lanes_first_and_measures_the_cards_knobs_at_the_lanes_kept(tmp_path):
    out = tmp_path / "models"
    proc = subprocess.run(
        SHOAL
        + [
            "tune",
            MODEL_ID,
            "--out",
            str(out),
            "--workload",
            "queries",
            "--items",
            "2",
            "--knobs",
            "max_batch_items,lanes",
            "--grid",
            "max_batch_items=16",
            "--grid",
            "lanes=1,2",
            "--clients",
            "2",
            "--confirm",
            "1",
            "--step-s",
            "1",
            "--p99-ms",
            "5000",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SHOAL_DEVICE_LANES": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = (out / "tuned").iterdir()
    measured = load_tuned(path).measured
    trials = measured["trials"]
    assert measured["serve_lanes"] == 1  # SHOAL_DEVICE_LANES, which the servers tune starts inherit
    # The card's limits at serve's lanes, then at 2; confirmation turns if 2 gained; then the card's knob.
    assert [t["lanes"] for t in trials[:2]] == [1, 2] and all(
        t["settings"] == trials[0]["settings"] for t in trials[:2]
    )
    first, second = (t["best_tokens_per_s"] for t in trials[:2])
    kept = measured["lanes"]
    if second > 1.03 * first:
        assert [t["lanes"] for t in trials[2:4]] == [1, 2]
        ours, theirs = trials[3]["best_tokens_per_s"], trials[2]["best_tokens_per_s"]
        assert kept == (2 if ours > 1.03 * theirs else 1) and measured["lanes_confirmed"] == (kept == 2)
        rest = trials[4:]
    else:
        assert kept == 1 and measured["lanes_confirmed"] is None
        rest = trials[2:]
    assert rest and all(t["lanes"] == kept for t in rest)  # the card's knob, measured at the lanes kept
    assert {t["settings"]["max_batch_items"] for t in rest} >= {16}
    assert ("serve with --lanes 2" in proc.stdout) == (kept == 2)
    assert measured["lanes_tokens_per_s"] >= measured["serve_lanes_tokens_per_s"] > 0
    assert "lanes" not in (yaml.safe_load(path.read_text())["batching"] or {})  # the device's, not the model's


def _scripted(scores: dict[tuple, list[float]]):
    """A trial that gives each (max_batch_items, batch_wait_ms) its listed scores in turn, and the
    order it was asked for them."""
    asked: list[tuple] = []

    def trial(batching: Batching) -> float:
        key = (batching.max_batch_items, batching.batch_wait_ms)
        asked.append(key)
        return scores[key].pop(0)

    return trial, asked


def test_tune_search_confirms_a_winner_by_the_confirmation_turns_alone():
    """A value is kept for a 3 % gain over the best so far; a lucky single trial (200 once, then like
    the start) is not confirmed, because the trial it was picked for is not counted again."""
    start, values = Batching(max_batch_items=64), {"max_batch_items": (8, 16)}
    trial, asked = _scripted({(64, None): [100, 100, 100], (8, None): [102], (16, None): [200, 101, 101]})
    found = search(trial, start, values, ["max_batch_items"], 0.03, 2, log=lambda line: None)
    assert asked == [(64, None), (8, None), (16, None), (64, None), (16, None), (64, None), (16, None)]
    assert (found.best, found.best_score, found.start_score, found.confirmed) == (start, 100, 100, False)
    # With the winner's own trial counted (200, 101, 101 against 100, 100, 100) it would have passed.
    assert (200 + 101 + 101) / 3 > 1.03 * 100


def test_tune_search_builds_each_knob_on_the_last_and_keeps_a_confirmed_winner():
    start = Batching(max_batch_items=64)
    values = {"max_batch_items": (8, 16), "batch_wait_ms": (0, 5)}
    trial, asked = _scripted(
        {
            (64, None): [100, 100],
            (8, None): [150],
            (16, None): [153],  # 16: under 3 % more
            (8, 0): [140],
            (8, 5): [160, 158],
        }
    )
    found = search(trial, start, values, ["max_batch_items", "batch_wait_ms"], 0.03, 1, log=lambda line: None)
    assert asked == [(64, None), (8, None), (16, None), (8, 0), (8, 5), (64, None), (8, 5)]
    assert found.best == Batching(max_batch_items=8, batch_wait_ms=5)
    assert (found.best_score, found.start_score, found.confirmed) == (158, 100, True)
    # No confirmation asked for: the search's pick stands, unconfirmed; the start's value, met again
    # once the search has moved on, keeps its first score (no second trial).
    trial, asked = _scripted({(64, None): [100], (8, None): [150], (16, None): [100]})
    found = search(trial, start, {"max_batch_items": (8, 16, 64)}, ["max_batch_items"], 0.03, 0, log=lambda line: None)
    assert (found.best.max_batch_items, found.best_score, found.confirmed) == (8, 150, None)
    assert asked == [(64, None), (8, None), (16, None)]


def test_the_quality_gate_takes_its_reference_from_the_start_and_refuses_what_it_cannot_compare(monkeypatch):
    """The start always serves (its vectors are the reference, if it gives any); a quantize
    candidate serves only with every vector within the bar; one that cannot be compared (no
    reference, a failed or short answer, a NaN) is refused with the reason, never passed."""
    answers: list = []
    monkeypatch.setattr(tune_gate, "_dense_vectors", lambda url, model, texts: answers.pop(0))
    start = Batching(max_batch_items=64, quantize="none")
    int8, other = Batching(max_batch_items=64, quantize="int8"), Batching(max_batch_items=16, quantize="none")
    gate = QualityGate("m", ["a", "b"], start, 0.99)
    answers.append(None)  # the start's server did not answer the embeddings route
    assert gate.check("u", start) == ({}, None) and gate.reference == []
    assert "no vectors to compare" in gate.check("u", int8)[1]
    answers.append([[1.0, 0.0], [0.0, 1.0]])
    assert gate.check("u", start) == ({}, None) and gate.reference == [[1.0, 0.0], [0.0, 1.0]]
    assert gate.check("u", other) == ({}, None) and not answers  # same quantize: nothing asked
    answers.append([[1.0, 0.01], [0.0, 1.0]])
    quality, refused = gate.check("u", int8)
    assert refused is None and quality["texts"] == 2 and 0.9999 < quality["min_cosine"] < 1.0
    answers.append([[1.0, 0.5], [0.0, 1.0]])  # cosine 0.894
    quality, refused = gate.check("u", int8)
    assert quality["min_cosine"] == pytest.approx(0.894427, abs=1e-6) and "0.894427 < 0.99" in refused
    for answer, reason in [
        (None, "did not give 2"),
        ([[1.0, 0.0]], "did not give 2"),
        ([[float("nan"), 0.0], [0.0, 1.0]], "not finite"),
        ([[1.0, 0.0], [float("nan"), 1.0]], "not finite"),
    ]:  # last, too (min() skips NaN there)
        answers.append(answer)
        assert reason in gate.check("u", int8)[1]


def test_min_cosine_is_the_smallest_over_pairs():
    assert min_cosine([[1.0, 0.0], [0.0, 2.0]], [[3.0, 0.0], [1.0, 1.0]]) == pytest.approx(2**-0.5)
    with pytest.raises(ValueError):
        min_cosine([[1.0, 0.0]], [])  # a server that answered fewer vectors than asked


def test_quantize_in_limits_is_for_cpus_and_float32_cards_and_chooses_the_cards_quantize(tmp_path):
    with pytest.raises(CardError, match="CPUs only"):
        load_tuned(_overlay(tmp_path, "cuda:NVIDIA H200", dict(quantize="int8")))
    text = "id: test/half\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\ndtype: bfloat16\n"
    with pytest.raises(CardError, match="float32") as info:
        parse_card(yaml.safe_load(text + "batching: {cpu: {quantize: int8}}\n"), "half.yaml")
    assert info.value.details["field"] == "batching.cpu.quantize"
    (tmp_path / "half.yaml").write_text(text)
    (tmp_path / "tuned").joinpath(overlay_name(MODEL_ID, "cuda:NVIDIA H200")).unlink()
    _overlay(tmp_path, cpu_class(), dict(quantize="int8"), model="test/half")
    with pytest.raises(CardError, match="drop quantize"):
        Catalog.load((tmp_path,))
    # On a float32 card: the overlay's choice for its class, the card's own elsewhere; "none" undoes int8.
    (tmp_path / "half.yaml").unlink()
    (tmp_path / "tuned").joinpath(overlay_name("test/half", cpu_class())).unlink()
    _overlay(tmp_path, cpu_class(), dict(quantize="int8"))
    card = Catalog.load((tmp_path,)).get(MODEL_ID)
    assert card.quantize is None and card.quantize_for(cpu_class()).quantize == "int8"
    assert card.quantize_for("cpu:Some Other CPU").quantize is None
    int8 = msgspec.structs.replace(card, quantize="int8", batching={cpu_class(): Batching(quantize="none")})
    assert int8.quantize_for(cpu_class()).quantize is None and int8.quantize_for("cpu").quantize == "int8"


def test_shoal_tune_tries_int8_behind_a_quality_gate(tmp_path):
    """The int8 candidate serves only after its vectors for the workload's texts pass the cosine bar
    against the card's own (float32) server; a bar it cannot pass scores it 0 without a load."""

    def tune(out: Path, *flags: str) -> list[dict]:
        proc = subprocess.run(
            SHOAL
            + [
                "tune",
                MODEL_ID,
                "--out",
                str(out),
                "--workload",
                "queries",
                "--items",
                "2",
                "--knobs",
                "quantize",
                "--clients",
                "1",
                "--step-s",
                "1",
                "--p99-ms",
                "5000",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [path] = (out / "tuned").iterdir()
        return load_tuned(path)

    tuned = tune(tmp_path / "a", "--confirm", "1")
    trials = tuned.measured["trials"]
    assert [t["settings"]["quantize"] for t in trials[:2]] == ["none", "int8"]
    assert "quality" not in trials[0]  # the reference
    assert trials[1]["quality"]["texts"] == 32 and 0.99 <= trials[1]["quality"]["min_cosine"] < 1.0
    assert all(t["best_tokens_per_s"] > 0 for t in trials)
    if trials[1]["best_tokens_per_s"] > 1.03 * trials[0]["best_tokens_per_s"]:  # picked: then confirmed or not
        assert [t["settings"]["quantize"] for t in trials[2:]] == ["none", "int8"]
        kept = trials[3]["best_tokens_per_s"] > 1.03 * trials[2]["best_tokens_per_s"]
    else:
        assert len(trials) == 2
        kept = False
    assert tuned.batching.quantize == ("int8" if kept else None)
    served = Catalog.load((tmp_path / "a",)).get(MODEL_ID).quantize_for(cpu_class())
    assert served.quantize == ("int8" if kept else None)

    refused = tune(tmp_path / "b", "--confirm", "0", "--min-cosine", "1")
    first, second = refused.measured["trials"]
    assert second["best_tokens_per_s"] == 0 and "quality gate" in second["error"] and "levels" not in second
    assert first["best_tokens_per_s"] > 0 and refused.batching == Batching()


@pytest.mark.parametrize(
    "grid, message",
    [
        ("batch_wait_ms=5000", "between 0 and 1000"),
        ("attention=fast", "attention takes padded and each"),
        ("row_block_bytes=0,-5", "must be >= 0"),
        ("lanes=0,2", "lanes are 1 or more"),
    ],
)
def test_shoal_tune_refuses_a_bad_grid_before_measuring_anything(tmp_path, grid, message):
    proc = subprocess.run(
        SHOAL + ["tune", MODEL_ID, "--out", str(tmp_path), "--grid", grid],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and grid.split("=")[0] in proc.stderr and message in proc.stderr
    assert not (tmp_path / "tuned").exists()


def test_a_limit_of_padded_attention_keeps_the_runner_off_the_each_path(card, model_dir, monkeypatch):
    """`batching.attention: padded` (a tuned overlay's kernel choice): the runner's forwards take the
    padded length groups; by default the same texts take the "each" path, with the same vectors."""
    from shoal.engine.runner import ModelRunner
    from shoal.engine.types import Batch, EncodeSpec
    from shoal.layers import attention

    taken: list[str] = []
    real = attention.attention_path
    monkeypatch.setattr(attention, "attention_path", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    texts = ["a short one", "a somewhat longer text than the first, with a few more words in it", "mid length text"]
    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    vectors = {}
    for choice in (None, "padded"):
        chosen = msgspec.structs.replace(card, batching={cpu_class(): Batching(attention=choice)})
        runner = ModelRunner.from_dir(chosen, model_dir, "cpu")
        seqs = runner.tokenizer.encode(texts, truncate=True)
        taken.clear()
        vectors[choice] = [item.dense for item in runner.forward(Batch.pack(seqs), [spec] * len(seqs))]
        assert set(taken) == {"each" if choice is None else "padded"} and len(taken) == 6  # MiniLM's 6 layers
    for a, b in zip(vectors[None], vectors["padded"]):
        assert float((a * b).sum()) >= 0.99999


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--levels", "inf"], "finite"),
        (["--levels", "nan"], "finite"),
        (["--step-s", "0"], "> 0"),
        (["--mode", "closed", "--levels", "0.5"], "whole numbers"),
        (["--items", "0"], ">= 1"),
        (["--workload", "passages", "--items", "400"], "there are 300"),
    ],
)
def test_shoal_bench_refuses_bad_flags_with_a_message(argv, message):
    proc = subprocess.run(
        SHOAL + ["bench", MODEL_ID, "--url", "http://127.0.0.1:9", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_packaged_tuned_overlays_name_served_models_record_their_knee_and_are_applied():
    import shoal.catalog

    catalog = Catalog.load()
    paths = sorted((Path(shoal.catalog.__file__).parent / "tuned").glob("*.yaml"))
    assert paths, "the package ships tuned CPU values"
    for path in paths:
        tuned = load_tuned(path)
        assert tuned.model in catalog and tuned.measured["best_tokens_per_s"] > 0
        assert tuned.batching.quantize is None  # shipped values never change a card's numerics (docs/models.md)
        applied = catalog.get(tuned.model).batching_for(tuned.hardware)
        for name, value in msgspec.to_builtins(tuned.batching).items():
            if value is not None:
                assert getattr(applied, name) == value


def test_small_batches_run_on_a_thread_fewer_and_the_limit_is_checked():
    from types import SimpleNamespace

    from shoal.engine.runner import SMALL_BATCH_TOKENS, ModelRunner

    two = SimpleNamespace(threads=2, small_batch_tokens=SMALL_BATCH_TOKENS)
    assert ModelRunner.threads_for(two, SMALL_BATCH_TOKENS - 1) == 1
    assert ModelRunner.threads_for(two, SMALL_BATCH_TOKENS) == 2
    assert ModelRunner.threads_for(SimpleNamespace(threads=1, small_batch_tokens=4096), 10) == 1  # never 0
    assert ModelRunner.threads_for(SimpleNamespace(threads=8, small_batch_tokens=0), 10) == 8  # off
    text = (
        "id: test/small\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\nbatching:\n"
        "  cpu: {small_batch_tokens: -1}\n"
    )
    with pytest.raises(CardError, match="small_batch_tokens"):
        parse_card(yaml.safe_load(text), "small.yaml")
    assert parse_card(yaml.safe_load(text.replace("-1", "0")), "small.yaml").batching_for("cpu").small_batch_tokens == 0


def test_row_blocks_are_a_cpu_limit_the_runner_takes_and_that_changes_no_vector(card, model_dir):
    """`batching.row_block_bytes` (a kernel knob of `shoal tune`): by default a CPU runs each layer's
    feed-forward a block of rows at a time (512 of MiniLM's tokens), with 0 over the whole batch in one
    call; the vectors are the same either way. Negative values and GPU classes are refused."""
    from shoal.catalog.card import ROW_BLOCK_BYTES
    from shoal.engine.runner import ModelRunner
    from shoal.engine.types import Batch, EncodeSpec

    texts = [workloads.lee_documents()[i] for i in range(8)]
    spec = EncodeSpec(normalize=True, dimensions=None, output_dtype="float32")
    vectors, calls = {}, {}
    for choice in (None, 0, 1 << 20):
        chosen = msgspec.structs.replace(card, batching={cpu_class(): Batching(row_block_bytes=choice)})
        runner = ModelRunner.from_dir(chosen, model_dir, "cpu")
        assert runner.row_block_bytes == (ROW_BLOCK_BYTES if choice is None else choice)
        seqs = runner.tokenizer.encode(texts, truncate=True)
        seen: list[int] = []
        # The hook runs (and reads `seen`) within this iteration only.
        runner.model.layers[0].ffn_in.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))  # noqa: B023
        vectors[choice] = np.stack([item.dense for item in runner.forward(Batch.pack(seqs), [spec] * len(seqs))])
        calls[choice] = seen
    num_tokens = sum(calls[0])
    assert num_tokens > 1024 and calls[0] == [num_tokens]
    assert calls[None] == [min(512, num_tokens - s) for s in range(0, num_tokens, 512)]  # 3 MiB of 1,536 floats a row
    assert calls[1 << 20] == [min(170, num_tokens - s) for s in range(0, num_tokens, 170)]
    for choice in (None, 1 << 20):
        assert (vectors[choice] * vectors[0]).sum(1).min() >= 0.99999
    text = (
        "id: test/rows\nsource: {hub: org/model}\nmax_length: 128\npooling: mean\ndimensions: 8\nbatching:\n"
        "  cpu: {row_block_bytes: -1}\n"
    )
    with pytest.raises(CardError, match="row_block_bytes.*>= 0"):
        parse_card(yaml.safe_load(text), "rows.yaml")
    with pytest.raises(CardError, match="row_block_bytes.*CPUs only"):
        parse_card(yaml.safe_load(text.replace("cpu:", "cuda:").replace("-1", "0")), "rows.yaml")
    assert parse_card(yaml.safe_load(text.replace("-1", "0")), "rows.yaml").batching_for("cpu").row_block_bytes == 0
