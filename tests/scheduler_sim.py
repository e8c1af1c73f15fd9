"""Driving a `Scheduler` without a model: the runner is simulated."""

from __future__ import annotations

from mmserve.engine.scheduler import Scheduler
from mmserve.ipc.messages import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput


def fake_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """Schedule, then 'sample' `token` for every request whose known tokens are all computed."""
    so = s.schedule()
    sampled = {rid: ([token] if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens else [])
               for rid in so.num_scheduled_tokens}
    out = s.update_from_output(so, ModelRunnerOutput(sampled))
    s.check_integrity()
    return so, out
