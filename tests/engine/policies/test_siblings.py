"""n > 1 alone (`engine/policies/siblings.py: SiblingGroups`): sibling 0 is queued and the others
held until its prompt is scheduled; an abort by the request's id ends every sibling."""

from __future__ import annotations

from mmserve.engine.policies.siblings import SiblingGroups
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(8)), [], SamplingParams(max_tokens=2, n=n), None, 0.0)


def test_the_others_are_released_once_sibling_0_has_scheduled_its_prompt():
    groups = SiblingGroups()
    first = groups.split(request("r", 3))
    assert first.index == 0 and groups.contains("r") and groups.held
    assert groups.release(first) == []  # nothing scheduled yet
    first.num_computed_tokens = 8
    released = groups.release(first)
    assert [r.index for r in released] == [1, 2] and not groups.held
    groups.check_integrity()


def test_finish_says_whether_others_still_run():
    groups = SiblingGroups()
    first = groups.split(request("r", 2))
    first.num_computed_tokens = 8
    (other,) = groups.release(first)
    assert groups.finish(first) and not groups.finish(other) and not groups.contains("r")


def test_an_abort_by_the_requests_id_names_every_queued_sibling_and_drops_the_held():
    groups = SiblingGroups()
    first = groups.split(request("r", 3))
    ids, dropped = groups.expand(["r", "other"])
    assert ids == [first.request_id, "other"] and len(dropped) == 2
    assert not groups.contains("r") and not groups.held
    groups.check_integrity()
