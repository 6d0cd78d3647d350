"""The coordinate search `shoal tune` runs: one knob at a time from a start, each candidate scored
by a trial (tokens/s, 0 for a failure), and a winner other than the start confirmed by alternating
turns before it is kept. It knows nothing of servers: the trial does the measuring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

_S = TypeVar("_S", bound=msgspec.Struct)  # what `search` searches: Batching, or Lanes


@dataclass
class Searched(Generic[_S]):
    """What `search` found: the settings kept, their score and the start's (means over the
    confirmation turns when there were any), and whether the confirmation held (None: none ran)."""

    best: _S
    best_score: float
    start_score: float
    confirmed: bool | None


def search(
    trial: Callable[[_S], float],
    start: _S,
    values: dict[str, tuple],
    knobs: list[str],
    min_gain: float,
    confirm: int,
    log: Callable[[str], None] = print,
    start_name: str = "the card's limits",
) -> Searched[_S]:
    """Coordinate search from `start`, one knob at a time over its `values`, scoring each candidate
    by `trial` (tokens/s, 0 for a failure); a value is kept when it beats the best so far by
    `min_gain`, and a candidate already scored keeps its score. A search over noisy single trials
    favours luck, so a winner other than `start` is confirmed: the two take turns `confirm` more
    times, and the winner stays only if its mean over those turns alone beats start's by
    `min_gain` (the search's own trials are left out: the winner's was picked for being high)."""
    current, best_score = start, trial(start)
    start_score = best_score
    scores = {start: best_score}  # a candidate met again (a knob's value back at the start's) is not re-run
    for knob in knobs:
        for value in values[knob]:
            if getattr(current, knob) == value:
                continue
            candidate = msgspec.structs.replace(current, **{knob: value})
            if candidate not in scores:
                scores[candidate] = trial(candidate)
            score = scores[candidate]
            if score > best_score * (1 + min_gain):
                current, best_score = candidate, score
    if current == start or confirm <= 0:
        return Searched(current, best_score, start_score, None)
    log(f"confirming: {start_name} and the best, {confirm} turns each")
    ours, theirs = [], []
    for _ in range(confirm):
        theirs.append(trial(start))
        ours.append(trial(current))
    mean_ours, mean_theirs = sum(ours) / confirm, sum(theirs) / confirm
    if mean_ours > mean_theirs * (1 + min_gain):
        return Searched(current, mean_ours, mean_theirs, True)
    log(f"  not confirmed ({mean_ours:,.0f} vs {mean_theirs:,.0f} tokens/s): {start_name} stay")
    return Searched(start, mean_theirs, mean_theirs, False)
