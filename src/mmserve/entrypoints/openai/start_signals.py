"""SIGINT (Ctrl-C) and SIGTERM for an API server until uvicorn takes them (`StartSignals`).

While the server starts, a stop signal must stop it at once, also in the middle of the engine
core's start, which runs in the event loop's first step without awaiting. So there it raises
KeyboardInterrupt. Anywhere else it must not: raised inside the event loop's own machinery (uvloop's
loop being entered, before the first step) it left the loop marked running. The loop could then
not be closed, and the server printed "Cannot close a running event loop" and a pending task.
Outside the start's own code a signal is only noted. The start raises it when it begins
(`raising`), and once uvicorn is about to serve it is uvicorn's stop (`serving`).

Once the server has stopped, the process only exits: from `stopped` on, SIGINT and SIGTERM are
ignored, so that the engine cores' shutdown and the interpreter's exit complete. A second Ctrl-C
(or a terminal's and a supervisor's together) that landed there raised KeyboardInterrupt in the
middle of the cleanup, or ended the process by SIGINT (exit status -2).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartSignals:
    """Installed for SIGINT (unless ignored, as in a job started in the background) and SIGTERM
    (which acts like Ctrl-C) by `install`; both ignored by `stopped`."""

    def __init__(self) -> None:
        self.pending = False  # a signal came while it could not raise
        self.start_frame: FrameType | None = None  # the frame running the start's own code (`raising`)
        self._server: Any = None
        self._raise: Any = signal.default_int_handler

    def install(self) -> None:
        sigint = signal.getsignal(signal.SIGINT)
        if callable(sigint):
            self._raise = sigint  # the CLI's (`cli.CtrlC`: it defers a Ctrl-C out of an import) or Python's
        for signum in STOP_SIGNALS:
            if signum == signal.SIGINT and not callable(sigint):
                continue
            signal.signal(signum, self._handle)

    def stopped(self) -> None:
        """The server has stopped (or its start has): the process exits, ignoring stop signals."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        self.start_frame = None

    def raising(self) -> _StartCode:
        """`with` it around the start's own code (plain Python in the loop's first step): a signal
        raises KeyboardInterrupt at once while the frame that entered it runs (its callees too),
        and so does one that came before."""
        return _StartCode(self)

    def serving(self, server: Any) -> bool:
        """Whether uvicorn's `server` should serve (False: a signal came already). One that comes
        from here until uvicorn installs its own handlers asks it to exit."""
        self._server = server
        return not self.pending

    def _handle(self, signum: int, frame: Any) -> None:
        if self.start_frame is not None and _on_stack(self.start_frame, frame):
            self._raise(signal.SIGINT, frame)
            return
        self.pending = True
        if self._server is not None:
            self._server.should_exit = True


class _StartCode:
    """`StartSignals.raising`'s context. It marks the frame that runs the start, not a flag to
    clear: a signal that lands as the `with` is left (in `__exit__`, before it clears the frame)
    raises there, still inside the start, and none raises once that frame is off the stack, in
    the event loop's machinery, whatever was cleared."""

    def __init__(self, signals: StartSignals) -> None:
        self.signals = signals

    def __enter__(self) -> None:
        if self.signals.pending:
            raise KeyboardInterrupt
        self.signals.start_frame = sys._getframe(1)

    def __exit__(self, *exc: object) -> None:
        self.signals.start_frame = None


def _on_stack(target: FrameType, frame: FrameType | None) -> bool:
    """Whether `target` is `frame` or one of its callers."""
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False
