"""A short soak (tests/soak.py; `make soak` runs the long one): mixed good, hostile, cancelled
and uuid-only requests and streams nobody reads, at concurrency against a real server with tiny
caches, lru and shm, then a poison request (its own 500, two restarts); then no other 5xx, an
idle engine with every block free, P0 and P1 IPC keys equal, /dev/shm as before, the answers
of a fresh server with every cache off, and the shadow cache verifier (on at the soak's rate)
re-ran some cache-served requests and found no mismatch; then all of it again with
--async-scheduling."""

from __future__ import annotations

import pytest

from soak import run_soak
from helpers.tiny_models import make_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.machine_wide]  # spawns processes (deselect with -m 'not slow')


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("soak"))


@pytest.mark.soak
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_short_soak(model_path, async_scheduling):
    """With --async-scheduling the soaked servers overlap each step with the next; the reference
    server does not, so the answers compared are the synchronous engine's."""
    # the verifier re-runs one shadow at a time: at 0.2 a loaded machine re-ran 0 of a run's candidates once
    reports = run_soak(model_path, ["lru", "shm"], requests=120, seconds=8.0, concurrency=12, seed=1,
                       async_scheduling=async_scheduling, verify_rate=0.5)
    for report in reports:
        print(report.summary())
    assert not [f for report in reports for f in report.failures], "\n".join(
        f"{report.cache_type}: {f}" for report in reports for f in report.failures)
    for report in reports:
        assert report.requests >= 30 and report.answers
        assert {"good", "hostile", "cancel", "uuid_only", "costly", "stalled", "poison"} <= set(report.outcomes)
        assert report.verified >= 1
