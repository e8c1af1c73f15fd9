"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["while", "range"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both loop headers of the attention kernels: `while` (what the interpreter runs by default)
    and `range` (what a GPU compiles; Triton 3.9's interpreter runs it too, 3.6's cannot: skipped
    there)."""
    triton = pytest.importorskip("triton")
    from mmserve.models.attention import online_softmax

    if request.param == "range" and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot take a range bound a program loaded")
    monkeypatch.setattr(online_softmax, "RANGE_LOOPS_UNDER_INTERPRETER", request.param == "range")
    return request.param
