"""The HTTP side of a request's life: its SSE response, and cancelling it when the client leaves.

Either way the request's engine generator is closed, which aborts the request in the engine core
if it still runs, so a client that disconnects before or during its answer frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Awaitable, Callable, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from mmserve.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST


class EventStream(Protocol):
    """A streamed request's SSE events (`choices.py: ChoiceStream` and its kinds)."""

    def events(self) -> AsyncGenerator[str, None]:
        """One string per engine output, the last ending in `data: [DONE]`."""
        ...

    async def close(self) -> None:
        """End the request (its engine generator closed, which aborts it if it still runs)."""
        ...


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that ends its request however the stream stops.

    The first step's events are written before anything else is set up: the first string of
    `EventStream.events()` is made first, then the status line and it leave back to back (the
    client wakes once for both, not once for the headers and again for the first token), with no
    task started on the way (Starlette's `StreamingResponse` starts its sender in a task group
    first, a few event-loop turns later).
    The rest streams in a task while this one waits for the client's disconnect, which cancels it.
    Closing here makes sure the engine generator is closed (and the request aborted) in every case.
    """

    def __init__(self, stream: EventStream, headers: dict[str, str] | None = None) -> None:
        """`headers`: more response headers (the cache report, known from the first output)."""
        self.events = stream.events()
        super().__init__(self.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        events = self.events
        try:
            first = await anext(events, None)  # the first output is in hand: no engine wait here
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
            rest = asyncio.ensure_future(self._send_rest(events, send))
            gone = asyncio.ensure_future(_wait_for_disconnect(receive))
            try:
                await asyncio.wait({rest, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                rest.cancel()
                await asyncio.gather(rest, gone, return_exceptions=True)  # `events` is free again
            if rest.done() and not rest.cancelled():
                rest.result()  # its error, if any
        except OSError:
            raise ClientDisconnect() from None
        finally:
            await events.aclose()
            await self.stream.close()

    @staticmethod
    async def _send_rest(events: AsyncGenerator[str, None], send: Any) -> None:
        async for chunk in events:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def cancel_on_disconnect(handler: Awaitable[Response], raw_request: Request) -> Response:
    """Run `handler`; if the client disconnects first, cancel it (which aborts its engine request).

    The body is read first: after it, the only message `receive()` can bring is the disconnect.
    A body that cannot be read (too large, the client gone) raises before `handler` starts.
    """
    try:
        await raw_request.body()
    except BaseException:
        if asyncio.iscoroutine(handler):
            handler.close()  # never started: close it, so no "never awaited" warning
        raise
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
