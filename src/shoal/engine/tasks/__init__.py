"""Verbs are tasks: each turns its call into sequences to run and their outputs into its result.

    plan(card, call)                  validate against the card; what to preprocess; estimated tokens
    tokenize(plan, model, pool)       -> sequences (Encoded), one per device item; `model` is the
                                      backend's torch-free ModelInfo
    specs(plan, seqs)                 one head spec per sequence
    check_size(plan, seqs, limit)     refuse before compute a result larger than the limit
    collect_off_loop(plan, outputs)   whether collecting is heavy enough for a worker thread
    collect(plan, seqs, outputs, timings) -> the verb's Result

Which task serves a call is the verb registry's (shoal/verbs.py): one entry per verb or extract
kind names its task here. The engine does everything the verbs share (admission, deadlines, the
cache, the device).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Protocol

from ...calls import AnyCall, AnyResult
from ...catalog import ModelCard
from ...verbs import KINDS, kind_of
from ..backend import ModelInfo
from ..tokenizer_pool import TokenizerPool
from ..types import Encoded, PhaseSeconds, Spec


class Task(Protocol):
    verb: str

    # The plan is each task's own dataclass; it carries `estimated_tokens` and `num_items`.
    def plan(self, card: ModelCard, call: Any) -> Any: ...

    async def tokenize(self, plan: Any, model: ModelInfo, pool: TokenizerPool) -> list[Encoded]: ...

    def specs(self, plan: Any, seqs: list[Encoded]) -> list[Spec]: ...

    def check_size(self, plan: Any, seqs: list[Encoded], max_result_bytes: int) -> None: ...

    def collect_off_loop(self, plan: Any, outputs: list) -> bool: ...

    def collect(self, plan: Any, seqs: list[Encoded], outputs: list, timings: PhaseSeconds) -> AnyResult: ...


@functools.cache
def task_of_kind(name: str) -> Task:
    """The task of a registry entry (one instance per process)."""
    module, cls = KINDS[name].task.split(":")
    task: Task = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return task


def task_for(call: AnyCall, card: ModelCard) -> Task:
    """The task that serves `call` on `card`; InvalidRequest if the card does not serve its verb."""
    return task_of_kind(kind_of(call, card).name)


__all__ = ["Task", "task_for", "task_of_kind"]
