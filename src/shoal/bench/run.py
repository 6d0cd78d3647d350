"""`shoal bench`: ramp the load on a server, find its knee, and put it next to what users run today.

One run measures, one after the other on the same machine and the same calls: shoal (a spawned
`shoal serve`, or `--url`), optionally Infinity (`--against infinity`, spawned from its own
virtualenv) and sentence-transformers in this process (`--against st`) on texts, or transformers'
CLIPModel in this process (`--against transformers`, its outputs checked equal to shoal's first) on
images, plus the machine's fp32 GEMM peak; it prints every level, each knee and the ratios, and
writes JSON and a PNG.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, ModelLoadError
from . import machine, report, workloads
from .knee import CLOSED_CLIENTS, OPEN_SHARES, Bounds, knee, probe, ramp
from .load import HttpTarget, Step, closed_loop
from .runtimes import RUNTIMES

if TYPE_CHECKING:
    from ..catalog.card import ModelCard
    from .targets import InProcess


@dataclass
class Plan:
    """How to ramp one target."""

    mode: str = "open"  # open | closed
    levels: tuple[float, ...] = ()  # rates (open) or clients (closed); () from a probe / the default
    step_s: float = 10.0
    probe_clients: int = 8
    probe_s: float = 5.0
    warmup_s: float = 2.0
    bounds: Bounds = Bounds()
    seed: int = 0


async def measure(target, plan: Plan, log=print) -> tuple[list[Step], Step | None, float | None]:
    """(steps, knee, probed capacity req/s) of one target."""
    await closed_loop(target, min(4, plan.probe_clients), plan.warmup_s, first=10**7)  # warm-up, not counted
    capacity = None
    levels = list(plan.levels)
    if plan.mode == "open" and not levels:
        capacity = await probe(target, plan.probe_clients, plan.probe_s)
        if capacity <= 0:
            raise ConfigError(f"{target.name}: no request succeeded in the probe (is the model served?)")
        levels = [float(f"{capacity * share:.3g}") for share in OPEN_SHARES]
    elif not levels:
        levels = list(CLOSED_CLIENTS)

    def show(step: Step) -> None:
        log(report.row(target.name, step))

    steps = await ramp(target, plan.mode, levels, plan.step_s, plan.bounds, seed=plan.seed, log=show)
    return steps, knee(steps, plan.bounds), capacity


async def measure_and_close(target, plan: Plan, log=print) -> tuple[list[Step], Step | None, float | None]:
    try:
        return await measure(target, plan, log)
    finally:
        await target.aclose()


def call_tokens(
    model_dir: Path | None, max_length: int, workload: workloads.Workload
) -> tuple[list[int] | None, list[int]]:
    """(tokens per call, tokens per sequence) with the model's tokenizer.json (special tokens in,
    truncated at the card's max_length); (None, []) when the folder has none."""
    path = model_dir / "tokenizer.json" if model_dir else None
    if path is None or not path.is_file():
        return None, []
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()  # some folders ship tokenizer.json with padding to max_length on
    per_call, lengths = [], []
    for call in workload.calls:
        if call.query is not None:
            encoded = tokenizer.encode_batch([(call.query, text) for text in call.texts])
        else:
            encoded = tokenizer.encode_batch(list(call.texts))
        seqs = [len(e.ids) for e in encoded]
        per_call.append(sum(seqs))
        lengths += seqs
    return per_call, lengths


def _knee_line(name: str, found: Step | None, bound_ms: float, noun: str) -> str:
    if found is None:
        return f"knee {name}: none (no level had p99 <= {bound_ms:g} ms with the rate followed)"
    offered = f"offered {found.offered:g} req/s" if found.mode == "open" else f"{int(found.offered)} clients"
    return (
        f"knee {name}: {found.achieved_rps:.1f} req/s, {found.items_per_s:,.1f} {noun}/s, "
        f"{found.tokens_per_s:,.0f} tokens/s ({offered}; "
        f"p50 {found.percentile_ms(50):.1f} ms, p99 {found.percentile_ms(99):.1f} ms)"
    )


@dataclass(frozen=True)
class Cost:
    """Forward FLOPs per unit of the work a workload sends: a token of text, or an image."""

    unit: str  # token | image
    flops: float
    detail: dict  # how it was counted (JSON fields)
    note: str  # the same, printed

    def rate(self, step: Step) -> float:
        """The step's units per second."""
        return step.tokens_per_s if self.unit == "token" else step.items_per_s


