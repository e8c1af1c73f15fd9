"""The users' lane alone (`engine/policies/fairness.py: FairLane`): the next admitted is the first
waiting request within its share, a request over its share gives a slot back, and requests of other
lanes count in the shares but are never preempted by it."""

from __future__ import annotations

from mmserve.engine.policies.fairness import FairLane, group_of
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams


def req(rid: str, order: int = 0, shadow: bool = False) -> Request:
    r = Request(rid, [1, 2, 3], [], SamplingParams(max_tokens=2), None, 0.0, shadow=shadow)
    r.order = order
    return r


def sibling(cid: str, index: int) -> Request:
    r = req(f"{cid}#{index}")
    r.client_id = cid
    return r


def test_the_first_waiting_request_within_its_share_comes_to_the_head():
    lane = FairLane(4)
    running = [sibling("big", i) for i in range(3)]
    lane.waiting.extend([sibling("big", 3), req("late")])
    lane.next_up(running)
    assert [r.request_id for r in lane.waiting] == ["late", "big#3"]
    lane.next_up(running)
    assert [r.request_id for r in lane.waiting] == ["late", "big#3"]  # the head is within its share: stays


def test_with_every_slot_taken_a_request_over_its_share_gives_its_last_slot_back():
    lane = FairLane(4)
    running = [sibling("big", i) for i in range(4)]
    lane.waiting.append(req("late"))
    assert lane.over_share(running, running) == [running[-1]]
    assert lane.over_share(running[:3], running[:3]) == []  # a slot is free


def test_a_running_request_of_another_lane_counts_but_is_not_preempted():
    lane = FairLane(3)
    a, v1, v2 = req("a"), sibling("v", 0), sibling("v", 1)
    lane.waiting.append(req("late"))
    assert lane.over_share([a, v1, v2], [a, v1, v2]) == [v2]  # shares of 1: "v" holds 2
    assert lane.over_share([a, v1, v2], [a]) == []  # "v" is another lane's: over its share, yet kept


def test_released_siblings_queue_behind_earlier_arrivals():
    lane = FairLane(8)
    lane.waiting.extend([req("early", 0), req("late", 2)])
    lane.queue_released([sibling("mid", 1), sibling("mid", 2)])
    for r in list(lane.waiting)[1:3]:
        assert r.client_id == "mid"
    assert [r.request_id for r in lane.waiting][::3] == ["early", "late"]


def test_a_completions_batch_is_one_group():
    batch = "cmpl-" + "ab" * 16
    assert group_of(req(f"{batch}-3")) == batch and group_of(req("chatcmpl-x")) == "chatcmpl-x"
