"""Garbage-collector setting for mmserve's serving processes: the start-up heap is frozen.

Once set up, a serving process holds a few hundred thousand container objects that live as long
as it does: imported modules (torch, transformers, the HTTP stack), the tokenizer and processor,
the model's modules, the KV block pool. CPython's full (generation 2) collection traverses every
one of them, and the process does nothing else meanwhile: an API server's event loop stalls every
stream and every admission, an engine core's step loop every running request; under load full
collections come every few hundred requests (`benchmarks/gc_pause.py` measures both; figures in
the README).

Start-up itself pays the same cost over and over: imports and model loading make objects that live
as long as the process, and as the old generation grows CPython collects it again and again (several full
collections of an API server's or an engine core's start-up), to find a few hundred objects of
garbage.

So a serving process (`serving_process.py: ServingProcess`) calls `pause_collection()` first
thing, and `freeze_startup_heap()` once it is
set up and before it serves: every object then alive moves to the permanent generation, which no
collection traverses (`gc.freeze`), and collection resumes. Garbage made while serving is freed as
before; the few cycles start-up left behind stay for good. `MMSERVE_GC_FREEZE=0` makes both calls
do nothing (a debugging knob, read here only).
"""

from __future__ import annotations

import gc
import logging
import os

logger = logging.getLogger(__name__)


def _enabled() -> bool:
    return os.environ.get("MMSERVE_GC_FREEZE") != "0"


def pause_collection() -> None:
    """Collect nothing until `freeze_startup_heap()`; only in a process that serves (or exits) next."""
    if _enabled():
        gc.disable()


def freeze_startup_heap() -> int:
    """Freeze every object alive in this process now and resume collection; how many objects are
    frozen in all (0 with MMSERVE_GC_FREEZE=0)."""
    if not _enabled():
        return 0
    gc.freeze()
    gc.enable()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects", frozen)
    return frozen