def cost_of(card: ModelCard, model_dir: Path | None, workload: workloads.Workload, lengths: list[int]) -> Cost | None:
    """FLOPs per token (text: the model's config.json, the workload's sequence lengths) or per image
    (the vision_config of its config.json, the card's image_tokens); None without a local folder.
    Raises OSError, KeyError or ValueError for a config.json it cannot read the shapes from."""
    if model_dir is None or card.architecture is None:
        return None
    if workload.modality == "image":
        tokens = card.image_tokens
        assert tokens is not None  # a card that reads images says what one costs
        note = f"{tokens} tokens an image"
        return Cost("image", machine.vision_flops_per_image(model_dir, tokens), {"tokens_per_image": tokens}, note)
    if not lengths:
        return None
    seq = machine.effective_seq_len(lengths)
    per_token = machine.shape_of(model_dir, card.architecture).flops_per_token(seq)
    return Cost("token", per_token, {"effective_seq_len": round(seq, 1)}, f"effective sequence {seq:.0f} tokens")


def _figure(base: InProcess) -> dict:
    """An in-process baseline's figure, as the JSON records it."""
    record: dict[str, object] = dict(
        calls=base.calls,
        items=base.items,
        tokens=base.tokens,
        wall_s=round(base.wall_s, 3),
        tokens_per_s=round(base.tokens_per_s, 1),
        items_per_s=round(base.items_per_s, 1),
    )
    if base.batch_size is not None:
        by_size = {size: round(rate, 2) for size, rate in base.items_per_s_by_batch_size.items()}
        record.update(batch_size=base.batch_size, items_per_s_by_batch_size=by_size)
    return record


# `--against shoal-float32`: the same model on a second server with reduced precision off.
FLOAT32 = "shoal-float32"


