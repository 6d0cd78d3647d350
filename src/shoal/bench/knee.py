"""Ramps and the knee.

The knee is the highest load a target serves well: for an open-loop ramp, the highest offered rate
whose p99 stays within the bound, whose errors stay under `max_error_share`, and whose arrivals
were answered (>= `follow` of them: a target that falls behind leaves a backlog, which the p99
bound and the drain limit catch); for a closed-loop ramp (N clients), the
fewest clients that reach `plateau` x the best throughput among the levels within the bounds (more
clients past it only add latency).
"""

from __future__ import annotations

from dataclasses import dataclass

from .load import Step, closed_loop, open_loop


@dataclass(frozen=True)
class Bounds:
    p99_ms: float = 1000.0
    max_error_share: float = 0.01
    follow: float = 0.9  # open loop: answered / arrived at least this (within the step and its drain)
    plateau: float = 0.95  # closed loop: this share of the best throughput counts as reached


def within(step: Step, bounds: Bounds) -> bool:
    p99 = step.percentile_ms(99)
    if p99 is None or p99 > bounds.p99_ms or step.error_share > bounds.max_error_share:
        return False
    # Open loop: the arrivals that came were answered (a backlog past the drain is not), and they came
    # at about the rate offered (the load generator kept up).
    arrived = step.sent + step.dropped
    return step.mode == "closed" or (step.ok >= bounds.follow * arrived and step.arrival_rps >= 0.8 * step.offered)


def knee(steps: list[Step], bounds: Bounds) -> Step | None:
    """The knee of a ramp (None: no level met the bounds)."""
    good = [s for s in steps if within(s, bounds)]
    if not good:
        return None
    if steps[0].mode == "open":
        return max(good, key=lambda s: s.offered)
    best = max(s.achieved_rps for s in good)
    return min((s for s in good if s.achieved_rps >= bounds.plateau * best), key=lambda s: s.offered)


# Open-loop levels as shares of the capacity a short closed-loop probe measured.
OPEN_SHARES = (0.25, 0.5, 0.7, 0.85, 1.0, 1.1, 1.25, 1.5)
CLOSED_CLIENTS = (1, 2, 4, 8, 16, 32, 64)


async def probe(target, clients: int, duration_s: float) -> float:
    """Requests/s with `clients` clients: where an open-loop ramp centres its levels."""
    step = await closed_loop(target, clients, duration_s, first=10**8)
    return step.achieved_rps


async def ramp(
    target,
    mode: str,
    levels: list[float],
    step_s: float,
    bounds: Bounds,
    *,
    seed: int = 0,
    log=None,
    stop_after_misses: int = 2,
) -> list[Step]:
    """Each level in turn; stops after `stop_after_misses` levels in a row past the bounds (past the
    knee nothing more is learned, and an overloaded target would only queue more)."""
    steps, misses, first = [], 0, 0
    for i, level in enumerate(levels):
        if mode == "open":
            step = await open_loop(target, level, step_s, seed=seed + i, first=first)
        else:
            step = await closed_loop(target, int(level), step_s, first=first)
        first += step.sent
        steps.append(step)
        if log:
            log(step)
        misses = 0 if within(step, bounds) else misses + 1
        if misses >= stop_after_misses:
            break
    return steps
