"""`shoal tune MODEL`: find the batching and kernels that serve a model best on this machine, and
write them where `shoal serve` reads them.

Coordinate search (bench/tune_search.py) from the card's own limits: one knob at a time
(max_batch_tokens, max_batch_items, batch_wait_ms, threads, the CPU attention path and feed-forward
row blocks, `quantize` int8 where the card can take it, and `dtype` bfloat16 where the CPU has it
natively), each value served by a fresh
`shoal serve` that reads the candidate as a tuned overlay, ramped as `shoal bench` does (closed
loop) on the chosen workload; a value is kept when its best tokens/s within the bounds beats the
best so far by `min_gain` (a server that fails to start scores 0). int8 and bfloat16 change
outputs, so a quantize or dtype candidate must first pass a quality gate (bench/tune_gate.py):
every dense vector it gives for the workload's texts within `min_cosine` of the card's own, float32
(else it scores 0). Only the knobs the search changed are written (and a searched dtype always),
as `<dir>/tuned/<model>@<hardware>.yaml` with everything measured; `shoal serve --models-dir <dir>`
then uses it (a later overlay wins over the package's and the
card's, field by field).

On a CPU of 2+ cores the device's lanes (1 and 2 batches side by side) are searched first, at the
card's limits, and the card's knobs then measured at the lanes kept. Lanes belong to the device,
not the model, so the overlay records them under `measured` and tune prints the `--lanes` to serve
with when they beat serve's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

from ..catalog import TUNED_DIR
from ..catalog.card import ROW_BLOCK_BYTES, Batching, Tuned, check_batching, load_tuned
from ..cpuinfo import usable_cores
from ..engine.threads import lane_threads
from ..errors import ConfigError
from . import workloads
from .knee import Bounds, within
from .load import HttpTarget
from .run import Plan, measure_and_close
from .targets import shoal_serve
from .tune_gate import QualityGate
from .tune_search import search

DEFAULT_VALUES = {
    "max_batch_tokens": (1024, 2048, 4096, 8192, 16384),
    "max_batch_items": (16, 32, 64, 128, 256),
    "batch_wait_ms": (0, 2, 5, 10),
    "threads": (),  # 1, cores / 2, cores: filled in for this machine
    "attention": ("padded", "each"),
    "row_block_bytes": (0, 1 << 20, 3 << 20, 8 << 20),  # CPU: the feed-forward's row blocks (layers/rows.py)
    "quantize": ("int8", "none"),
    "dtype": ("bfloat16", "float32"),  # CPU: bfloat16 where the CPU multiplies it natively (AMX, AVX512-BF16)
    "lanes": (),  # the device's lanes (engine/device.py): 1 and 2 on a CPU of 2+ cores, searched first
}
# Knobs that choose between CPU kernels: searched, and accepted, only for a CPU.
_CPU_KNOBS = ("attention", "row_block_bytes", "dtype")
# The knobs whose values are words, and the words each takes.
_CHOICES = {"attention": {"padded", "each"}, "quantize": {"int8", "none"}, "dtype": {"bfloat16", "float32"}}
# The knobs that change outputs: their candidates serve only past the quality gate (tune_gate.py).
_GATED = ("quantize", "dtype")
# Texts of the workload whose vectors the quality gate compares (the first ones, in call order).
GATE_TEXTS = 32


def overlay_name(model_id: str, hardware: str) -> str:
    slug = lambda text: re.sub(r"[^\w.-]+", "-", text).strip("-")  # noqa: E731
    return f"{slug(model_id.replace('/', '--'))}@{slug(hardware)}.yaml"


def write_overlay(directory: Path, tuned: Tuned) -> Path:
    folder = directory / TUNED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / overlay_name(tuned.model, tuned.hardware)
    data = msgspec.to_builtins(tuned)
    data["batching"] = {k: v for k, v in data["batching"].items() if v is not None}
    path.write_text(
        "# Written by `shoal tune`; `shoal serve --models-dir DIR` reads DIR/tuned/.\n"
        + yaml.safe_dump(data, sort_keys=False, width=110)
    )
    return path


async def _score_of(url: str, model_id: str, workload: workloads.Workload, plan: Plan) -> tuple[float, dict]:
    """(the best tokens/s among the levels within the bounds, what was measured): the best, not the
    knee, so two settings are compared on what each can do at all."""
    steps, found, _ = await measure_and_close(HttpTarget("shoal", url, model_id, workload), plan, log=lambda s: None)
    good = [s for s in steps if within(s, plan.bounds)]
    levels = [
        dict(clients=int(s.offered), tokens_per_s=round(s.tokens_per_s, 1), p99_ms=s.percentile_ms(99)) for s in steps
    ]
    if not good:
        return 0.0, dict(best_tokens_per_s=0.0, levels=levels)
    best = max(good, key=lambda s: s.tokens_per_s)
    return best.tokens_per_s, dict(
        best_tokens_per_s=round(best.tokens_per_s, 1),
        best_clients=int(best.offered),
        p99_ms=best.percentile_ms(99),
        knee_clients=int(found.offered) if found else None,
        levels=levels,
    )


class Lanes(msgspec.Struct, frozen=True):
    """The one device setting `shoal tune` searches (before the card's knobs, which it then
    measures at the lanes found): not the model's, so not in the overlay; `measured` records it."""

    lanes: int