def run(args) -> int:
    from ..catalog import Catalog, resolve_weights

    catalog = Catalog.load(tuple(Path(d) for d in args.models_dir or ()), strict=False)
    card = catalog.get(args.model)
    if args.workload == "chat":  # generation: tokens/s and time to first token at fixed concurrency
        from .generation import run_chat

        return run_chat(args, card)
    # The workload's calls follow the card: an extract call's shape (labels, a schema, photos) is its kind's.
    workload = workloads.build(args.workload, seed=args.seed, items=args.items, extract=workloads.extract_shape(card))
    modality = workload.modality
    against = [a for spec in args.against or [] for a in spec.split(",") if a]
    for name in against:
        if name not in workloads.BASELINES[modality]:
            raise ConfigError(
                f"--against {name}: workload {args.workload} ({modality}) is compared with "
                f"{' and/or '.join(workloads.BASELINES[modality])}"
            )
    if "infinity" in against and not args.infinity:
        raise ConfigError("--against infinity needs --infinity PATH (the infinity_emb script of its virtualenv)")
    verb = workloads.VERBS[args.workload]
    if verb not in card.tasks:
        raise ConfigError(f"{card.id} serves {', '.join(sorted(card.tasks))}; workload {args.workload} needs {verb}")
    if modality not in card.modalities:
        raise ConfigError(
            f"{card.id} reads {', '.join(card.modalities)}; workload {args.workload} sends {modality}s "
            "(a card with `modalities: [text, image]` reads both)"
        )
    if args.mode == "closed" and any(level != int(level) for level in args.levels or ()):
        raise ConfigError(f"--levels {args.levels}: closed-loop levels are client counts (whole numbers)")
    if against and verb != "encode" and not (verb == "score" and set(against) <= {*RUNTIMES, FLOAT32}):
        raise ConfigError(
            f"--against {','.join(against)}: workload {args.workload} is {verb}; only the CPU runtimes "
            f"({','.join(RUNTIMES)}) and {FLOAT32} score pairs, the other baselines embed"
        )
    try:
        model_dir = resolve_weights(card, allow_download=False)
    except ModelLoadError:
        model_dir = None  # a remote model: no local tokenizer, FLOPs or baseline
    if against and model_dir is None:
        raise ConfigError(f"--against {','.join(against)} needs the model's local folder (the baseline loads it)")
    # Texts only: an image's tokens are the card's image_tokens, which shoal's usage counts.
    per_call, lengths = call_tokens(model_dir, card.max_length, workload) if modality == "text" else (None, [])
    if against and modality == "text" and per_call is None:
        raise ConfigError(
            f"--against {','.join(against)} needs the model's local folder with its tokenizer.json "
            "(tokens are counted with it for the baselines)"
        )
    try:
        cost, no_cost = cost_of(card, model_dir, workload, lengths), None
    except (OSError, KeyError, ValueError) as exc:  # a folder without a usable config.json
        cost, no_cost = None, f"no FLOPs/{'image' if modality == 'image' else 'token'}: {exc}"
    bounds = Bounds(p99_ms=args.p99_ms or workloads.DEFAULT_P99_MS[workload.name])
    plan = Plan(
        mode=args.mode,
        levels=tuple(args.levels or ()),
        step_s=args.step_s,
        probe_clients=args.probe_clients or (32 if workload.items_per_call <= 2 else 4),
        bounds=bounds,
        seed=args.seed,
    )
    load0 = machine.load_average()
    # The GEMM peak is probed before the load and again after it, and the better probe counts: on a
    # shared host one slow probe would lower the bound and flatter shoal's share of it.
    probes = [_gemm_probe()] if cost else []
    print(f"shoal bench: {card.id}, workload {workload.name} ({workload.description}), {plan.mode} loop")
    if load0:
        print(
            f"machine: load avg {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start; "
            "client and servers share this machine"
        )
    print(report.HEADER)
    results: dict[str, dict] = {}
    ramps: dict[str, tuple[list[Step], Step | None]] = {}
    served: list = []  # shoal's vectors (or raw scores) for the first call, for a baseline to equal
    # What each shoal target's model computes in, as /v1/models says (float32, bfloat16, int8, int4).
    precisions: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        targets = ["shoal"] + [FLOAT32] * (FLOAT32 in against) + ["infinity"] * ("infinity" in against)
        for name in targets:
            with ExitStack() as stack:
                if name == "shoal" and args.url:
                    url = args.url
                elif name in ("shoal", FLOAT32):
                    from .targets import shoal_serve

                    serve_args = [a for d in args.models_dir or () for a in ("--models-dir", d)]
                    env = {"SHOAL_REDUCED_PRECISION": "false"} if name == FLOAT32 else None
                    url, _ = stack.enter_context(
                        shoal_serve(card.id, Path(tmp) / f"{name}.log", args=serve_args, env=env)
                    )
                else:
                    from .targets import infinity_serve

                    assert model_dir is not None  # --against needs the local folder (checked above)
                    url, _ = stack.enter_context(
                        infinity_serve(
                            args.infinity, model_dir, Path(tmp) / "infinity.log", batch_size=args.infinity_batch_size
                        )
                    )
                if name in ("shoal", FLOAT32):
                    from .targets import served_precision

                    precisions[name] = served_precision(url, card.id, args.api_key if name == "shoal" else None)
                    print(f"{name} serves {card.id} in {precisions[name] or 'an unreported precision'}")
                # The runtimes are checked against shoal's float32 vectors where the run has them.
                reference = FLOAT32 if FLOAT32 in against else "shoal"
                if name == reference and any(a in against for a in ("transformers", *RUNTIMES)):
                    from .targets import served_scores, served_vectors

                    fetch = served_scores if verb == "score" else served_vectors
                    token = args.api_key if name == "shoal" else None
                    served = fetch(url, card.id, workload.calls[0], token=token)
                target = (
                    HttpTarget(
                        name,
                        url,
                        card.id,
                        workload,
                        msgpack=args.msgpack,
                        token=args.api_key if name == "shoal" else None,
                    )
                    if name in ("shoal", FLOAT32)
                    else HttpTarget(
                        name, url, "model", workload, wire="openai", openai_path="/embeddings", call_tokens=per_call
                    )
                )
                steps, found, capacity = asyncio.run(measure_and_close(target, plan))
            ramps[name] = (steps, found)
            results[name] = dict(
                url=url, probe_rps=capacity, steps=[s.summary() for s in steps], knee=found.summary() if found else None
            )
    noun = workload.item_noun
    lines = [_knee_line(name, found, bounds.p99_ms, noun) for name, (_, found) in ramps.items()]
    ratios: dict[str, float] = {}
    shoal_knee = ramps["shoal"][1]
    precision = precisions.get("shoal")
    float32_knee = ramps.get(FLOAT32, (None, None))[1]
    if shoal_knee and float32_knee:
        ratios["shoal_over_float32_tokens"] = shoal_knee.tokens_per_s / float32_knee.tokens_per_s
        lines.append(
            f"shoal ({precision}) / shoal float32 at the knee: {ratios['shoal_over_float32_tokens']:.2f}x tokens/s"
        )
    inf_knee = ramps.get("infinity", (None, None))[1]
    if shoal_knee and inf_knee:
        ratios["shoal_over_infinity_rps"] = shoal_knee.achieved_rps / inf_knee.achieved_rps
        lines.append(f"shoal / infinity at the knee: {ratios['shoal_over_infinity_rps']:.2f}x req/s")
    baseline, equality, refused = None, None, False
    if "st" in against:
        from .targets import sentence_transformers_baseline

        assert model_dir is not None  # --against needs the local folder (checked above)
        base = sentence_transformers_baseline(model_dir, workload, duration_s=args.step_s)
        baseline = _figure(base)
        lines.append(
            f"sentence-transformers in-process (one encode per call): {base.tokens_per_s:,.0f} tokens/s, "
            f"{base.items_per_s:.1f} texts/s"
        )
        if shoal_knee:
            ratios["shoal_over_st_tokens"] = shoal_knee.tokens_per_s / base.tokens_per_s
            lines.append(f"shoal knee / sentence-transformers: {ratios['shoal_over_st_tokens']:.2f}x tokens/s")
    if "transformers" in against:
        from .targets import MIN_COSINE, TRANSFORMERS_BATCH_SIZES, transformers_clip_baseline

        assert model_dir is not None and card.image_tokens is not None  # checked above
        cosine, clip = transformers_clip_baseline(
            model_dir, workload, duration_s=args.step_s, served=served, tokens_per_image=card.image_tokens
        )
        equality = dict(min_cosine=round(cosine, 6), bar=MIN_COSINE, images=len(served))
        lines.append(f"equality: min cosine of transformers' vectors to shoal's over {len(served)} images {cosine:.6f}")
        if clip is None:
            refused = True
            lines.append(f"outputs differ (min cosine {cosine:.6f} < {MIN_COSINE}): no transformers figure, no ratio")
        else:
            baseline = _figure(clip)
            tried = ", ".join(f"b{b} {rate:.1f}" for b, rate in clip.items_per_s_by_batch_size.items())
            lines.append(
                f"transformers CLIPModel in-process (best of batch {', '.join(map(str, TRANSFORMERS_BATCH_SIZES))}): "
                f"{clip.items_per_s:.1f} images/s at batch {clip.batch_size} ({tried})"
            )
            if shoal_knee:
                ratios["shoal_over_transformers_images"] = shoal_knee.items_per_s / clip.items_per_s
                lines.append(f"shoal knee / transformers: {ratios['shoal_over_transformers_images']:.2f}x images/s")
    runtimes: dict[str, dict] = {}
    names = [a for a in against if a in RUNTIMES]
    if names:
        assert model_dir is not None  # --against needs the local folder (checked above)
        refused = (
            _runtimes(
                names,
                model_dir,
                workload,
                card.max_length,
                args.step_s,
                served,
                {"shoal": shoal_knee, FLOAT32: float32_knee},
                lines,
                ratios,
                runtimes,
            )
            or refused
        )
    per_core = _per_core(ramps, precisions, baseline if "st" in against else None, runtimes, lines)
    flops = None
    if no_cost:
        lines.append(no_cost)
    if cost and probes:
        probes.append(_gemm_probe())
        peak, threads = max(probes, key=lambda probe: probe[0] or 0.0)
        if peak:
            unit = cost.unit
            bound = peak / cost.flops
            flops = {
                f"flops_per_{unit}": cost.flops,
                **cost.detail,
                "fp32_gemm_peak_flops": peak,
                "fp32_gemm_probes_flops": [probe[0] for probe in probes],
                "torch_threads": threads,
                f"bound_{unit}s_per_s": round(bound, 1),
            }
            probed = " and ".join(f"{(probe[0] or 0) / 1e9:.0f}" for probe in probes)
            per_unit = f"{cost.flops / 1e9:,.2f} G" if cost.flops >= 1e9 else f"{cost.flops / 1e6:,.1f} M"
            rate = f"{bound:,.0f}" if bound >= 100 else f"{bound:.1f}"
            lines.append(
                f"FLOPs/{unit} {per_unit} ({cost.note}); fp32 GEMM peak "
                f"{peak / 1e9:.0f} GFLOP/s ({threads} threads; probed {probed} before and after the load): "
                f"bound {rate} {unit}s/s"
            )
            if shoal_knee:
                ratios["shoal_share_of_bound"] = cost.rate(shoal_knee) / bound
                lines.append(f"shoal knee at {100 * ratios['shoal_share_of_bound']:.0f} % of the fp32-peak bound")
    print("\n".join(lines))
    record = dict(
        command=" ".join(sys.argv),
        model=card.id,
        workload=workload.name,
        description=workload.description,
        mode=plan.mode,
        bounds=asdict(bounds),
        load_avg_at_start=load0,
        date=time.strftime("%Y-%m-%dT%H:%M:%S"),
        targets=results,
        precision=precision,
        precisions=precisions,
        per_core_tokens=per_core,
        baseline=baseline,
        equality=equality,
        runtimes=runtimes or None,
        flops=flops,
        ratios={k: round(v, 4) for k, v in ratios.items()},
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.png:
        why = report.plot(Path(args.png), ramps, f"{card.id}: {workload.description}", bounds.p99_ms)
        print(why or f"wrote {args.png}")
    return 0 if shoal_knee and not refused else 1


def _runtimes(names, model_dir, workload, max_length, duration_s, served, knees, lines, ratios, out) -> bool:
    """ONNX Runtime and OpenVINO in this process (bench/runtimes.py) on the workload's texts, each
    checked equal to shoal's first call before its figure counts; True if one was refused. `knees`:
    each shoal target's knee (None: not measured), which the runtimes' figures are set beside."""
    import torch

    from .runtimes import BATCH_SIZES, export_onnx, runtime_baseline

    refused = False
    with tempfile.TemporaryDirectory() as work:
        export = export_onnx(model_dir, Path(work), scores=workload.verb == "score")
        # How far a runtime's outputs are from shoal's first call's: vectors by cosine, scores by difference.
        what = "max |score diff| / spread" if export.scores else "min cosine"
        for name in names:
            cosine, figure = runtime_baseline(
                name,
                export,
                model_dir,
                Path(work),
                workload,
                duration_s=duration_s,
                served=served,
                max_length=max_length,
                threads=torch.get_num_threads(),
            )
            key = "max_score_diff_over_spread" if export.scores else "min_cosine"
            out[name] = {key: round(cosine, 6), "figure": _figure(figure) if figure else None}
            if figure is None:
                refused = True
                lines.append(f"{name}: outputs differ from shoal's ({what} {cosine:.6f}): no figure, no ratio")
                continue
            tried = ", ".join(f"b{b} {rate:.1f}" for b, rate in figure.items_per_s_by_batch_size.items())
            lines.append(
                f"{name} in-process (length-sorted, best of batch {', '.join(map(str, BATCH_SIZES))}; {what} "
                f"to shoal {cosine:.6f}): {figure.tokens_per_s:,.0f} tokens/s, {figure.items_per_s:.1f} texts/s "
                f"at batch {figure.batch_size} ({tried})"
            )
            for target, found in knees.items():
                if found:
                    key = f"{target.replace('-', '_')}_over_{name.replace('-', '_')}_tokens"
                    ratios[key] = found.tokens_per_s / figure.tokens_per_s
                    lines.append(f"{target} knee / {name}: {ratios[key]:.2f}x tokens/s")
    return refused


def _per_core(ramps, precisions, baseline, runtimes, lines) -> dict[str, float]:
    """Every figure of the run in tokens/s per usable core, one line each, shoal's knees first: the
    one-run table (docs/benchmarks.md). The runtimes and sentence-transformers run in process, shoal
    over HTTP with its client on the same cores."""
    from ..cpuinfo import usable_cores

    cores = usable_cores()
    rows: dict[str, tuple[float, str]] = {}
    for name, (_, found) in ramps.items():
        if found and name != "infinity":
            rows[name] = (found.tokens_per_s, f"{precisions.get(name) or '?'}, over HTTP")
    if baseline:
        rows["sentence-transformers"] = (baseline["tokens_per_s"], "in process")
    for name, measured in runtimes.items():
        if measured["figure"]:
            rows[name] = (measured["figure"]["tokens_per_s"], "in process")
    if not rows:
        return {}
    lines.append(f"the run, tokens/s and per core ({cores} usable):")
    for name, (tokens, how) in rows.items():
        lines.append(f"  {name:22s} {tokens:10,.0f}  {tokens / cores:9,.0f} per core  ({how})")
    return {name: round(tokens / cores, 1) for name, (tokens, _) in rows.items()}


def _gemm_probe() -> tuple[float | None, int | None]:
    """(FLOP/s, threads) of one fp32 GEMM-peak probe; (None, None) without torch."""
    try:
        return machine.fp32_gemm_peak()
    except ImportError:
        return None, None
