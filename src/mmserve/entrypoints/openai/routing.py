"""What the HTTP layer tells the engine about placing a request on a data-parallel rank."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from mmserve.entrypoints.openai.protocol import ParameterError


def routing(raw_request: Request, stream: bool) -> dict[str, Any]:
    """How the engine may place the request: `stream` (a whole answer can start over on another
    rank until its end) and the rank an `X-Data-Parallel-Rank` header forces."""
    header = raw_request.headers.get("x-data-parallel-rank")
    if header is None:
        return {"stream": stream}
    if not header.strip().isdigit():
        raise ParameterError("X-Data-Parallel-Rank", f"the X-Data-Parallel-Rank header must be a rank number; "
                             f"got {header!r}")
    return {"stream": stream, "data_parallel_rank": int(header)}