def _grid(specs: list[str], cores: int, hardware: str) -> dict[str, tuple]:
    cpu = hardware.startswith("cpu")
    values = dict(
        DEFAULT_VALUES,
        threads=tuple(sorted({1, max(1, cores // 2), cores})),
        lanes=(1, 2) if cores >= 2 or not cpu else (),  # a GPU's lanes are streams (engine/streams.py)
    )
    for spec in specs:
        knob, _, listed = spec.partition("=")
        parsed: tuple[Any, ...]  # words, floats or ints, by knob
        try:
            parsed = tuple(
                v if knob in _CHOICES else float(v) if knob == "batch_wait_ms" else int(v)
                for v in listed.split(",")
                if v
            )
        except ValueError:
            parsed = ()
        if knob not in values or not parsed or not set(parsed) <= _CHOICES.get(knob, set(parsed)):
            raise ConfigError(
                f"--grid {spec!r}: write KNOB=V1,V2 with KNOB one of {', '.join(values)} "
                "(attention takes padded and each, quantize int8 and none, dtype bfloat16 and float32)"
            )
        if knob == "lanes":
            if min(parsed) < 1:
                raise ConfigError(f"--grid {spec}: lanes are 1 or more")
        else:
            for value in parsed:
                check_batching(hardware, Batching(**{knob: value}), f"--grid {spec}")
        values[knob] = parsed
    return values


def _distinct_threads(candidates: tuple, start: int | None, cores: int, lanes: int) -> tuple:
    """The `threads` values that give each lane a thread count that neither the start nor an
    earlier value gives (a lane runs on `threads // lanes`, unset: the cores): at two lanes on two
    cores, 1 and 2 are both a thread per lane, the same setting, and a trial of it only measures
    noise (and would write a core count into an overlay that other machines of the class read)."""
    per_lane = lambda threads: lane_threads(threads or cores, lanes)  # noqa: E731
    seen, kept = {per_lane(start)}, []
    for threads in candidates:
        if per_lane(threads) not in seen:
            seen.add(per_lane(threads))
            kept.append(threads)
    return tuple(kept)


def _gated_refusal(knob: str, card, hardware: str) -> str | None:
    """Why `knob` (quantize or dtype: the knobs behind the quality gate) cannot be tuned for `card`
    on `hardware`, or None when it can."""
    from ..engine.precision import native_bf16

    if not hardware.startswith("cpu"):
        return "int8 runs on CPUs only" if knob == "quantize" else "a GPU runs the card's dtype"
    if card.dtype != "float32":
        return (
            f"int8 runs with float32 activations and the card has dtype {card.dtype}"
            if knob == "quantize"
            else f"the card runs dtype {card.dtype} already"
        )
    if card.tasks[0] != "encode" or "dense" not in card.outputs:
        return "its quality gate compares dense vectors, and the card does not encode them by default"
    if knob == "dtype" and not native_bf16():
        return "this CPU has no native bf16 (AMX or AVX512-BF16): bfloat16 would run emulated, slower than float32"
    return None


def tune(args) -> int:
    from ..catalog import Catalog
    from ..config import Settings
    from ..engine.engine import device_lanes
    from ..engine.hardware import hardware_class

    user_dirs = tuple(Path(d) for d in args.models_dir or ())
    out = Path(args.out) if args.out else (user_dirs[0] if user_dirs else None)
    if out is None:
        raise ConfigError(
            "say where the tuned overlay goes: --out DIR or --models-dir DIR "
            "(`shoal serve --models-dir DIR` then reads DIR/tuned/)"
        )
    card = Catalog.load(user_dirs, strict=False).get(args.model)
    hardware = hardware_class(args.device)
    default_workload = {"encode": "passages", "score": "rerank", "extract": "extract"}[card.tasks[0]]
    shape = workloads.extract_shape(card)
    workload = workloads.build(args.workload or default_workload, seed=args.seed, items=args.items, extract=shape)
    plan = Plan(
        mode="closed",
        levels=tuple(args.clients),
        step_s=args.step_s,
        warmup_s=1.0,
        bounds=Bounds(p99_ms=args.p99_ms or workloads.DEFAULT_P99_MS[workload.name]),
        seed=args.seed,
    )
    cores = usable_cores()
    values = _grid(args.grid, cores, hardware)
    refusals = {knob: _gated_refusal(knob, card, hardware) for knob in _GATED}
    cpu = hardware.startswith("cpu")
    knobs = args.knobs or [
        k for k in values if refusals.get(k) is None and (k not in _CPU_KNOBS or cpu) and (k != "lanes" or values[k])
    ]
    for knob in knobs:
        if knob not in values:
            raise ConfigError(f"--knobs {knob}: use {', '.join(values)}")
    if "lanes" in knobs and not values["lanes"]:
        raise ConfigError(
            "--knobs lanes: a device runs more than one lane only on a CPU; on a CPU of one core "
            "give --grid lanes=1,2 to try two anyway"
        )
    # The lanes serve would run (SHOAL_DEVICE_LANES, which the servers started here inherit, else the
    # default): the card's knobs are measured at these unless the lanes search finds better.
    engine_settings = Settings.from_env().engine  # a SHOAL_* that does not parse: a ConfigError naming it
    lanes = Lanes(device_lanes(dataclasses.replace(engine_settings, device=args.device)))
    for knob, refusal in refusals.items():
        if knob in knobs and refusal:
            raise ConfigError(f"--knobs {knob}: {card.id} cannot be tuned for it here: {refusal}")
    cpu_only = [k for k in knobs if k in _CPU_KNOBS]
    if cpu_only and not cpu:
        raise ConfigError(f"--knobs {cpu_only[0]}: it chooses between CPU kernels; this device is not a CPU")
    # The card's own limits for this hardware (unset fields: the server's defaults) are the start;
    # the overlay written holds only what the search changed.
    start = card.batching_for(hardware)
    # The start names the card's own choices for the word knobs, so the search can tell them apart.
    if "quantize" in knobs:
        start = msgspec.structs.replace(start, quantize=card.quantize_for(hardware).quantize or "none")
    if "dtype" in knobs:  # float32 is the start, and the gate's reference, whatever serve would choose
        start = msgspec.structs.replace(start, dtype="float32")
    if "attention" in knobs:
        start = msgspec.structs.replace(start, attention=start.attention or "each")
    if "row_block_bytes" in knobs and start.row_block_bytes is None:  # the runner's default, named
        start = msgspec.structs.replace(start, row_block_bytes=ROW_BLOCK_BYTES)
    gate = None
    if any(k in knobs for k in _GATED):
        texts = list(dict.fromkeys(t for call in workload.calls for t in call.texts))[:GATE_TEXTS]
        gate = QualityGate(card.id, texts, start, args.min_cosine)
    trials: list[dict] = []
    print(
        f"shoal tune: {card.id} on {hardware}, workload {workload.name} ({workload.description}), "
        f"clients {list(plan.levels)}, {plan.step_s:g} s a level, p99 <= {plan.bounds.p99_ms:g} ms"
    )

    with tempfile.TemporaryDirectory() as tmp:

        def trial(batching: Batching) -> float:
            candidate = Tuned(card.id, hardware, batching)
            load_tuned(write_overlay(Path(tmp), candidate))  # valid (else CardError), and the last overlay read
            serve_args = [a for d in (*user_dirs, Path(tmp)) for a in ("--models-dir", str(d))]
            serve_args += ["--device", args.device, "--lanes", str(lanes.lanes)]
            settings = {k: v for k, v in msgspec.to_builtins(batching).items() if v is not None}
            quality: dict = {}
            measured: dict[str, Any]
            try:
                with shoal_serve(card.id, Path(tmp) / "serve.log", args=serve_args) as (url, _):
                    quality, refused = gate.check(url, batching) if gate else ({}, None)
                    if refused:
                        score, measured = 0.0, dict(best_tokens_per_s=0.0, error=refused)
                    else:
                        score, measured = asyncio.run(_score_of(url, card.id, workload, plan))
            except ConfigError as exc:  # this setting's server did not start (e.g. out of memory)
                score, measured = 0.0, dict(best_tokens_per_s=0.0, error=exc.message.splitlines()[0])
            trials.append(
                dict(settings=settings, lanes=lanes.lanes, **({"quality": quality} if quality else {}), **measured)
            )
            what = settings or "the card's limits"
            shown = f"{what} at {lanes.lanes} lane(s)"
            print(
                f"  {shown}: "
                + (
                    f"{score:,.0f} tokens/s at {measured['best_clients']} clients, p99 {measured['p99_ms']:.0f} ms"
                    if score
                    else measured.get("error", "no level within the bounds")
                )
            )
            return score

        serve_lanes = lanes
        lanes_found = None
        if "lanes" in knobs:  # first, at the card's limits; the card's knobs are then measured at the lanes kept

            def lanes_trial(candidate: Lanes) -> float:
                nonlocal lanes
                lanes = candidate
                return trial(start)

            lanes_found = search(
                lanes_trial,
                serve_lanes,
                values,
                ["lanes"],
                args.min_gain,
                args.confirm,
                start_name=f"serve's {serve_lanes.lanes} lane(s)",
            )
            lanes = lanes_found.best
        if "threads" in knobs:
            values["threads"] = _distinct_threads(values["threads"], start.threads, cores, lanes.lanes)
            if not values["threads"]:
                print(
                    f"  threads: every value gives each of the {lanes.lanes} lane(s) the threads the card's "
                    "limits give: not searched"
                )
        found = search(trial, start, values, [k for k in knobs if k != "lanes"], args.min_gain, args.confirm)
    if found.best_score <= 0:
        raise ConfigError(f"no setting met p99 <= {plan.bounds.p99_ms:g} ms: raise --p99-ms or lower --clients")
    current, best_score, baseline_score = found.best, found.best_score, found.start_score
    # What the search changed; a searched dtype always, for float32 kept is a finding too (serve
    # would otherwise run a card that lists bfloat16 in it).
    changed = Batching(
        **{
            f: getattr(current, f)
            for f in Batching.__struct_fields__
            if getattr(current, f) != getattr(start, f) or (f == "dtype" and "dtype" in knobs)
        }
    )
    measured = dict(
        date=time.strftime("%Y-%m-%d"),
        workload=workload.name,
        description=workload.description,
        mode="closed",
        clients=[int(c) for c in plan.levels],
        step_s=plan.step_s,
        p99_bound_ms=plan.bounds.p99_ms,
        cores=cores,
        lanes=lanes.lanes,
        serve_lanes=serve_lanes.lanes,
        **(
            dict(
                lanes_confirmed=lanes_found.confirmed,
                lanes_tokens_per_s=round(lanes_found.best_score, 1),
                serve_lanes_tokens_per_s=round(lanes_found.start_score, 1),
            )
            if lanes_found
            else {}
        ),
        best_tokens_per_s=round(best_score, 1),
        card_tokens_per_s=round(baseline_score, 1),
        gain=round(best_score / baseline_score, 3) if baseline_score else None,
        confirmed=found.confirmed,
        **({"min_cosine_bound": args.min_cosine} if any(k in knobs for k in _GATED) else {}),
        trials=trials,
    )
    path = write_overlay(out, Tuned(card.id, hardware, changed, measured))
    gain = f" ({best_score / baseline_score:.2f}x the card's limits)" if baseline_score else ""
    kept = {k: v for k, v in msgspec.to_builtins(changed).items() if v is not None} or "the card's limits, unchanged"
    print(f"best: {kept}: {best_score:,.0f} tokens/s{gain}\nwrote {path}")
    if lanes != serve_lanes:
        print(
            f"measured at {lanes.lanes} lane(s), which beat {serve_lanes.lanes}: serve with --lanes {lanes.lanes} "
            "(the device's setting, for every model on it; the overlay records it but cannot set it)"
        )
    return 0
