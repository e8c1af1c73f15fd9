"""An undo log: a request's steps in P0 before the engine accepted it, taken back when one fails.

Taken back in reverse order (see `frontend/request/admission.py: Admission.admit`, which runs it).
It sits here, in `transport/` under `frontend/`, because the item transport registers its own steps
in it (`item_transport.py: ItemTransport.to_wire`) and a layer does not import the one above it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)


class UndoLog:
    """The undo steps of one request, run last first.

    `push(fn, *args)` after each step that changed shared state; `run()` undoes them all (last
    first, each once; an undo step that raises is logged and the others still run)."""

    def __init__(self) -> None:
        self._steps: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def push(self, fn: Callable[..., Any], *args: Any) -> None:
        self._steps.append((fn, args))

    def run(self) -> None:
        while self._steps:
            fn, args = self._steps.pop()
            try:
                fn(*args)
            except Exception:  # one broken undo must not leave the others undone
                logger.exception("undo step %s failed", getattr(fn, "__qualname__", fn))
