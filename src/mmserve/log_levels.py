"""mmserve's log level, handed from a serving process to the processes it spawns.

A spawned process starts with logging unconfigured, so the engine core's and the workers' start-up
lines (KV blocks, the model's resident weight bytes, the attention backend, TP workers ready) were
dropped: only warnings reached the terminal. The parent passes `current()` with the other arguments
of the child's entry point, and the child calls `adopt` first."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str | int) -> None:
    """Log mmserve's records at `level` (a name such as "info", or a logging level) to stderr."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format=FORMAT)
    logging.getLogger("mmserve").setLevel(level.upper() if isinstance(level, str) else level)


def current() -> int:
    """The level this process logs mmserve's records at (for a child to `adopt`)."""
    return logging.getLogger("mmserve").getEffectiveLevel()


def adopt(level: int) -> None:
    """In a spawned child: log as the parent does (`current()` in the parent). A parent that never
    configured logging (an offline `LLM`'s host) passes WARNING, the default: nothing changes."""
    if level < logging.WARNING:
        configure(level)
