"""The shadow lane alone (`engine/policies/shadows.py`): it takes the cache verifier's re-runs,
admits only while none of them runs, reads no cache and gives its place to users' requests."""

from __future__ import annotations

import pytest

from mmserve.engine.policies.shadows import ShadowLane
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams


def req(rid: str, shadow: bool) -> Request:
    return Request(rid, [1, 2, 3], [], SamplingParams(max_tokens=2), None, 0.0, shadow=shadow)


def test_it_takes_shadows_only():
    lane = ShadowLane()
    assert lane.takes(req("s", True)) and not lane.takes(req("a", False))


def test_it_admits_while_no_shadow_runs():
    lane = ShadowLane()
    assert lane.may_admit([req("a", False)]) and not lane.may_admit([req("a", False), req("s", True)])


def test_it_is_spare_and_reads_no_cache():
    assert ShadowLane.spare and not ShadowLane.reads_caches


def test_two_running_shadows_break_its_invariant():
    lane = ShadowLane()
    lane.check_integrity([req("s", True)])
    with pytest.raises(AssertionError, match="more than one shadow"):
        lane.check_integrity([req("s", True), req("t", True)])
