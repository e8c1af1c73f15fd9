"""One request's outputs on their way to its caller: at most one waiting, never a backlog.

The output loop puts an output after every engine step; a caller that reads slower than the
engine steps (a stream whose client stopped reading) would otherwise collect one cumulative
copy of the request's tokens and logprobs per step. Here an unread output is merged into the
next one (the newer one's cumulative fields, the text deltas joined), so what waits for a caller
is one output, whatever its backlog. `stalled_s` says how long the oldest unread output has
waited, so the owner can abort a request nobody reads (`OpenRequests.put`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from mmserve.outputs import RequestOutput


class OutputQueue:
    """A one-slot mailbox of `RequestOutput`s (merged while unread) or an error that ends the request."""

    def __init__(self) -> None:
        self._item: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()
        self._since: float | None = None  # when the waiting output was first put, unread since

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        """Hand `item` over; an output still unread is merged into it (an error replaces it)."""
        if isinstance(item, RequestOutput) and isinstance(self._item, RequestOutput):
            item = merge_outputs(self._item, item)
        elif isinstance(self._item, Exception):
            return  # the request has ended for its caller already
        if self._since is None:
            self._since = time.monotonic()
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | Exception:
        """The waiting output (or error), once there is one."""
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item, self._since = self._item, None, None
        return item

    def empty(self) -> bool:
        return self._item is None

    def stalled_s(self) -> float:
        """How long the waiting output has waited unread (0 when none waits)."""
        return 0.0 if self._since is None else time.monotonic() - self._since


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` with the unread text deltas of `older` in front of its own, completion by completion."""
    unread = {c.index: c.delta_text for c in older.outputs if c.delta_text}
    if not unread:
        return newer
    outputs = [replace(c, delta_text=unread.get(c.index, "") + c.delta_text) for c in newer.outputs]
    return replace(newer, outputs=outputs)
