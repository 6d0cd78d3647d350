"""`shoal tune MODEL`: find the batching that serves a model best on this machine, and write it
where `shoal serve` reads it.

Coordinate search from the card's own limits: one knob at a time (max_batch_tokens,
max_batch_items, batch_wait_ms, threads), each value served by a fresh `shoal serve` that reads the
candidate as a tuned overlay, its knee found by `shoal bench`'s ramp on the chosen workload; a value
is kept when its knee's tokens/s beats the best so far by `min_gain`. The winner is written as
`<dir>/tuned/<model>@<hardware>.yaml` with everything measured; `shoal serve --models-dir <dir>`
then uses it (a later overlay wins over the package's and the card's, field by field).
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
import time
from pathlib import Path

import msgspec
import yaml

from ..catalog import TUNED_DIR
from ..catalog.card import Batching, Tuned, load_tuned
from ..errors import ConfigError
from . import workloads
from .knee import Bounds
from .load import HttpTarget
from .run import Plan, measure_and_close
from .targets import shoal_serve

DEFAULT_VALUES = {
    "max_batch_tokens": (1024, 2048, 4096, 8192, 16384),
    "max_batch_items": (16, 32, 64, 128, 256),
    "batch_wait_ms": (0, 2, 5, 10),
}


def overlay_name(model_id: str, hardware: str) -> str:
    slug = lambda text: re.sub(r"[^\w.-]+", "-", text).strip("-")  # noqa: E731
    return f"{slug(model_id.replace('/', '--'))}@{slug(hardware)}.yaml"


def write_overlay(directory: Path, tuned: Tuned) -> Path:
    folder = directory / TUNED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / overlay_name(tuned.model, tuned.hardware)
    data = msgspec.to_builtins(tuned)
    data["batching"] = {k: v for k, v in data["batching"].items() if v is not None}
    path.write_text("# Written by `shoal tune`; `shoal serve --models-dir DIR` reads DIR/tuned/.\n"
                    + yaml.safe_dump(data, sort_keys=False, width=110))
    return path


async def _knee_of(url: str, model_id: str, workload: workloads.Workload, plan: Plan, log) -> tuple[float, dict]:
    steps, found, _ = await measure_and_close(HttpTarget("shoal", url, model_id, workload), plan, log=log)
    if found is None:
        return 0.0, dict(knee=None)
    return found.tokens_per_s, dict(knee_tokens_per_s=round(found.tokens_per_s, 1),
                                    knee_rps=round(found.achieved_rps, 2), knee_level=found.offered,
                                    p50_ms=found.percentile_ms(50), p99_ms=found.percentile_ms(99))


def tune(args) -> int:
    from ..catalog import Catalog
    from ..engine.hardware import hardware_class

    user_dirs = tuple(Path(d) for d in args.models_dir or ())
    out = Path(args.out) if args.out else (user_dirs[0] if user_dirs else None)
    if out is None:
        raise ConfigError("say where the tuned overlay goes: --out DIR or --models-dir DIR "
                          "(`shoal serve --models-dir DIR` then reads DIR/tuned/)")
    card = Catalog.load(user_dirs, strict=False).get(args.model)
    hardware = hardware_class(args.device)
    default_workload = {"encode": "passages", "score": "rerank", "extract": "extract"}[card.tasks[0]]
    labels = None if card.extract is not None and card.extract.kind == "token_class" else workloads.WNUT_LABELS
    workload = workloads.build(args.workload or default_workload, seed=args.seed, labels=labels)
    plan = Plan(mode="closed", levels=tuple(args.clients), step_s=args.step_s, warmup_s=1.0,
                bounds=Bounds(p99_ms=args.p99_ms or workloads.DEFAULT_P99_MS[workload.name]), seed=args.seed)
    cores = os.cpu_count() or 1
    values = dict(DEFAULT_VALUES, threads=tuple(sorted({1, max(1, cores // 2), cores})))
    for spec in args.grid:
        knob, _, listed = spec.partition("=")
        try:
            parsed = tuple(float(v) if knob == "batch_wait_ms" else int(v) for v in listed.split(",") if v)
        except ValueError:
            parsed = ()
        if knob not in values or not parsed:
            raise ConfigError(f"--grid {spec!r}: write KNOB=V1,V2 with KNOB one of {', '.join(values)}")
        values[knob] = parsed
    knobs = args.knobs or list(values)
    for knob in knobs:
        if knob not in values:
            raise ConfigError(f"--knobs {knob}: use {', '.join(values)}")
    start = card.batching_for(hardware)
    current = Batching(max_batch_tokens=start.max_batch_tokens or 16384, max_batch_items=start.max_batch_items or 256,
                       batch_wait_ms=start.batch_wait_ms or 0, threads=start.threads or cores)
    trials: list[dict] = []
    print(f"shoal tune: {card.id} on {hardware}, workload {workload.name} ({workload.description}), "
          f"clients {list(plan.levels)}, {plan.step_s:g} s a level, p99 <= {plan.bounds.p99_ms:g} ms")

    with tempfile.TemporaryDirectory() as tmp:
        def trial(batching: Batching) -> float:
            candidate = Tuned(card.id, hardware, batching)
            load_tuned(write_overlay(Path(tmp), candidate))  # valid (else CardError), and the last overlay read
            serve_args = [a for d in (*user_dirs, Path(tmp)) for a in ("--models-dir", str(d))]
            serve_args += ["--device", args.device]
            with shoal_serve(card.id, Path(tmp) / "serve.log", args=serve_args) as (url, _):
                score, measured = asyncio.run(_knee_of(url, card.id, workload, plan, log=lambda line: None))
            settings = {k: v for k, v in msgspec.to_builtins(batching).items() if v is not None}
            trials.append(dict(settings=settings, **measured))
            print(f"  {settings}: knee {score:,.0f} tokens/s"
                  + (f", p99 {measured['p99_ms']:.0f} ms at {measured['knee_level']:g} clients" if score else ""))
            return score

        best_score = baseline_score = trial(current)
        for knob in knobs:
            for value in values[knob]:
                if getattr(current, knob) == value:
                    continue
                candidate = msgspec.structs.replace(current, **{knob: value})
                score = trial(candidate)
                if score > best_score * (1 + args.min_gain):
                    current, best_score = candidate, score
    if best_score <= 0:
        raise ConfigError(f"no setting met p99 <= {plan.bounds.p99_ms:g} ms: raise --p99-ms or lower --clients")
    measured = dict(date=time.strftime("%Y-%m-%d"), workload=workload.name, description=workload.description,
                    mode="closed", clients=list(plan.levels), step_s=plan.step_s, p99_bound_ms=plan.bounds.p99_ms,
                    cores=cores, knee_tokens_per_s=round(best_score, 1),
                    card_knee_tokens_per_s=round(baseline_score, 1),
                    gain=round(best_score / baseline_score, 3) if baseline_score else None, trials=trials)
    path = write_overlay(out, Tuned(card.id, hardware, current, measured))
    gain = f" ({best_score / baseline_score:.2f}x the card's limits)" if baseline_score else ""
    print(f"best: {msgspec.to_builtins(current)}: {best_score:,.0f} tokens/s{gain}\nwrote {path}")
    return 0
