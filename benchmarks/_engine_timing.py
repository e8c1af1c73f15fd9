"""Timing one request on an in-process `EngineCore` (shared by the component benchmarks;
the leading underscore keeps `mmserve bench components` from running it)."""

from __future__ import annotations

import time


def ttft(core, req) -> tuple[float, int]:
    """Seconds from add_request to the first sampled token, and the request's cached prompt tokens;
    then runs the engine until it is idle."""
    start = time.perf_counter()
    core.add_request(req)
    while True:
        for out in core.step().outputs:
            if out.request_id == req.request_id and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while core.has_unfinished_requests():
                    core.step()
                return elapsed, out.num_cached_tokens
