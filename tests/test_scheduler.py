"""The token-budget scheduler: pure bookkeeping, so plain dataclass items stand in for requests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shoal.engine.scheduler import BatchLimits, Scheduler

_seq = itertools.count()


@dataclass(eq=False)
class Item:
    model_id: str
    num_tokens: int
    cancelled: bool = False
    seq: int = field(default_factory=lambda: next(_seq))


def scheduler(max_batch_tokens: int = 100, max_batch_items: int = 100, **per_model: BatchLimits) -> Scheduler:
    default = BatchLimits(max_batch_tokens, max_batch_items)
    return Scheduler(lambda model_id: per_model.get(model_id, default))


def drain(s: Scheduler) -> list[list[Item]]:
    batches = []
    while batch := s.next_batch():
        batches.append(batch)
    return batches


def test_batches_are_cut_by_the_sum_of_real_tokens_under_max_batch_tokens():
    s = scheduler(max_batch_tokens=100)
    items = [Item("m", n) for n in (40, 30, 20, 50, 10, 45, 60)]
    s.add(items)
    batches = drain(s)
    # 40+30+20 = 90 (adding 50 would be 140); 50+10 = 60 (adding 45 would be 105); 45; 60.
    assert [[i.num_tokens for i in b] for b in batches] == [[40, 30, 20], [50, 10], [45], [60]]
    assert all(sum(i.num_tokens for i in b) <= 100 for b in batches)
    assert [i for b in batches for i in b] == items  # nothing lost, nothing reordered


def test_a_batch_fills_the_token_budget_exactly():
    s = scheduler(max_batch_tokens=100)
    s.add([Item("m", 60), Item("m", 40), Item("m", 1)])
    assert [i.num_tokens for i in s.next_batch()] == [60, 40]


def test_max_batch_items_caps_a_batch_even_when_tokens_fit():
    s = scheduler(max_batch_tokens=10_000, max_batch_items=3)
    items = [Item("m", 5) for _ in range(8)]
    s.add(items)
    batches = drain(s)
    assert [len(b) for b in batches] == [3, 3, 2]
    assert [i for b in batches for i in b] == items


def test_the_item_that_overflows_stays_first_for_the_next_batch():
    s = scheduler(max_batch_tokens=100)
    first, overflow, later = Item("m", 70), Item("m", 50), Item("m", 10)
    s.add([first, overflow, later])
    assert s.next_batch() == [first]
    assert len(s) == 2
    assert s.next_batch() == [overflow, later]


def test_an_item_larger_than_the_budget_runs_alone_rather_than_starving():
    s = scheduler(max_batch_tokens=100)
    small, huge, after = Item("m", 10), Item("m", 500), Item("m", 10)
    s.add([small, huge, after])
    assert drain(s) == [[small], [huge], [after]]
    assert len(s) == 0


def test_the_model_whose_head_item_is_oldest_is_served_first():
    s = scheduler()
    a1 = Item("a", 5)
    b1 = Item("b", 5)
    a2 = Item("a", 5)
    c1 = Item("c", 5)
    s.add([b1])  # b's queue was created first, but a's head item is older
    s.add([a1, a2, c1])
    batches = drain(s)
    assert batches == [[a1, a2], [b1], [c1]]


def test_each_model_uses_its_own_batch_limits():
    s = scheduler(max_batch_tokens=1000, max_batch_items=1000, small=BatchLimits(10, 1000))
    s.add([Item("small", 6), Item("small", 6), Item("big", 6), Item("big", 6)])
    batches = drain(s)
    assert [(b[0].model_id, len(b)) for b in batches] == [("small", 1), ("small", 1), ("big", 2)]


def test_a_batch_never_mixes_models():
    s = scheduler()
    s.add([Item(m, 3) for m in "ababab"])
    batches = drain(s)
    assert [{i.model_id for i in b} for b in batches] == [{"a"}, {"b"}]
    assert [len(b) for b in batches] == [3, 3]


def test_cancelled_items_are_dropped_before_batching_and_leave_len():
    s = scheduler(max_batch_tokens=100)
    items = [Item("m", 40) for _ in range(5)]
    s.add(items)
    assert len(s) == 5
    items[0].cancelled = True  # at the head
    items[2].cancelled = True  # in the middle of what would be the first batch
    batch = s.next_batch()
    # Without the drops the batch would be items[0], items[1] (80 tokens); cancelled ones cost nothing.
    assert batch == [items[1], items[3]]
    assert len(s) == 1
    assert s.next_batch() == [items[4]]
    assert len(s) == 0


def test_a_model_whose_items_are_all_cancelled_is_skipped():
    s = scheduler()
    old = [Item("old", 5), Item("old", 5)]
    new = Item("new", 5)
    s.add(old + [new])
    for item in old:
        item.cancelled = True
    assert s.next_batch() == [new]
    assert len(s) == 0
    assert s.next_batch() == []


def test_an_empty_scheduler_returns_an_empty_batch():
    s = scheduler()
    assert s.next_batch() == []
    assert len(s) == 0
