"""Fair queueing: an n > 1 request's siblings queue behind requests that arrived before them, and no
request holds more than its share of the running slots (`max_num_seqs`) while others wait."""

from __future__ import annotations

from mmserve.engine.policies.fairness import insert_in_order
from helpers.scheduler_sim import fake_step, make_request, make_scheduler


def running_ids(s) -> list[str]:
    return [r.request_id for r in s.running]


def test_released_siblings_queue_behind_earlier_requests_and_before_later_ones():
    s = make_scheduler(num_blocks=256, max_tokens=64)
    s.add_request(make_request("early", range(100, 108), max_tokens=50))
    s.add_request(make_request("big", range(8), n=3, max_tokens=50))
    s.add_request(make_request("late", range(200, 208), max_tokens=50))
    s.waiting.remove(next(r for r in s.waiting if r.client_id == "big"))  # sibling 0, as if admitted
    insert_in_order(s.waiting, s.groups.held.pop("big"))  # its prompt scheduled: the others are released
    assert [r.client_id for r in s.waiting] == ["early", "big", "big", "late"]


def test_one_request_holds_no_more_than_its_share_while_others_wait():
    s = make_scheduler(num_blocks=256, max_tokens=64)
    s.add_request(make_request("big", range(8), n=16, max_tokens=50))
    fake_step(s)
    s.add_request(make_request("late", range(100, 108), max_tokens=50))
    for _ in range(3):
        fake_step(s)
    held = sum(r.client_id == "big" for r in s.running)
    assert "late" in running_ids(s)
    assert held <= 8 and held >= 4  # its share of 8 slots with two requests, at least


def test_a_completions_batch_counts_as_one_request():
    s = make_scheduler(num_blocks=256, max_tokens=256)
    batch = "cmpl-" + "ab" * 16
    for p in range(16):
        s.add_request(make_request(f"{batch}-{p}", range(10 * p, 10 * p + 8), max_tokens=50))
    fake_step(s)
    s.add_request(make_request("chatcmpl-late", range(300, 308), max_tokens=50))
    for _ in range(3):
        fake_step(s)
    assert "chatcmpl-late" in running_ids(s)
    assert sum(r.client_id.startswith(batch) for r in s.running) <= 7
