"""What `shoal bench` prints and writes: a table per ramp, JSON of every step, a PNG plot."""

from __future__ import annotations

from pathlib import Path

from .load import Step

HEADER = (
    f"{'target':>16} {'mode':>6} {'offered':>8} {'req/s':>8} {'items/s':>8} {'tokens/s':>9} "
    f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'cpu cli':>7}"
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def row(target: str, step: Step, mark: str = "") -> str:
    offered = f"{step.offered:.1f}" if step.mode == "open" else f"{int(step.offered)} cl"
    errors = step.errors + step.dropped
    cpu = step.client_cpu_s / step.duration_s if step.duration_s else 0.0
    return (
        f"{target:>16} {step.mode:>6} {offered:>8} {step.achieved_rps:>8.1f} {step.items_per_s:>8.1f} "
        f"{step.tokens_per_s:>9.0f} {_ms(step.percentile_ms(50)):>8} {_ms(step.percentile_ms(99)):>8} "
        f"{errors:>7} {cpu:>7.2f}{mark}"
    )


def plot(path: Path, ramps: dict[str, tuple[list[Step], Step | None]], title: str, p99_bound_ms: float) -> str | None:
    """Throughput and p50/p99 against offered load, one colour per target, knees marked; returns
    why no plot was written (matplotlib missing), else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'shoal[bench]')"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    mode = "open"
    for i, (name, (steps, knee)) in enumerate(ramps.items()):
        colour = f"C{i}"
        mode = steps[0].mode if steps else mode
        xs = [s.offered for s in steps]
        top.plot(xs, [s.achieved_rps for s in steps], "o-", color=colour, label=name)
        bottom.plot(xs, [s.percentile_ms(50) or float("nan") for s in steps], "o--", color=colour, label=f"{name} p50")
        bottom.plot(xs, [s.percentile_ms(99) or float("nan") for s in steps], "s-", color=colour, label=f"{name} p99")
        if knee is not None:
            for axis in (top, bottom):
                axis.axvline(knee.offered, color=colour, linestyle=":", linewidth=1)
            top.annotate(
                f"knee {knee.achieved_rps:.1f} req/s",
                (knee.offered, knee.achieved_rps),
                textcoords="offset points",
                xytext=(5, -12),
                color=colour,
                fontsize=8,
            )
    if mode == "open":
        edge = max((s.offered for steps, _ in ramps.values() for s in steps), default=1.0)
        top.plot([0, edge], [0, edge], color="grey", linewidth=0.8, label="offered")
    bottom.axhline(p99_bound_ms, color="red", linewidth=0.8, label=f"p99 bound {p99_bound_ms:g} ms")
    top.set_ylim(bottom=0)
    if mode == "closed":
        bottom.set_xscale("log", base=2)
    top.set_ylabel("achieved req/s")
    bottom.set_ylabel("latency ms")
    bottom.set_yscale("log")
    bottom.set_xlabel("offered req/s (open loop)" if mode == "open" else "clients (closed loop)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
