"""A completions batch whose caller stops reading pauses its prompts (issue 40, item 4): the merged
queue held every output of every prompt, one cumulative copy per step, however slow the caller."""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator

from mmserve.entrypoints.openai.prompt_batch import merged_outputs
from mmserve.outputs import CompletionOutput, RequestOutput

STEPS = 200


def test_a_caller_that_stops_reading_pauses_the_prompts():
    produced = [0, 0]

    async def prompt(p: int) -> AsyncGenerator[RequestOutput, None]:
        for step in range(STEPS):
            produced[p] += 1
            yield RequestOutput(f"r-{p}", None, [1, 2], [CompletionOutput(0, "x" * (step + 1), list(range(step + 1)),
                                                                          delta_text="x")], step == STEPS - 1)
            await asyncio.sleep(0)

    async def run() -> tuple[int, str]:
        merged = merged_outputs("r", [prompt(0), prompt(1)], 1)
        first = await merged.__anext__()
        for _ in range(50):  # the caller reads nothing while the prompts could run to the end
            await asyncio.sleep(0)
        paused_at = sum(produced)
        rest = [c.delta_text async for o in merged for c in o.outputs]
        text = "".join(c.delta_text for c in first.outputs) + "".join(rest)
        return paused_at, text

    paused_at, text = asyncio.run(run())
    assert paused_at <= 6  # one waiting output per prompt, and each pump's next one in hand
    assert produced == [STEPS, STEPS] and len(text) == 2 * STEPS  # once read again, every output came
