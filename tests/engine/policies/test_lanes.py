"""The lanes alone (`engine/policies/lane.py`), with plain requests: which lane a request is in, who
is preempted when blocks run out, whose place a request that cannot be admitted takes."""

from __future__ import annotations

from mmserve.engine.policies.fairness import FairLane
from mmserve.engine.policies.lane import Lane, Lanes
from mmserve.engine.policies.shadows import ShadowLane
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams


def req(rid: str, shadow: bool = False) -> Request:
    return Request(rid, [1, 2, 3], [], SamplingParams(max_tokens=2), None, 0.0, shadow=shadow)


def lanes() -> tuple[Lanes, Lane, Lane]:
    users, shadows = FairLane(8), ShadowLane()
    return Lanes(users, shadows), users, shadows


def test_a_request_is_in_the_first_other_lane_that_takes_it_else_in_the_first():
    both, users, shadows = lanes()
    assert both.of(req("a")) is users and both.of(req("s", shadow=True)) is shadows
    assert list(both) == [users, shadows]


def test_the_victim_is_the_last_admitted_of_the_last_lane_with_one_running():
    both, users, shadows = lanes()
    a, s, b = req("a"), req("s", shadow=True), req("b")
    assert both.victim([a, s, b]) is s  # a shadow before any user's request, wherever it was admitted
    assert both.victim([a, b]) is b
    assert both.members(users, [a, s, b]) == [a, b] and both.members(shadows, [a, s, b]) == [s]


def test_a_users_request_may_take_a_spare_lanes_place_and_not_the_other_way():
    both, users, shadows = lanes()
    a, s = req("a"), req("s", shadow=True)
    assert both.spare_after(users, [a, s]) is s
    assert both.spare_after(users, [a]) is None
    assert both.spare_after(shadows, [a, s]) is None  # no lane after the shadows'


def test_a_lane_that_is_not_spare_gives_no_place():
    fifo = Lane()
    both = Lanes(FairLane(8), fifo)
    assert both.spare_after(both.first, [req("a")]) is None  # the FIFO lane takes every request, but is not spare


def test_integrity_finds_a_request_in_another_lanes_queue():
    both, users, shadows = lanes()
    users.waiting.append(req("s", shadow=True))
    try:
        both.check_integrity([])
    except AssertionError as e:
        assert "another lane" in str(e)
    else:
        raise AssertionError("a shadow in the users' queue went unnoticed")
