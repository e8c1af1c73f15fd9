"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["while", "range"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both loop headers of the attention kernels: `while` (what the interpreter runs by default)
    and `range` (what a GPU compiles; Triton >= 3.7's interpreter runs it too)."""
    pytest.importorskip("triton")
    from mmserve.models.attention import online_softmax

    monkeypatch.setattr(online_softmax, "RANGE_LOOPS_UNDER_INTERPRETER", request.param == "range")
    return request.param
