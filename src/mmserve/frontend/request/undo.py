"""The undo log's old import path, for the modules not yet moved to `mmserve.transport.undo`."""

from __future__ import annotations

from mmserve.transport.undo import UndoLog

__all__ = ["UndoLog"]
