"""The fair token-budget scheduler: pure bookkeeping, so plain dataclass requests stand in for the
engine's pending requests."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.scheduler import BatchLimits, Scheduler

NOW = 1000.0


@dataclass(eq=False)
class Request:
    model_id: str
    lengths: list[int]
    deadline: float = float("inf")
    cancelled: bool = False
    next_index: int = 0
    name: str = ""


def scheduler(max_batch_tokens: int = 100, max_batch_items: int = 100, **per_model: BatchLimits) -> Scheduler:
    default = BatchLimits(max_batch_tokens, max_batch_items)
    return Scheduler(lambda model_id: per_model.get(model_id, default))


def lengths(batch) -> list[int]:
    return [request.lengths[index] for request, index in batch]


def drain(s: Scheduler, now: float = NOW) -> list[list]:
    batches = []
    while batch := s.next_batch(now)[0]:
        batches.append(batch)
    return batches


# --- the token budget ---------------------------------------------------------------------------


def test_batches_are_cut_by_the_sum_of_real_tokens_under_max_batch_tokens():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("m", [40, 30, 20, 50, 10, 45, 60]))
    batches = drain(s)
    # 40+30+20 = 90 (adding 50 would be 140); 50+10 = 60 (adding 45 would be 105); 45; 60.
    assert [lengths(b) for b in batches] == [[40, 30, 20], [50, 10], [45], [60]]


def test_a_batch_fills_the_token_budget_exactly():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("m", [50, 50, 1]))
    assert [lengths(b) for b in drain(s)] == [[50, 50], [1]]


def test_max_batch_items_caps_a_batch_even_when_tokens_fit():
    s = scheduler(max_batch_tokens=10_000, max_batch_items=3)
    s.add(Request("m", [1] * 7))
    assert [len(b) for b in drain(s)] == [3, 3, 1]


def test_the_sequence_that_overflows_stays_first_in_its_request_for_the_next_batch():
    s = scheduler(max_batch_tokens=100)
    request = Request("m", [60, 60, 5])
    s.add(request)
    first, _ = s.next_batch(NOW)
    assert [i for _, i in first] == [0]
    second, _ = s.next_batch(NOW)
    assert [i for _, i in second] == [1, 2]  # order within a request is kept


def test_a_sequence_larger_than_the_budget_runs_alone_rather_than_starving():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("m", [500, 10]))
    assert [lengths(b) for b in drain(s)] == [[500], [10]]


def test_a_shorter_sequence_of_another_request_fills_the_room_an_overflowing_one_leaves():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("m", [60, 60]))
    s.add(Request("m", [30]))
    assert [lengths(b) for b in drain(s)] == [[60, 30], [60]]


def test_len_and_num_tokens_count_what_waits():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("m", [40, 30, 50]))
    s.add(Request("n", [7]))
    assert (len(s), s.num_tokens) == (4, 127)
    s.next_batch(NOW)
    assert (len(s), s.num_tokens) == (2, 57)


# --- fairness -----------------------------------------------------------------------------------


def test_a_small_request_shares_the_next_batch_with_a_bulk_request_queued_before_it():
    s = scheduler(max_batch_tokens=1000, max_batch_items=8)
    bulk = Request("m", [10] * 2048, name="bulk")
    s.add(bulk)
    s.next_batch(NOW)  # the bulk request is running
    small = Request("m", [10], name="small")
    s.add(small)
    batch, _ = s.next_batch(NOW)
    assert small in [r for r, _ in batch]
    assert len(batch) == 8  # and the batch is still full


def test_requests_of_one_model_take_one_sequence_each_per_round():
    s = scheduler(max_batch_tokens=1000, max_batch_items=6)
    a, b, c = Request("m", [1] * 10, name="a"), Request("m", [1] * 10, name="b"), Request("m", [1], name="c")
    for r in (a, b, c):
        s.add(r)
    batch, _ = s.next_batch(NOW)
    assert [r.name for r, _ in batch] == ["a", "b", "c", "a", "b", "a"]


def test_models_take_turns_one_batch_each():
    s = scheduler(max_batch_tokens=100, max_batch_items=100)
    s.add(Request("bulk-model", [100] * 5))
    s.add(Request("other", [10]))
    s.add(Request("third", [10]))
    order = [b[0][0].model_id for b in drain(s)]
    assert order == ["bulk-model", "other", "third", "bulk-model", "bulk-model", "bulk-model", "bulk-model"]


def test_a_model_that_joins_later_waits_for_at_most_one_batch_of_the_busy_one():
    s = scheduler(max_batch_tokens=100)
    s.add(Request("busy", [100] * 10))
    s.next_batch(NOW)
    s.add(Request("late", [5]))
    batch, _ = s.next_batch(NOW)
    assert batch[0][0].model_id == "late"


def test_each_model_uses_its_own_batch_limits():
    s = scheduler(max_batch_tokens=100, max_batch_items=100, small=BatchLimits(10, 2))
    s.add(Request("small", [5, 5, 5]))
    s.add(Request("big", [50, 50]))
    batches = drain(s)
    assert [(b[0][0].model_id, lengths(b)) for b in batches] == [("small", [5, 5]), ("big", [50, 50]), ("small", [5])]


def test_a_batch_never_mixes_models():
    s = scheduler(max_batch_tokens=1000)
    for i in range(6):
        s.add(Request("ab"[i % 2], [3, 4]))
    for batch in drain(s):
        assert len({r.model_id for r, _ in batch}) == 1


# --- dropping -----------------------------------------------------------------------------------


def test_cancelled_requests_are_dropped_before_batching_handed_back_and_leave_len():
    s = scheduler(max_batch_tokens=100)
    gone, kept = Request("m", [10, 10, 10]), Request("m", [20])
    s.add(gone)
    s.add(kept)
    gone.cancelled = True
    batch, dropped = s.next_batch(NOW)
    assert [r for r, _ in batch] == [kept]
    assert dropped == [gone]
    assert (len(s), s.num_tokens) == (0, 0)


def test_a_request_past_its_deadline_is_dropped_with_its_remaining_sequences():
    s = scheduler(max_batch_tokens=10)
    late = Request("m", [10, 10, 10], deadline=NOW + 1)
    s.add(late)
    s.next_batch(NOW)  # its first sequence runs in time
    batch, dropped = s.next_batch(NOW + 2)
    assert batch == [] and dropped == [late]
    assert late.next_index == 1 and len(s) == 0


def test_a_model_whose_requests_are_all_cancelled_is_skipped():
    s = scheduler()
    gone = Request("a", [5])
    s.add(gone)
    s.add(Request("b", [6]))
    gone.cancelled = True
    batch, dropped = s.next_batch(NOW)
    assert lengths(batch) == [6] and dropped == [gone]
    assert s.next_batch(NOW) == ([], [])


def test_drain_hands_back_every_waiting_request():
    s = scheduler()
    a, b = Request("a", [5]), Request("b", [6, 7])
    s.add(a)
    s.add(b)
    assert set(map(id, s.drain())) == {id(a), id(b)}
    assert (len(s), s.num_tokens) == (0, 0) and s.next_batch(NOW) == ([], [])


def test_an_empty_scheduler_returns_an_empty_batch():
    assert scheduler().next_batch(NOW) == ([], [])


def test_a_long_sequence_behind_a_bulk_request_runs_in_the_very_next_batch():
    s = scheduler(max_batch_tokens=512)
    s.add(Request("m", [100] * 2000, name="bulk"))
    long = Request("m", [512], name="long")
    s.add(long)
    s.next_batch(NOW)  # bulk items fill it; the long one does not fit
    batch, _ = s.next_batch(NOW)
    assert [r.name for r, _ in batch] == ["long"]


def test_with_an_item_limit_a_late_request_is_not_passed_over_by_earlier_bulk_requests():
    s = scheduler(max_batch_tokens=10_000, max_batch_items=4)
    for name in "abcd":
        s.add(Request("m", [1] * 100, name=name))
    late = Request("m", [1], name="late")
    s.add(late)
    waited = 0
    while late.next_index == 0:
        s.next_batch(NOW)
        waited += 1
    assert waited <= 2
