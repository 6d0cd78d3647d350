"""The plot of bench/cluster_sim.py's runs: `python bench/cluster_sim.py plot OUT.svg RUN.json ...`
(each RUN.json from `--out`): the knee's throughput against the fleet's peak as workers grow, one
line per design, and what is busy at each knee."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any


def knees(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """design -> its knee step per worker count (the passing step of the highest rate)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for path in paths:
        for step in json.loads(path.read_text()):
            key = (step["design"], step["workers"])
            if step["ok"] and (key not in best or step["rate"] > best[key]["rate"]):
                best[key] = step
    out: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for (design, _), step in sorted(best.items(), key=lambda kv: kv[0][1]):
        out[design].append(step)
    return out


def plot(out: Path, paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_design = knees(paths)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.1, 1]})
    peaks = sorted({(s["workers"], s["peak_req_s"]) for steps in by_design.values() for s in steps})
    left.plot([w for w, _ in peaks], [pk for _, pk in peaks], "k--", lw=1, label="the fleet's peak (full batches)")
    for design, steps in by_design.items():
        left.plot([s["workers"] for s in steps], [s["achieved"] for s in steps], "o-", label=design)
    left.set(xscale="log", yscale="log", xlabel="workers", ylabel="req/s at the knee", title="throughput at the knee")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    labels, rows = [], []
    for design, steps in by_design.items():
        for s in steps:
            labels.append(f"{s['workers']}w\n{design.replace(', ', chr(10))}")
            rows.append(
                [
                    s["busy"],
                    s["gateway_busy"],
                    s["stream_busy"],
                    s["consumer_calls_busy"],
                    s["consumer_busy"],
                    s.get("api_busy", 0.0),
                ]
            )
    names = ["devices", "busiest gateway", "busiest stream", "busiest consumer: calls", "... and 409s", "JetStream API"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        right.bar([x + i * width for x in range(len(rows))], [min(1.2, r[i]) for r in rows], width, label=name)
    right.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=6)
    right.axhline(1.0, color="k", lw=0.8)
    right.set(ylabel="busy share at the knee (work given / time)", title="what is busy at the knee", ylim=(0, 1.25))
    right.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str]) -> int:
    plot(Path(argv[0]), [Path(a) for a in argv[1:]])
    return 0
