"""Verbs are tasks: each turns its call into sequences to run and their outputs into its result.

    plan(card, call)            validate against the card; what to tokenize; estimated tokens
    tokenize(plan, runner, pool) -> sequences (Encoded), one per device item
    specs(plan, seqs)           one head spec per sequence
    check_size(plan, seqs, limit)  refuse before compute a result larger than the limit
    collect_off_loop(plan, outputs) whether collecting is heavy enough for a worker thread
    collect(plan, seqs, outputs, timings) -> the verb's Result

The engine does everything the verbs share (admission, deadlines, the cache, the device).
"""

from __future__ import annotations

from typing import Any, Protocol

from ...calls import EncodeCall, ExtractCall, ScoreCall
from .encode import EncodeTask
from .extract import ExtractTask
from .score import ScoreTask


class Task(Protocol):
    verb: str

    def plan(self, card: Any, call: Any) -> Any: ...

    async def tokenize(self, plan: Any, runner: Any, pool: Any) -> list: ...

    def specs(self, plan: Any, seqs: list) -> list: ...

    def check_size(self, plan: Any, seqs: list, max_result_bytes: int) -> None: ...

    def collect_off_loop(self, plan: Any, outputs: list) -> bool: ...

    def collect(self, plan: Any, seqs: list, outputs: list, timings: dict[str, float]) -> Any: ...


TASKS: dict[type, Task] = {EncodeCall: EncodeTask(), ScoreCall: ScoreTask(), ExtractCall: ExtractTask()}

__all__ = ["TASKS", "Task", "EncodeTask", "ExtractTask", "ScoreTask"]
