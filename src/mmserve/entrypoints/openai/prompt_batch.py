"""Several prompts in one `/v1/completions` request, answered as one request (OpenAI's batch form).

Each prompt runs as its own engine request; `merged_outputs` turns their outputs into one stream of
`RequestOutput`s as if one request had `len(prompts) * n` completions: prompt p's completion i is
choice `p * n + i`, `prompt_token_ids` is every prompt's tokens (so usage counts them all) and
`num_cached_tokens` their sum (`cache_report` each layer's sums). Each merged output holds every
choice known so far with only the prompt that just advanced carrying new `delta_text`, so a
choice's text is given out once. The prompts' outputs wait in a queue of one slot per prompt: a
caller that stops reading pauses every prompt's pump, so their outputs merge in each request's own
queue (`frontend/request/output_queue.py`) instead of piling up here. Closing
the merged generator (or an error in any prompt) closes every prompt's generator, which aborts
those still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncGenerator

from mmserve.cache_report import CacheReport
from mmserve.outputs import RequestOutput


async def merged_outputs(request_id: str, outputs: list[AsyncGenerator[RequestOutput, None]],
                         n: int) -> AsyncGenerator[RequestOutput, None]:
    latest: list[RequestOutput | None] = [None] * len(outputs)
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(len(outputs))
    pumps = [asyncio.ensure_future(_pump(p, gen, queue)) for p, gen in enumerate(outputs)]
    try:
        running = len(outputs)
        while running:
            p, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            latest[p] = item
            yield _merge(request_id, latest, p, n)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for gen in outputs:
            await gen.aclose()


async def _pump(p: int, gen: AsyncGenerator[RequestOutput, None],
                queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]]) -> None:
    try:
        async for out in gen:
            await queue.put((p, out))  # waits while the caller is not reading
        await queue.put((p, None))
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # the merged generator raises it
        await queue.put((p, e))


def _merge(request_id: str, latest: list[RequestOutput | None], fresh: int, n: int) -> RequestOutput:
    completions, prompt_ids, cached = [], [], 0
    for p, out in enumerate(latest):
        if out is None:
            continue
        prompt_ids += out.prompt_token_ids
        cached += out.num_cached_tokens or 0
        completions += [dataclasses.replace(c, index=p * n + c.index, delta_text=c.delta_text if p == fresh else "")
                        for c in out.outputs]
    finished = all(out is not None and out.finished for out in latest)
    reports = [out.cache_report for out in latest if out is not None and out.cache_report is not None]
    return RequestOutput(request_id, None, prompt_ids, completions, finished, cached,
                         CacheReport.combined(reports) if reports else None)
